"""`UserCodeChecks`: where `HybridStrategy` meets what users write -- their loaders, losses, model code, random ops and
gradient hooks -- every check of docs/correctness.md's "What the strategy verifies" in one object per setup.

The strategy calls it at the points of Lightning's loop the method names say; each check is a module of its own:
`lightning_hybrid.checks.batch_check` (peers get the same batch), `lightning_hybrid.checks.loss_semantics` (how the loss
reduces), `lightning_hybrid.checks.probe` (what splitting the sequence or the rows changes),
`lightning_hybrid.checks.randomness` (random ops), `lightning_hybrid.checks.gradient_guard` (what user code computes
from gradients a rank holds pieces of). Every check raises
alike
on every rank, before the first optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.checks.batch_check import BatchCheck
from lightning_hybrid.checks.gradient_guard import WATCHED_STEPS, LocalGradients
from lightning_hybrid.checks.loss_semantics import (
    check_decomposition,
    declared_reduction,
    ignored_tokens,
    undeclared_error,
)
from lightning_hybrid.checks.probe import FirstStepProbe
from lightning_hybrid.checks.randomness import RandomOpsProbe, SplitSpans, rank_seed, seed_streams
from lightning_hybrid.core.batch import TokenBatch
from lightning_hybrid.core.dims import ParallelDims
from lightning_hybrid.options import ParallelOptions
from lightning_hybrid.parallelize import Parallelized
from lightning_hybrid.runtime.rank_zero import BatchError, raise_from_rank_zero

__all__ = ["UserCodeChecks"]


class UserCodeChecks:
    """The checks of one setup of ``module`` parallelised as ``parallelized`` under ``dims``/``options``, on this
    rank (``rank``, of ``world_size``; ``dp_rank``: its data-parallel rank); ``accumulate``: Lightning's
    ``accumulate_grad_batches``. `close` removes the hooks it put on the module."""

    def __init__(self, module: nn.Module, parallelized: Parallelized, dims: ParallelDims, options: ParallelOptions,
                 device: torch.device, rank: int, world_size: int, dp_rank: int, accumulate: int) -> None:
        self.module, self.dims, self.options, self.device = module, dims, options, device
        self.rank, self.world_size = rank, world_size
        self.reduction = declared_reduction(module)  # how the loss reduces: token_mean, mean, sum, or None
        self.coordinates = dims.coordinates(rank)  # (pp, dp, cp, tp)
        self.context = parallelized.context
        self.batches: Optional[BatchCheck] = None
        if dims.world_size > 1:  # ranks that share a batch, ranks that must not: checked from the first one of a run
            coordinates = [dims.coordinates(r) for r in range(world_size)]
            self.batches = BatchCheck(dp_rank, coordinates, device, options.batch_check_interval)
        self.spans: Optional[SplitSpans] = None
        if dims.tp > 1:  # switching each TP rank's stream (randomness="independent", no SP), else for the check
            switch = options.randomness == "independent" and not options.sequence_parallel
            self.spans = SplitSpans(self.coordinates[3], device, switch)
            if switch:
                self.spans.attach(module)
        self.tp_sharded = parallelized.tp_sharded  # the parameters that are TP shards, by name
        self.probe, self._probe_handle, self._probe_armed = self._prepare_probe(parallelized, accumulate)
        self._loss_verified = self._random_checked = False
        self._steps = 0  # optimizer steps: the first ones' hooks are watched
        self._watch: Optional[LocalGradients] = None

    def close(self) -> None:
        if self.spans is not None:
            self.spans.detach()
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None

    # ------------------------------------------------------------------ batches
    def check_batch(self, batch: Any, stage: str) -> None:
        """A batch as it reaches the device: compared with the peers' where due (`BatchCheck`)."""
        if self.batches is not None:
            self.batches.check(batch, f"{stage} batch {self.batches.seen}", training=stage == "train")

    def split(self, read: Any, share: TokenBatch, training: bool) -> None:
        """A training batch as read and this rank's share of it (a dimension's hook split it, as CP does): the
        first one for the probe."""
        if self.probe is not None and not self.probe.ran and training:
            self.probe.whole, self.probe.share = TokenBatch.from_batch(read), share

    # ------------------------------------------------------------------ the loss
    def refuse_undeclared_loss(self, batch: Any) -> None:
        """Under a layout that splits batches (over DP or CP ranks, or into micro-batches), a module that does not
        say how its loss reduces trains with the mean of per-part means, which one device's loss is only where every
        part has as many loss items: a batch with ignored labels or padding is refused on every rank (one
        all-reduce of a flag per step; `lightning_hybrid.checks.loss_semantics`)."""
        dims = self.dims
        if self.reduction is not None or dims.dp * dims.cp * dims.pp == 1 or not self.module.automatic_optimization:
            return
        flag = torch.tensor([int(ignored_tokens(batch))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag):
            layout = ", ".join(f"{n}={v}" for n, v in (("dp", dims.dp), ("cp", dims.cp), ("pp", dims.pp)) if v > 1)
            raise_from_rank_zero(BatchError(undeclared_error(self.module, layout)))

    def loss_verifier(self, loss_items: Optional[Callable[[Tensor], Tensor]],
                      pipelined: bool) -> Optional[Callable[[Callable, Any, Tensor], Optional[str]]]:
        """For the first training step, where the module has a ``loss_fn``: what checks its first call against the
        declared reduction (`lightning_hybrid.checks.loss_semantics.check_decomposition`; every rank's verdict, where
        every
        rank calls it -- under a pipeline the last stage's, which the executor gathers); else ``None``."""
        if self._loss_verified or not callable(getattr(self.module, "loss_fn", None)) or self.reduction == "mean":
            return None
        self._loss_verified = True  # a loss computed without loss_fn in the first step is not either later
        reduction, name = self.reduction, type(self.module).__name__

        def verify(loss_fn: Callable, output: Any, target: Tensor) -> Optional[str]:
            message = check_decomposition(loss_fn, loss_items, reduction, output, target, name)
            if pipelined:
                return message
            verdicts: list[Optional[str]] = [None] * self.world_size
            dist.all_gather_object(verdicts, message)
            return next((m for m in verdicts if m is not None), None)

        return verify

    # ------------------------------------------------------------------ the first step
    @contextmanager
    def first_step(self) -> Iterator[None]:
        """Around every training step; the first one runs the probe (at its first call of the module's forward)
        and the random-op check."""
        with self._probing(), self._checking_random_ops():
            yield

    def _prepare_probe(self, parallelized: Parallelized, accumulate: int) -> tuple[Optional[FirstStepProbe],
                                                                                   Optional[Any], list[bool]]:
        """Where the layout splits sequences (CP) or the rows of the global batch (DP, micro-batches,
        accumulation; not under ``compile``): `FirstStepProbe` at the module's first forward in training."""
        dims, armed = self.dims, [False]
        splits = [f"{n}={v}" for n, v in (("dp", dims.dp), ("pp", dims.pp)) if v > 1]
        if accumulate > 1:
            splits.append(f"accumulate_grad_batches={accumulate}")
        # Not under compile (no CP there): its forwards in eval mode without gradients would compile every layer
        # again for a check of the rows alone.
        if dims.cp == 1 and (not splits or self.options.compile is not None):
            return None, None, armed
        pipeline = parallelized.pipeline
        stages = (pipeline.stage_modules, pipeline.owners, pipeline.group) if pipeline is not None else None
        probe = FirstStepProbe(self.module, self.context, ", ".join(splits) or None, self.device, stages)

        def hook(_: Any, args: tuple, kwargs: dict) -> None:
            if armed[0]:
                probe(args, kwargs)

        return probe, self.module.register_forward_pre_hook(hook, with_kwargs=True), armed

    @contextmanager
    def _probing(self) -> Iterator[None]:
        """The first training step: its first call of the module's forward runs the probe. Under CP, a step that
        never calls it (a training_step calling a submodule directly) is refused: the split cannot be verified."""
        probe = self.probe
        if probe is None or probe.ran:
            yield
            return
        self._probe_armed[0] = True
        try:
            yield
        finally:
            self._probe_armed[0] = False
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None
        if not probe.ran and self.context is not None:
            raise ValueError(
                f"cp={self.context.size}: {type(self.module).__name__}'s training_step did not call the module's"
                " forward (self(...)), through which context parallelism runs the model on the whole sequence at"
                " the first step to verify the split (lightning_hybrid.checks.probe): call"
                " self(tokens.input_ids, position_ids=tokens.position_ids) in training_step, or train with cp=1."
            )

    @contextmanager
    def _checking_random_ops(self) -> Iterator[None]:
        """Around the first training step under ``randomness="exact"``: the random ops it runs (`RandomOpsProbe`),
        then on every rank a ``ValueError`` naming those that cannot draw one device's values under this layout.
        Under ``compile`` (whose graphs a probe would change) the dropout modules are read instead."""
        if self._random_checked or self.options.randomness != "exact":
            yield
            return
        self._random_checked = True
        dims, sp, module = self.dims, self.options.sequence_parallel, self.module
        # Where a rank holds what one device holds: every rank draws one device's values (outside TP split spans).
        whole = dims.dp * dims.cp == 1 and dims.pp == 1 and not sp
        if self.options.compile is not None:
            yield
            found = [("dropout", name, True) for name, sub in module.named_modules()
                     if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0]
        else:
            spans = self.spans
            if spans is not None:
                spans.attach(module)
            probe = RandomOpsProbe(spans).watch(module)
            try:
                with probe:
                    yield
            finally:
                probe.close()
                if spans is not None:
                    spans.detach()
            found = probe.found
        refused = [f"{op} in {where}" + (" (inside a TP split span)" if inside else "")
                   for op, where, inside in found if not whole or inside]
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, refused)
        refused = list(dict.fromkeys(r for per_rank in gathered for r in per_rank))
        if refused:
            layout = ", ".join(f"{n}={v}" for n, v in (("dp", dims.dp), ("cp", dims.cp), ("pp", dims.pp),
                                                       ("tp", dims.tp)) if v > 1) + (" with SP" if sp else "")
            raise ValueError(
                f"{type(module).__name__} runs random ops in training that cannot draw what one device draws under"
                f" {layout}: {refused[:6]}{' ...' if len(refused) > 6 else ''}. Every rank would draw the same values"
                " for other data (other samples, other tokens, other heads, other micro-batches): correlated noise,"
                " and another model than one device. Train with HybridStrategy(randomness='independent') (every rank"
                " its own streams: statistically, not bitwise, one device's run), or without them (dropout p=0,"
                " deterministic routing)."
            )

    def seed_streams(self) -> None:
        """At the start of training, after Lightning has seeded: under ``randomness="independent"`` this rank's own
        streams (TP ranks share theirs outside split spans, unless under SP)."""
        if self.options.randomness != "independent":
            return
        pp, dp, cp, tp = self.coordinates
        tp_rank = tp if self.options.sequence_parallel else None
        seed_streams(rank_seed(torch.initial_seed(), dp, cp, pp, tp_rank), self.device)

    # ------------------------------------------------------------------ gradients users touch
    @contextmanager
    def watch_gradients(self, unreduced: bool = False) -> Iterator[None]:
        """The hooks between a backward and its optimizer step (``on_after_backward``, the precision plugin's
        ``_after_closure``) run under `LocalGradients` during the first optimizer steps, where a rank holds pieces of
        the gradients (TP shards, pipeline stages, experts; ``unreduced``: each rank's own batches' part, inside an
        accumulation window): what the user computes from them alone is refused."""
        dims = self.dims
        pieces = [f"{n}={v}" for n, v in (("tp", dims.tp), ("pp", dims.pp), ("ep", dims.ep)) if v > 1]
        if unreduced:
            pieces.append(f"dp*cp={dims.dp * dims.cp} inside an accumulation window (each rank's gradients are its own"
                          " batches' part until the window's last backward)")
        if not pieces or self._steps >= WATCHED_STEPS:
            yield
            return
        shards = [p for n, p in self.module.named_parameters() if n in self.tp_sharded]
        whole = dims.pp > 1 or dims.ep > 1 or unreduced  # a rank's set of gradients is part of the model's
        watched = list(self.module.parameters()) if whole else shards
        self._watch = LocalGradients(watched, " x ".join(pieces), shards)
        try:
            with self._watch:
                yield
        finally:
            self._watch = None

    def own_norms(self) -> ContextManager[Any]:
        """The strategy's own norms of the gradients: not the user's (`watch_gradients`)."""
        return self._watch.suspended() if self._watch is not None else contextlib.nullcontext()

    def stepped(self) -> None:
        """An optimizer step is done."""
        self._steps += 1
