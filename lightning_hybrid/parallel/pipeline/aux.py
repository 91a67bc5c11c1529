"""An auxiliary loss of the whole batch under pipeline parallelism, exactly as one device computes it.

Some losses are not sums over micro-batches: the load-balancing loss of a mixture-of-experts model is a product
of means over every layer and token of the batch. Under a pipeline the layers live on different ranks and the
micro-batches reach them at different times, so no stage can compute such a loss alone. `AuxLossExchange` does it
under GPipe, where every stage runs all its forwards before its first backward:

1. during the forwards, hooks record the outputs of the module's *source* modules (the routers) inside this
   rank's layers, one tensor per source and micro-batch (`PipelineAuxLoss.pipeline_aux_sources`);
2. between the forward and the backward phase (the stage's first backward, before it waits for a gradient), the
   records are gathered over the data-parallel ranks (the rows of the global batch, in rank order) and the
   pipeline ranks (the other layers' sources), and every rank evaluates the module's own loss of the whole batch
   on them (`PipelineAuxLoss.pipeline_aux_loss`) and its gradient with respect to each of this rank's records;
3. each layer's output carries its records (an identity in forward), so the backward of each micro-batch adds
   their gradients: the router's parameters and everything before get exactly the one-device gradient.

The gradient is scaled as the strategy weights the loss: by the batch's loss items over DP where the loss is
token-weighted (the backward is that of the loss sum, divided by the window's items afterwards), else by the
accumulation factor times ``dp`` (the reduction averages over DP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["AuxLossExchange", "Source"]


@dataclass(frozen=True)
class Source:
    """A module whose output the auxiliary loss reads: pipeline layer ``layer``'s ``position``-th source,
    ``index`` the element of its output tuple (``None``: the output itself)."""

    layer: int
    position: int
    module: nn.Module
    index: Optional[int]

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.position)


@dataclass
class _Slot:
    """The gradient a record gets in backward, set by the exchange."""

    grad: Optional[Tensor] = None


@dataclass
class _Records:
    tensors: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)  # key -> one per micro-batch
    slots: dict[tuple[int, int], list[_Slot]] = field(default_factory=dict)
    pending: list[tuple[Tensor, _Slot]] = field(default_factory=list)  # of the layer running now


class _Attach(torch.autograd.Function):
    """``output`` unchanged; its backward also gives each record the gradient its slot holds by then."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, slots: list[_Slot], *records: Tensor) -> Tensor:
        ctx.slots = slots
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        return (grad, None, *(slot.grad for slot in ctx.slots))


class AuxLossExchange:
    """Records, gathers and differentiates the auxiliary loss of one pipelined module (see the module doc).

    Args:
        sources: this rank's sources (inside its layers), each with its pipeline layer index.
        layers: this rank's pipeline layers by index (their outputs carry the records).
        fn: the loss of the whole batch from every source's output over the global batch, in the order of
            ``(layer, position)`` (the module's `pipeline_aux_loss`).
        dp_group, pp_group: the ranks holding other rows of the batch, and other layers.
    """

    def __init__(
        self, sources: Sequence[Source], layers: dict[int, nn.Module], fn: Callable[[list[Tensor]], Tensor],
        dp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup, device: torch.device,
    ) -> None:
        self.sources, self.fn, self.device = list(sources), fn, device
        self.dp_group, self.pp_group = dp_group, pp_group
        self.recording = False
        self.value: Optional[Tensor] = None  # the last step's loss (detached)
        self._records = _Records()
        self._scale: Callable[[], float] = lambda: 1.0
        self._handles = [s.module.register_forward_hook(self._record_hook(s)) for s in self.sources]
        self._handles += [layer.register_forward_hook(self._attach_hook) for layer in layers.values()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ one step
    def begin(self, scale: Callable[[], float]) -> None:
        """A training step starts (the stage sets ``recording`` around each micro-batch's forward). ``scale()``
        (called at the exchange, where it may run a
        collective) is the factor of the loss's gradient (see the module doc)."""
        self._records, self._scale, self.value = _Records(), scale, None

    def end(self) -> Optional[Tensor]:
        """The step's loss (the same on every rank; ``None`` if the schedule ran no backward); the records are
        dropped."""
        self.recording = False
        self._records = _Records()
        return self.value

    def _record_hook(self, source: Source) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.recording or not torch.is_grad_enabled():
                return  # evaluation, shape inference, or the recomputation of activation checkpointing in backward
            tuple_like = isinstance(output, (tuple, list))
            t = output[source.index] if source.index is not None and tuple_like else output
            if not isinstance(t, Tensor):
                raise TypeError(f"the auxiliary-loss source {type(module).__name__} of pipeline layer {source.layer}"
                                f" output {type(t).__name__}, not a tensor, at index {source.index}")
            if t.is_meta:
                return  # the schedule's shape inference on meta tensors, before the first step
            slot = _Slot()
            self._records.tensors.setdefault(source.key, []).append(t)
            self._records.slots.setdefault(source.key, []).append(slot)
            if t.requires_grad:
                self._records.pending.append((t, slot))

        return hook

    def _attach_hook(self, layer: nn.Module, args: Any, output: Any) -> Any:
        pending, self._records.pending = self._records.pending, []
        if not pending or not isinstance(output, Tensor):
            if pending:
                raise TypeError(f"pipeline layer {type(layer).__name__} output {type(output).__name__}, not a tensor:"
                                " its auxiliary-loss records cannot travel with it")
            return None
        return _Attach.apply(output, [slot for _, slot in pending], *(t for t, _ in pending))

    # ------------------------------------------------------------------ the exchange
    def exchange(self) -> None:
        """Between the forwards and the backwards (collective over DP and PP): gather every rank's records,
        evaluate the loss of the whole batch, and set the gradient of each of this rank's records."""
        self.recording = False
        records = self._records
        keys = sorted(records.tensors)
        local = [torch.cat([t.detach() for t in records.tensors[k]]) for k in keys]
        over_dp, offsets = _gather_rows(local, self.dp_group, self.device)  # per key: the global batch's rows
        everything = _gather_keys(dict(zip(keys, over_dp)), self.pp_group, self.device)
        leaves = {k: v.detach().requires_grad_(k in records.tensors) for k, v in sorted(everything.items())}
        with torch.enable_grad():
            loss = self.fn(list(leaves.values()))
            mine = [leaves[k] for k in keys]
            grads = torch.autograd.grad(loss, mine, allow_unused=True) if mine and loss.requires_grad else []
        self.value = loss.detach().float()
        scale = self._scale()
        for k, offset, grad in zip(keys, offsets, grads):
            if grad is None:
                continue
            start = offset
            for t, slot in zip(records.tensors[k], records.slots[k]):
                slot.grad = (grad[start : start + t.size(0)] * scale).to(t.dtype)
                start += t.size(0)


def _gather_rows(
    tensors: list[Tensor], group: dist.ProcessGroup, device: torch.device,
) -> tuple[list[Tensor], list[int]]:
    """Each tensor's rows of every rank of ``group`` (same tensors, in number and trailing shape, on every rank;
    rows may differ), concatenated in rank order; and this rank's first row in each."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1 or not tensors:
        return tensors, [0] * len(tensors)
    rows = torch.tensor([t.size(0) for t in tensors], dtype=torch.long, device=device)
    all_rows = [torch.empty_like(rows) for _ in range(size)]
    dist.all_gather(all_rows, rows, group=group)
    counts = torch.stack(all_rows).tolist()  # rank -> key -> rows
    widths = [math.prod(t.shape[1:]) for t in tensors]
    numels = [sum(r * w for r, w in zip(per_rank, widths)) for per_rank in counts]
    wire = _wire_dtype(str(t.dtype) for t in tensors)  # the same tensors, so the same dtype, on every rank
    flat = torch.cat([t.reshape(-1).to(wire) for t in tensors])
    padded = flat.new_zeros(max(numels))
    padded[: flat.numel()] = flat
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    out: list[list[Tensor]] = [[] for _ in tensors]
    for r, piece in enumerate(pieces):
        start = 0
        for i, t in enumerate(tensors):
            n = counts[r][i] * widths[i]
            out[i].append(piece[start : start + n].view(counts[r][i], *t.shape[1:]).to(t.dtype))
            start += n
    offsets = [sum(counts[r][i] for r in range(rank)) for i in range(len(tensors))]
    return [torch.cat(parts) for parts in out], offsets


def _gather_keys(
    tensors: dict[tuple[int, int], Tensor], group: dist.ProcessGroup, device: torch.device,
) -> dict[tuple[int, int], Tensor]:
    """Every rank's keyed tensors (different keys on each rank), on every rank of ``group``."""
    if dist.get_world_size(group) == 1:
        return dict(tensors)
    meta = [(k, tuple(t.shape), str(t.dtype)) for k, t in tensors.items()]
    metas: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
    numels = [sum(math.prod(shape) for _, shape, _ in m) for m in metas]
    wire = _wire_dtype(dtype for m in metas for _, _, dtype in m)
    flat = torch.cat([t.reshape(-1).to(wire) for t in tensors.values()]) if tensors else torch.zeros(0, device=device)
    padded = torch.zeros(max(max(numels), 1), dtype=wire, device=device)
    padded[: flat.numel()] = flat
    pieces = [torch.empty_like(padded) for _ in metas]
    dist.all_gather(pieces, padded, group=group)
    out: dict[tuple[int, int], Tensor] = {}
    for piece, m in zip(pieces, metas):
        start = 0
        for k, shape, dtype in m:
            n = math.prod(shape)
            out[tuple(k)] = piece[start : start + n].view(shape).to(getattr(torch, dtype.removeprefix("torch.")))
            start += n
    return out


def _wire_dtype(dtypes) -> torch.dtype:
    """The records travel as float32 (exact for float32, bfloat16 and float16), as float64 if any is."""
    return torch.float64 if "torch.float64" in set(dtypes) else torch.float32
