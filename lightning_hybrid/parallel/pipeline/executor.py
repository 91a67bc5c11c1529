"""The pipeline executor: this rank's `PipelineStage`s, a `torch.distributed.pipelining` schedule, and the
forward-only path used by validation, test and predict.

Training (`train_step`) runs the whole schedule (forward and backward of every micro-batch) and returns
the mean micro-batch loss on every pipeline rank. Evaluation (`eval_forward`) sends the batch through the
stages micro-batch by micro-batch (stage ``s`` works on one while stage ``s+1`` works on the one before) and
gives every pipeline rank a `PipelineOutput`: the output stays on the last stage, and only what the user's
validation code computes from it (a loss, argmax indices) is broadcast, so that code (loss, torchmetrics)
runs unchanged on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from lightning_hybrid.parallel.pipeline.aux import AuxLossExchange
from lightning_hybrid.parallel.pipeline.output import PipelineOutput
from lightning_hybrid.runtime.rank_zero import BatchError, raise_from_rank_zero


@dataclass(frozen=True)
class ScheduleSpec:
    cls: type
    stages_per_rank: int  # 0: given by virtual_stages (>= 2)
    style: str  # stage -> rank mapping: "loop" or "v"


SCHEDULES = {
    "gpipe": ScheduleSpec(ScheduleGPipe, 1, "loop"),
    "1f1b": ScheduleSpec(Schedule1F1B, 1, "loop"),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, 0, "loop"),
    "zero_bubble": ScheduleSpec(ScheduleZBVZeroBubble, 2, "v"),
}


def resolve_schedule(
    schedule: str, pp: int, micro_batches: int | None, virtual_stages: int,
) -> tuple[ScheduleSpec, int, int]:
    """Validate a schedule choice; returns ``(spec, stages per rank, micro-batches)``. Raises ``ValueError``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown: valid schedules are {sorted(SCHEDULES)}.")
    spec = SCHEDULES[schedule]
    if spec.stages_per_rank == 0:
        if virtual_stages < 2:
            raise ValueError(f"schedule='{schedule}' needs virtual_stages >= 2 (stages per rank),"
                             f" got {virtual_stages}.")
        per_rank = virtual_stages
    else:
        if virtual_stages not in (1, spec.stages_per_rank):
            raise ValueError(
                f"schedule='{schedule}' runs {spec.stages_per_rank} stage(s) per rank; virtual_stages={virtual_stages}"
                f" is not supported (leave it at 1{' or 2' if spec.stages_per_rank == 2 else ''})."
            )
        per_rank = spec.stages_per_rank
    micro_batches = micro_batches if micro_batches is not None else 2 * pp
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} is invalid: it must be a positive integer.")
    if schedule == "1f1b" and micro_batches < pp:
        raise ValueError(f"schedule='1f1b' needs micro_batches >= pp ({pp}), got {micro_batches}.")
    if schedule == "interleaved_1f1b" and micro_batches % pp != 0:
        raise ValueError(f"schedule='interleaved_1f1b' needs micro_batches to be a multiple of pp ({pp}),"
                         f" got {micro_batches}.")
    return spec, per_rank, micro_batches


class _Stage(PipelineStage):
    """A `PipelineStage` whose FSDP2 (ZeRO-3) gradient reduction can wait for the end of an accumulation window,
    and whose last backward of a window can start the gradient buckets' reductions (`on_last_backward`).

    torch's stage reduce-scatters an FSDP2 stage's gradients at the end of every schedule step. With
    ``reduce_grads = False`` (a batch that is not the last of an accumulation window) the end of the step
    runs FSDP2's post-backward without gradient sync instead: the gathered parameters are freed and the
    unsharded gradients kept, to be added to by the next batch and reduce-scattered once, after the last.
    """

    reduce_grads = True
    #: The module's auxiliary loss of the whole batch (GPipe): it records during the micro-batches' forwards (not
    #: the schedule's shape inference) and is exchanged before the first backward, once every forward has run.
    aux: Optional[AuxLossExchange] = None

    #: Whether a micro-batch's forward has run (the schedule's metadata inference runs the loss on empty tensors).
    forwarded = False

    #: Entered around this stage's last backward of a batch that ends an accumulation window: there the gradient
    #: buckets reduce as the backward completes them (`PipelineExecutor.on_last_backward`).
    on_last_backward: Optional[Callable[[], ContextManager[None]]] = None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if last_backward and self.reduce_grads and self.on_last_backward is not None:
            with self.on_last_backward():
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def forward_one_chunk(self, *args, **kwargs):
        self.forwarded = True
        if self.aux is None:
            return super().forward_one_chunk(*args, **kwargs)
        self.aux.recording = True
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.aux.recording = False

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if bwd_chunk_id == 0 and self.aux is not None:
            self.aux.exchange()
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def perform_reduce_grad(self, grad_scale_factor: int):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.reduce_grads or not isinstance(self.submod, FSDPModule):
            return super().perform_reduce_grad(grad_scale_factor)
        module = self.submod
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(False)
        state = fully_shard.state(module)
        for each in state._state_ctx.all_states:
            for param_group in each._fsdp_param_groups:
                param_group.post_backward()
        state._root_post_backward_final_callback()
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


class _StageSequence(nn.Sequential):
    """The layers of one stage (shared with the LightningModule, which keeps owning them); keyword inputs (the
    micro-batch's side inputs) reach every layer; ``context(layer, hidden, side)``: entered around each layer's
    call, or None."""

    context: Optional[Callable[[nn.Module, Tensor, dict], ContextManager[None]]] = None

    def forward(self, x, **side):
        for layer in self:
            with self.context(layer, x, side) if self.context is not None else contextlib.nullcontext():
                x = layer(x, **side)
        return x


class PipelineExecutor:
    """Runs this rank's stages over the PP ``group``.

    Args:
        stage_modules: stage index -> module of that stage (this rank's stages only).
        num_stages: stages in the whole pipeline; ``owners[s]`` is the PP rank that runs stage ``s``.
        loss_fn: ``(output, target) -> mean loss of one micro-batch`` (called on the last stage).
        loss_items: ``target -> the number of items loss_fn averages over`` (the module's ``loss_items``), or
            ``None``. With it each micro-batch's loss is weighted by its items: the schedule's backward gives the
            gradient of the loss *sum* (`GradientSync` divides by the global batch's items at the end of the
            accumulation window) and `train_step` returns the token mean of the batch. Without it, the mean of the
            micro-batch means, scaled by ``loss_scale``.
        aux: the module's auxiliary loss of the whole batch (`AuxLossExchange`; GPipe only), added to the loss
            `train_step` returns and, through its records, to the gradients; ``dp_group``: the data-parallel ranks
            (the loss items of the global batch scale its gradient).

    Keyword tensors of `train_step` and `eval_forward` (side inputs such as ``position_ids``, with the batch's
    first dimension) are split into micro-batches with the inputs and reach every stage: each stage module calls
    each of its layers as ``layer(hidden, **side)``.
    """

    def __init__(
        self,
        stage_modules: dict[int, nn.Module],
        num_stages: int,
        owners: list[int],
        spec: ScheduleSpec,
        micro_batches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        group: dist.ProcessGroup,
        device: torch.device,
        loss_items: Optional[Callable[[Tensor], Tensor]] = None,
        aux: Optional[AuxLossExchange] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.group, self.device, self.owners, self.num_stages = group, device, owners, num_stages
        self.micro_batches = micro_batches
        self.rank = dist.get_rank(group)
        self.stage_modules = dict(sorted(stage_modules.items()))
        self.user_loss_fn = loss_fn
        self.loss_items = loss_items
        self.last_items: Optional[Tensor] = None  # the items of the last train_step's batch (loss_items given)
        self.loss_scale = 1.0  # 1 / accumulate_grad_batches: the schedule runs the backward itself
        self.loss_sum = False  # the module's loss is a sum over items (loss_reduction="sum"): summed, not averaged
        # Called once, on the first micro-batch's loss: what is wrong with the module's loss, or None
        # (`lightning_hybrid.checks.loss_semantics.check_decomposition`); raised on every rank after the schedule.
        self.verify_loss: Optional[Callable[[Callable, Tensor, Tensor], Optional[str]]] = None
        self._loss_error: Optional[str] = None
        self.reduce_grads = True  # whether this batch ends an accumulation window (ZeRO-3 reduces then)
        # Entered around each stage's last backward of such a batch (`_Stage.on_last_backward`): None, or what
        # makes the gradient buckets reduce during it (`lightning_hybrid.grad_sync.GradientSync.pipeline_step`).
        self.on_last_backward: Optional[Callable[[], ContextManager[None]]] = None
        self.stages = [
            _Stage(module, index, num_stages, device, group=group) for index, module in self.stage_modules.items()
        ]
        self.aux, self.dp_group = aux, dp_group
        if aux is not None:
            if spec.cls is not ScheduleGPipe:
                raise ValueError("an auxiliary loss of the whole batch needs schedule='gpipe' (every forward before the"
                                 " first backward)")
            self.stages[0].aux = aux
        stages = self.stages[0] if spec.stages_per_rank == 1 else self.stages
        # The mean over micro-batches is taken in the loss (not by rescaling every gradient the stage finds after
        # the schedule): gradients then add up across the batches of an accumulation window in place.
        self.schedule = spec.cls(stages, n_microbatches=micro_batches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        if self.verify_loss is not None and any(stage.forwarded for stage in self.stages if stage.is_last):
            self._loss_error, self.verify_loss = self.verify_loss(self.user_loss_fn, output, target), None
        if self.loss_items is not None:  # the micro-batch's loss sum
            return self.user_loss_fn(output, target) * self.loss_items(target)
        if self.loss_sum:  # the gradients of the micro-batches' sums add up to the batch's (and the window's)
            return self.user_loss_fn(output, target)
        return self.user_loss_fn(output, target) * (self.loss_scale / self.micro_batches)

    def train_step(self, inputs: Tensor, targets: Tensor, **side: Tensor) -> Tensor:
        """Forward and backward of every micro-batch (``side``: keyword tensors for every stage, split with the
        inputs); the batch's loss (float32 scalar) on every PP rank: the token mean with ``loss_items``, else the
        mean of the micro-batch means."""
        for stage in self.stages:
            stage.reduce_grads, stage.on_last_backward = self.reduce_grads, self.on_last_backward
        if inputs.size(0) % self.micro_batches != 0:
            raise_from_rank_zero(BatchError(
                f"The batch of {inputs.size(0)} samples (per data-parallel rank) does not split into"
                f" micro_batches={self.micro_batches}: choose a batch size that is a multiple of micro_batches."
            ))
        _check_side_inputs(side, inputs.size(0))
        items = None if self.loss_items is None else self.loss_items(targets)
        checking = self.verify_loss is not None
        if self.aux is not None:
            self.aux.begin(lambda: self._aux_scale(items))
        losses: list[Tensor] = []  # filled on the last stage: one (scaled) loss per micro-batch
        try:
            self.schedule.step(inputs, target=targets, losses=losses, **side)
        finally:
            aux = self.aux.end() if self.aux is not None else None
        if self.aux is not None and aux is None:
            raise RuntimeError("the pipeline's auxiliary loss was not computed: the schedule ran no backward")
        self.last_items = items
        if losses:
            loss = torch.stack([micro_loss.detach() for micro_loss in losses]).float().sum()
            if items is not None:
                loss = loss / items.clamp_min(1)
            elif not self.loss_sum:
                loss = loss / self.loss_scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.owners[-1]), group=self.group)
        if checking:  # the last stages' verdict on the module's loss, raised on every rank of the world alike
            verdicts: list[Optional[str]] = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, self._loss_error)
            self._loss_error = next((m for m in verdicts if m is not None), None)
            if self._loss_error is not None:
                raise ValueError(self._loss_error)
        return loss if aux is None else loss + aux.to(loss.device)

    def _aux_scale(self, items: Optional[Tensor]) -> float:
        """The factor of the auxiliary loss's gradient: the global batch's loss items (the backward is that of the
        loss sum, divided by the window's items over DP afterwards), else ``loss_scale`` times ``dp`` (the DP
        reduction averages)."""
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        if items is None:
            return self.loss_scale * dp
        total = items.detach().to(self.device, torch.float64)
        if dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        return float(total)

    @torch.no_grad()
    def eval_forward(self, inputs: Tensor, **side: Tensor) -> PipelineOutput:
        """The batch through the stages in ``micro_batches`` parts (fewer when the batch is smaller; ``side``:
        keyword tensors for every stage, split alike); the output as a `PipelineOutput` on every PP rank (its data
        on the last stage only)."""
        _check_side_inputs(side, inputs.size(0))
        n = min(self.micro_batches, max(inputs.size(0), 1))
        parts = list(inputs.chunk(n))
        side_parts = [dict(zip(side, values)) for values in zip(*(t.chunk(n) for t in side.values()))] or None
        outputs = forward_through_stages(self.stage_modules, self.owners, parts, self.group, self.device, side_parts)
        out = torch.cat(outputs) if outputs is not None else None
        return PipelineOutput.create(out, dist.get_global_rank(self.group, self.owners[-1]), self.group, self.device)


def forward_through_stages(
    stage_modules: dict[int, nn.Module], owners: list[int], parts: list[Tensor], group: dist.ProcessGroup,
    device: torch.device, side_parts: Optional[list[Mapping[str, Tensor]]] = None,
) -> list[Tensor] | None:
    """Run the micro-batches ``parts`` through every stage in order (``stage_modules``: this rank's stages;
    ``owners[s]``: the PP rank of stage ``s``; ``side_parts[i]``: keyword tensors of micro-batch ``i`` for every
    stage), sending activations between PP ranks. Stage by stage, each does
    all micro-batches (sending each on as soon as it is done), so consecutive stages overlap and no rank waits
    on a send. Returns the last stage's outputs on its owner, ``None`` on the other ranks. Collective over the
    PP ``group``."""
    rank = dist.get_rank(group)
    parts = list(parts)
    pending: list = []
    for index, owner in enumerate(owners):
        if owner != rank:
            continue
        for i in range(len(parts)):
            if index > 0 and owners[index - 1] != rank:
                parts[i] = recv_tensor(owners[index - 1], group, device)
            parts[i] = stage_modules[index](parts[i], **(side_parts[i] if side_parts else {}))
            if index + 1 < len(owners) and owners[index + 1] != rank:
                pending += isend_tensor(parts[i].detach(), owners[index + 1], group, device)
    for work in pending:
        work.wait()
    return parts if owners[-1] == rank else None


# Tensors of unknown shape travel as a header (dtype, ndim, shape) followed by the data.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def _header(t: Tensor, device: torch.device) -> Tensor:
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (8 - t.dim()), dtype=torch.int64,
                        device=device)


def _from_header(header: Tensor, device: torch.device) -> Tensor:
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    return torch.empty([int(v) for v in header[2 : 2 + ndim]], dtype=dtype, device=device)


def isend_tensor(t: Tensor, dst: int, group: dist.ProcessGroup, device: torch.device) -> list:
    """Start sending ``t`` (any shape) to PP rank ``dst`` of ``group``; wait for the returned works."""
    global_dst = dist.get_global_rank(group, dst)
    return [dist.isend(_header(t, device), dst=global_dst, group=group),
            dist.isend(t.contiguous(), dst=global_dst, group=group)]


def recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    """Receive a tensor sent by `isend_tensor` from PP rank ``src`` of ``group``."""
    global_src = dist.get_global_rank(group, src)
    header = torch.empty(10, dtype=torch.int64, device=device)
    dist.recv(header, src=global_src, group=group)
    t = _from_header(header, device)
    dist.recv(t, src=global_src, group=group)
    return t


def stage_module(layers: list[nn.Module],
                 context: Optional[Callable[[nn.Module, Tensor, dict], ContextManager[None]]] = None) -> nn.Module:
    """One stage's ``layers`` as one module; ``context(layer, hidden, side)``: entered around each layer's call on a
    micro-batch (its input, the micro-batch's keyword tensors), or None."""
    stage = _StageSequence(*layers)
    stage.context = context
    return stage


def _check_side_inputs(side: Mapping[str, object], batch: int) -> None:
    for name, value in side.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.size(0) != batch:
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise TypeError(
                f"Under pp > 1, a keyword input of self(x, ...) is split into micro-batches with x, so it must be a"
                f" tensor whose first dimension is x's ({batch}); {name!r} has {got}."
            )
