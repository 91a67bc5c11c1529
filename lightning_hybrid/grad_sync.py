"""`GradientSync`: everything that happens to gradients between the backward and the optimizer step, in one object.

It owns
* the **accumulation window**: inside `accumulating` (Lightning's ``block_backward_sync``, the backward passes of
  a window but the last) nothing is reduced -- ZeRO 0-2's buckets, FSDP2's roots and the pipeline's stages all
  hold their reduction; under manual optimization the buckets reduce once, at the step (`flush`), however many
  ``manual_backward`` calls came before it;
* the **pipeline's gradient stash**: under ``pp > 1`` the schedule runs the backward inside ``training_step``;
  without buckets the gradients are kept away from Lightning's ``zero_grad`` (which comes between
  ``training_step`` and ``backward``) and given back in `unstash`;
* the **DP reduction** (`reduce`): ZeRO 0-2's buckets (`lightning_hybrid.parallel.zero`; their layout stays private to
  it) are waited for (or, under PP, reduced); ZeRO-3's FSDP2 has reduced in backward;
* the **TP partial-gradient sum**: replicated parameters whose per-rank gradient is a part (norms and row biases in
  sequence-split regions, per-head norms) are summed over TP once per step, after the DP reduction;
* the **loss's reduction** (`lightning_hybrid.checks.loss_semantics`): where each batch's backward was that of its loss
  sum (`add_loss_items`: token weighting) the reduced gradients are divided by the loss items of the whole window over
  DP (the global batch's token mean); for a loss that is a sum (``sum_loss``) the DP average is undone (the sum
  over the ranks);
* the **tied parameters** across pipeline stages (`lightning_hybrid.parallel.tied`): each copy's gradient summed over
  the stages that hold one, counted once in norms;
* the **gradient norm**: the global norm over TP and ZeRO shards and pipeline stages (clipping by it), and each
  parameter's whole-gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Optional, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.core.collectives import sum_grads_over_tp_
from lightning_hybrid.core.devices import device_memory_bytes, local_tensor
from lightning_hybrid.grad_norm import clip_grads_, global_grad_norm, parameter_grad_norms
from lightning_hybrid.parallel.tied import sum_tied_grads
from lightning_hybrid.parallel.zero import (
    AUTO_WINDOW_FRACTION,
    ParameterGathers,
    ShardedGradient,
    ZeroOptimizer,
)
from lightning_hybrid.parallelize import Parallelized

T = TypeVar("T")


class GradientSync:
    """The gradient synchronisation of one parallelised module (`Parallelized`) under ``zero_stage``.

    `wrap_optimizers` puts the user's optimizers on gradient buckets (ZeRO 0-2 with ``dp > 1``); the other methods
    are called by `HybridStrategy` at the points of Lightning's loop their names say. Collectives run on the
    meshes' groups: the DP reduction over ``dp_cp``, the partial sums over ``tp``, the norm over all three.
    """

    #: Under PP, each stage's last backward of a window starts the buckets it completes (else all after the
    #: schedule, as before: `benchmarks/bench_overlap.py --cpu` compares the two in one run).
    reduce_during_last_backward = True

    def __init__(self, parallelized: Parallelized, zero_stage: int, bucket_cap_mb: float, device: torch.device,
                 grad_reduce: str = "auto") -> None:
        self.parallelized, self.zero_stage, self.bucket_cap_mb = parallelized, zero_stage, bucket_cap_mb
        self.device = device
        meshes = parallelized.meshes
        self.dp_group, self.tp_group, self.pp_group = (meshes.group(n) for n in ("dp_cp", "tp", "pp"))
        # What a ZeRO-3 shard is split over: the DP group, or under HSDP the shard group (replicated across others).
        self.shard_group = meshes.group("dp_shard_cp")
        self.dp = meshes.size("dp_cp")
        self.ep_group = meshes.group("ep") if "ep" in meshes else None
        self.optimizers: list[Optimizer] = []
        self.blocked = False
        self._items: Optional[Tensor] = None  # loss items of the window so far (token-weighted losses)
        self.sum_loss = False  # the module's loss is a sum over items: the ranks' gradients are summed
        self.manual = False  # manual optimization: every backward before a step adds up, reduced once (`flush`)
        self._pending = False  # manual optimization: backward passes since the last reduction
        self._stash: list[tuple[torch.nn.Parameter, Optional[Tensor]]] = []
        #: ZeRO-3 under accumulation: reduce-scatter every batch of the window (else once, after the last).
        self.reduce_every_batch = resolve_grad_reduce(grad_reduce, parallelized, device)
        #: ZeRO 1-2: the updated slices' all-gathers, waited for by the next forward where ``deferring``.
        self.gathers = ParameterGathers()

    @property
    def module(self) -> torch.nn.Module:
        return self.parallelized.module

    # ------------------------------------------------------------------ optimizers
    def wrap_optimizers(self, optimizers: list[Optimizer], defer_gathers: bool = False) -> list[Optimizer]:
        """ZeRO 0-2 over DP (``dp > 1``): each optimizer wrapped by `ZeroOptimizer` on gradient buckets; else as
        they are. The returned list is the one the other methods work with. ``defer_gathers``: ZeRO 1-2's
        parameter gathers run under the next forward (`after_step`, `parameters_whole`)."""
        self.close()
        self.gathers.deferring = defer_gathers
        if self.zero_stage in (0, 1, 2) and self.dp > 1:
            names = {id(p): n for n, p in self.module.named_parameters()}
            tp_sharded = {i for i, n in names.items() if n in self.parallelized.tp_sharded}
            experts = None
            if "edp" in self.parallelized.meshes:
                ids = {i for i, n in names.items() if n in self.parallelized.expert_params}
                experts = (ids, self.parallelized.meshes.group("edp"))
            optimizers = [
                ZeroOptimizer(opt, self.dp_group, self.zero_stage, tp_sharded, self.bucket_cap_mb, names, experts,
                              self.gathers)
                for opt in optimizers
            ]
        self.optimizers = list(optimizers)
        for opt in self._zero():  # manual optimization: the buckets reduce at the step, not during backward
            opt.gradients.sync = not self.manual
        return self.optimizers

    def _zero(self) -> list[ZeroOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, ZeroOptimizer)]

    def close(self) -> None:
        """Remove the buckets' backward hooks (a later fit wraps new optimizers with buckets of their own); no
        parameter gather is waited for any more."""
        self.stop()
        for opt in self._zero():
            opt.gradients.remove()
        self.optimizers = []

    # ------------------------------------------------------------------ ZeRO 1-2's parameter gathers
    def after_step(self) -> None:
        """After the optimizer step (and its agreement collective): the queued gathers start; until the next
        forward ends (`parameters_whole`) a read of a parameter in flight waits for its bucket."""
        self.gathers.start()
        self.gathers.guard()

    def parameters_whole(self) -> None:
        """Every gather of the last step done, the guard off."""
        self.gathers.release()

    def stop(self) -> None:
        """The run stops (an error, teardown): the guard off, nothing waited for."""
        self.gathers.drop()

    # ------------------------------------------------------------------ the accumulation window
    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """The backward passes of an accumulation window but the last: no reduction anywhere."""
        self.blocked = True
        for root in self.parallelized.fsdp_roots:
            root.set_requires_gradient_sync(self.reduce_every_batch)
        for opt in self._zero():
            opt.gradients.sync = False
        try:
            yield
        finally:
            self.blocked = False
            for root in self.parallelized.fsdp_roots:
                root.set_requires_gradient_sync(True)
            for opt in self._zero():
                opt.gradients.sync = True

    def holds_local_parts(self) -> bool:
        """Whether each rank's ``.grad`` are its own batches' part of the gradients, reduced later: ZeRO 0-2 under
        ``dp * cp > 1`` inside an accumulation window, or between manual backward passes and their step."""
        return self.dp > 1 and not self.parallelized.fsdp_roots and (self.blocked or self._pending)

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """While Lightning's ``on_after_backward`` runs: under ZeRO-3 inside a window reduced once after its last
        batch, FSDP2 holds each rank's unsharded part of the gradients and ``p.grad`` is ``None`` -- a hook scaling
        or clipping every ``p.grad`` that is not ``None`` would silently skip them all. Each gradient is a
        `ShardedGradient` there that refuses any use, naming ``grad_reduce="micro_batch"`` (every batch's gradient
        reduce-scattered into ``p.grad``, where a hook's change is one device's)."""
        if not (self.blocked and self.parallelized.fsdp_roots and not self.reduce_every_batch):
            yield
            return
        why = ("under zero_stage=3 the gradients of an accumulation window are reduce-scattered after its last batch"
               " (grad_reduce='window'), so until then no rank holds p.grad (FSDP2 keeps each rank's unsharded part)."
               " To read or change gradients in on_after_backward at every batch, use"
               " HybridStrategy(grad_reduce='micro_batch'): each batch's gradient is then reduce-scattered into"
               " p.grad, and the hook changes one device's gradient (its shard).")
        held = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        for name, p in held:
            p.grad = ShardedGradient(p, name, 3, why)
        try:
            yield
            assigned = [name for name, p in held if not isinstance(p.grad, ShardedGradient)]
            if assigned:  # ``p.grad = ...`` in the hook: FSDP2 would never see it
                raise RuntimeError(f"p.grad of {assigned} assigned in on_after_backward: {why}")
        finally:
            for _, p in held:
                p.grad = None

    def pipeline_step(self, run: Callable[[], T], first_in_window: bool) -> T:
        """Run ``run()`` -- a training step whose pipeline schedule runs forward and backward -- so that its
        gradients add up over the accumulation window and reach `reduce` whole. ``first_in_window``: the step
        starts a window (the ``zero_grad`` Lightning would have done before a backward is done here)."""
        pipeline = self.parallelized.pipeline
        assert pipeline is not None
        pipeline.reduce_grads = not self.blocked or self.reduce_every_batch
        zero = self._zero()
        pipeline.on_last_backward = None
        if zero:
            # Gradients collect in the buckets (Lightning's zero_grad, which comes after this, leaves them there);
            # each stage's last backward of the window starts the reductions of the buckets it completes, `reduce`
            # the rest and waits. Not with copies of a tied parameter, whose sum over the stages comes first.
            for opt in zero:
                if first_in_window:
                    opt.gradients.clear()
                opt.gradients.sync = False
            if self.reduce_during_last_backward and not self.parallelized.tied and not self.manual:
                pipeline.on_last_backward = partial(_eager, [opt.gradients for opt in zero])
            output = run()
            # A zero-bubble schedule's weight pass sets .grad itself (no post-accumulate hook): into the buckets
            # now, or Lightning's zero_grad would drop this batch's gradients of the window.
            for opt in zero:
                opt.gradients.adopt()
            return output
        # No buckets (dp=1, ZeRO-3): the schedule starts from no gradients; what earlier batches of the window
        # left is added back afterwards; the sum is kept away from Lightning's zero_grad until `unstash`.
        params = list(self.module.parameters())
        earlier = _take_grads(params)
        output = run()
        now = _take_grads(params)
        self._stash = [(p, g if first_in_window else _add(e, g)) for p, e, g in zip(params, earlier, now)]
        return output

    def unstash(self) -> None:
        """Give the parameters back the gradients `pipeline_step` kept (Lightning's ``backward`` under PP)."""
        for p, grad in self._stash:
            p.grad = grad
        self._stash = []

    # ------------------------------------------------------------------ reductions
    def reduce(self) -> None:
        """After the last backward of a window (nothing inside `accumulating`): reduce the gradients over DP
        (ZeRO-3: FSDP2 already did, in backward), then sum over TP those that are per-rank parts. Under manual
        optimization (``manual``) only noted: the optimizer step, clipping or a norm reduce (`flush`), once, however
        many backward passes came before."""
        if self.blocked:
            return
        if self.manual:
            self._pending = True
            return
        self._reduce()

    def flush(self) -> None:
        """Manual optimization: the reduction the backward passes since the last step left (`reduce`), now."""
        if self._pending:
            self._pending = False
            self._reduce()

    def _reduce(self) -> None:
        deferred = self.parallelized.pipeline is not None or self.manual  # the backward passes ran without sync
        zero = self._zero()
        if deferred:
            for opt in zero:
                opt.gradients.adopt()
        if self.parallelized.tied:  # copies of one parameter on several stages: each gets the sum of their gradients
            sum_tied_grads(self.parallelized.tied, self.module, self.pp_group, self.device, self._gradient_of)
            for opt in zero if deferred else ():  # a copy that had none got one
                opt.gradients.adopt()
        for opt in zero:
            opt.gradients.wait()  # (started during the backward where it ran with sync)
            opt.gradients.sync = not self.manual
        self._sum_partial_grads_over_tp()
        self._divide_by_loss_items()
        if self.sum_loss and self.dp > 1:
            self._scale_grads(float(self.dp))  # the DP reduction averaged: the sum over the ranks

    def _gradient_of(self, param: torch.nn.Parameter) -> Optional[Tensor]:
        """``param``'s gradient before the DP reduction: in its bucket (ZeRO 0-2), else its ``.grad``."""
        for opt in self._zero():
            grad = opt.gradients.gradient_of(param)
            if grad is not None:
                return grad
        return param.grad

    def add_loss_items(self, items: Tensor) -> None:
        """A batch of the window whose backward was that of its loss *sum* over ``items`` items (this rank's):
        `reduce` divides the gradients by the items of the whole window over DP."""
        items = items.detach().to(self.device, torch.float64)
        self._items = items if self._items is None else self._items + items

    def _divide_by_loss_items(self) -> None:
        """The DP-averaged gradient of the window's loss sums, times ``dp``, over the window's items on every DP
        rank: the gradient of the global batch's token mean. Every gradient an optimizer steps with, once."""
        if self._items is None:
            return
        total = self._items.clone()
        self._items = None
        if self.dp > 1:
            torch.distributed.all_reduce(total, group=self.dp_group)
        self._scale_grads(self.dp / max(float(total), 1.0))

    def _scale_grads(self, scale: float) -> None:
        """Every gradient an optimizer steps with (the ZeRO 1-2 slices, or the ``.grad``s), once, times ``scale``."""
        seen: set[int] = set()
        grads: list[Tensor] = []
        for opt in self.optimizers:
            if isinstance(opt, ZeroOptimizer) and opt.shards_state:
                candidates = [g for g, _ in opt.grad_shards()]
            else:
                candidates = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            for g in candidates:
                local = local_tensor(g)
                if id(local) not in seen:
                    seen.add(id(local))
                    grads.append(local)
        if grads:
            torch._foreach_mul_(grads, scale)

    def _sum_partial_grads_over_tp(self) -> None:
        """One all-reduce over TP of every gradient that is a per-rank part, once per optimizer step, after the DP
        reduction (both are sums: their order does not matter), where the optimizer reads it: the ``.grad``
        (FSDP2's local shard under ZeRO-3), or under ZeRO 1-2 the parts of the bucket slices that hold it (the TP
        peers of a DP rank lay out their buckets alike). A hook per parameter would stop the backward at each."""
        names = self.parallelized.partial_grads
        if not names:
            return
        params = [self.module.get_parameter(n) for n in names]
        ids = {id(p) for p in params}
        sharding = [opt for opt in self._zero() if opt.shards_state]
        grads: list[Tensor] = [g for opt in sharding for p, g in opt.grad_pieces() if id(p) in ids]
        sliced = {id(p) for opt in sharding for p in opt.sliced_params()}
        for param in params:
            if id(param) not in sliced and param.grad is not None:
                grads.append(local_tensor(param.grad))
        sum_grads_over_tp_(grads, self.tp_group)

    # ------------------------------------------------------------------ norms
    def _uncounted(self) -> set[int]:
        """The copies of a tied parameter this rank holds that norms leave to another stage's copy."""
        pp_rank = torch.distributed.get_rank(self.pp_group)
        return {id(self.module.get_parameter(t.local)) for t in self.parallelized.tied
                if t.local is not None and not t.counted_here(pp_rank)}

    def grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The global L2 norm of the gradients of ``optimizer``'s parameters (equal to one device's)."""
        uncounted = self._uncounted()
        if isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state and uncounted:
            names = {id(p): n for n, p in self.module.named_parameters()}
            grads = [(g, names[id(p)] in self.parallelized.tp_sharded, True) for p, g in optimizer.grad_pieces()
                     if id(p) not in uncounted]
        elif isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state:
            grads = [(g, tp_shard, True) for g, tp_shard in optimizer.grad_shards()]
        else:
            wanted = {id(p) for group in optimizer.param_groups for p in group["params"]} - uncounted
            dp_shard = bool(self.parallelized.fsdp_roots)
            grads = [
                (p.grad, name in self.parallelized.tp_sharded, dp_shard, name in self.parallelized.expert_params)
                for name, p in self.module.named_parameters()
                if id(p) in wanted and p.grad is not None
            ]
        group = self.shard_group if not isinstance(optimizer, ZeroOptimizer) else self.dp_group
        return global_grad_norm(grads, self.tp_group, group, self.pp_group, device=self.device,
                                ep_group=self.ep_group)

    def clip(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip ``optimizer``'s gradients by their global norm; returns the norm (before clipping)."""
        norm = self.grad_norm(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        clip_grads_(grads, max_norm, norm)
        return norm

    def parameter_grad_norms(self) -> dict[str, Tensor]:
        """The L2 norm of each parameter's whole gradient (unsplit, reduced over DP), by name, for the parameters
        this rank holds: what ``p.grad.norm()`` gives on one device (0 for a parameter without a gradient).
        Collective over TP and DP; called where the gradients are complete (``on_before_optimizer_step``)."""
        named = list(self.module.named_parameters())
        names = {id(p): n for n, p in named}
        pieces: dict[str, list[Tensor]] = {n: [] for n, _ in named}
        sliced: set[str] = set()
        for opt in self._zero():
            if opt.shards_state:
                sliced |= {names[id(p)] for p in opt.sliced_params()}
                for p, g in opt.grad_pieces():
                    pieces[names[id(p)]].append(g)
        for name, p in named:
            if name not in sliced and p.grad is not None:
                pieces[name].append(p.grad)
        dp_sharded = sliced | {n for n, p in named if hasattr(p, "_local_tensor")}
        norms = parameter_grad_norms(
            pieces, self.parallelized.tp_sharded, dp_sharded, self.tp_group,
            self.dp_group if sliced else self.shard_group, self.device,
            self.parallelized.expert_params, self.ep_group,
        )
        # A tied parameter's copies on several stages: one device names it once, by its first name.
        uncounted = self._uncounted()
        for tie in self.parallelized.tied:
            if tie.local is not None and tie.local in norms:
                norm = norms.pop(tie.local)
                if id(self.module.get_parameter(tie.local)) not in uncounted:
                    norms[tie.name] = norm
        return norms


def resolve_grad_reduce(grad_reduce: str, parallelized: Parallelized, device: torch.device) -> bool:
    """Whether ZeRO-3 reduce-scatters every batch of an accumulation window (``grad_reduce``: ``"micro_batch"``;
    ``"window"``: once, after the last; ``"auto"``: every batch when this rank's unsharded gradients would take more
    than `AUTO_WINDOW_FRACTION` of its device's memory). Without FSDP2 roots (no ZeRO-3 over more than one rank):
    ``False``. ``"auto"`` is agreed over the world (the fullest rank decides), so that every rank reduces alike."""
    if not parallelized.fsdp_roots:
        return False
    if grad_reduce != "auto":
        return grad_reduce == "micro_batch"
    unsharded = sum(p.numel() * p.element_size() for p in parallelized.module.parameters() if p.requires_grad)
    every_batch = torch.tensor(int(unsharded > AUTO_WINDOW_FRACTION * device_memory_bytes(device)), device=device)
    torch.distributed.all_reduce(every_batch, op=torch.distributed.ReduceOp.MAX)
    return bool(every_batch.item())


@contextmanager
def _eager(buckets: list) -> Iterator[None]:
    """Every optimizer's gradient buckets `eager` at once (`GradientBuckets.eager`)."""
    with ExitStack() as stack:
        for each in buckets:
            stack.enter_context(each.eager())
        yield


def _take_grads(params: list[torch.nn.Parameter]) -> list[Optional[Tensor]]:
    """The parameters' gradients; the parameters are left without any."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def _add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    return b if a is None else a if b is None else a + b
