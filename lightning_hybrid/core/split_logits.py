"""Logits that stay split over the vocabulary, and the vocab-parallel cross entropy computed from them.

A column-split LM head gives each TP rank ``[..., V/tp]`` of the logits. Gathering them costs ``[B, T, V]``
per rank (4 GB in fp32 for one 8k-token sequence of a 128k vocabulary), so the head returns a `SplitLogits`
instead: a tensor holding this rank's shard that behaves as the whole ``[..., V]`` tensor for any code.

* ``F.cross_entropy`` on it (2-D ``[N, V]`` input, class indices, no class weights or label smoothing) is
  computed from the shards (Megatron's vocab-parallel cross entropy: max, sum of exponentials and the target's
  logit reduced over TP), never gathering the logits; ``argmax(-1)`` likewise.
* Reshapes and indexing that leave the vocabulary dimension whole (``flatten(0, 1)``, ``view(-1, V)``,
  ``logits[:, :-1]``), dtype casts, ``detach``/``contiguous``/``clone`` and scaling by a number keep it split.
* ``shape``/``size()``/``numel()`` give the whole tensor's sizes.
* Anything else gathers the whole tensor first (autograd-aware) and runs on that: never a silently wrong
  result, only the memory of the gathered logits where user code really needs them.

Every op that communicates is collective over the TP group: as everything else under TP, the ranks of a TP
group must run the same code on it (printing it on one rank alone would wait for the others).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_map

from lightning_hybrid.core.collectives import ShardSpec, all_gather, all_reduce, gather_from_tp

__all__ = ["SplitLogits", "vocab_parallel_cross_entropy"]

_SIZE_QUERIES = {torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement}
# Autograd bookkeeping on the tensor itself (FSDP2 hooks the outputs of a module's forward).
_ON_SELF = {torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.register_post_accumulate_grad_hook}
# Ops that act on each row of the vocabulary dimension as a whole (or on its elements one by one) with no
# other tensor involved: they commute with the split.
_ELEMENTWISE = {
    torch.Tensor.detach, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.float, torch.Tensor.double,
    torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.to, torch.Tensor.requires_grad_,
}
_SCALAR_ARITHMETIC = {
    torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.mul, torch.div,
}
_RESHAPES = {
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.unflatten, torch.Tensor.unsqueeze,
    torch.Tensor.squeeze, torch.flatten, torch.reshape, torch.unsqueeze, torch.squeeze, torch.Tensor.__getitem__,
}


class SplitLogits(Tensor):
    """This TP rank's ``[..., V/tp]`` shard of logits ``[..., V]`` (split along the last dimension as ``spec``
    says, over ``group``), acting as the whole tensor: see the module docstring for what stays split."""

    _tp_group: dist.ProcessGroup
    _tp_spec: ShardSpec

    @staticmethod
    def wrap(local: Tensor, group: dist.ProcessGroup, spec: ShardSpec) -> "SplitLogits":
        """``local``: this rank's shard (gradients flow back to it)."""
        with DisableTorchFunctionSubclass():
            out = local.as_subclass(SplitLogits)
        out._tp_group, out._tp_spec = group, spec
        return out

    def local(self) -> Tensor:
        """This rank's shard as a plain tensor (the same autograd graph)."""
        with DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor)

    def full(self) -> Tensor:
        """The whole logits, all-gathered over the TP group (its backward keeps this rank's piece)."""
        return gather_from_tp(self.local(), self._tp_group, self._tp_spec)

    def _full_shape(self) -> torch.Size:
        with DisableTorchFunctionSubclass():
            shape = list(self.shape)
        return torch.Size(shape[:-1] + [sum(self._tp_spec.part_sizes)])

    def _like(self, local: Tensor) -> "SplitLogits":
        return SplitLogits.wrap(local, self._tp_group, self._tp_spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], SplitLogits) else None
        if self is not None:
            if func in _SIZE_QUERIES:
                with DisableTorchFunctionSubclass():
                    return func(torch.empty(self._full_shape(), device="meta"), *args[1:], **kwargs)
            if func in _ON_SELF:
                with DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            kept = self._keep_split(func, args[1:], kwargs)
            if kept is not None:
                return kept
        if func is torch.cat:
            joined = _cat(*args, **kwargs)
            if joined is not None:
                return joined
        if func is F.cross_entropy and isinstance(args[0] if args else kwargs.get("input"), SplitLogits):
            loss = _cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss
        if self is not None and getattr(func, "__name__", "") == "__get__":
            with DisableTorchFunctionSubclass():  # dtype, device, grad_fn ...: the shard's
                value = func(*args, **kwargs)
            if not isinstance(value, Tensor):
                return value
        gathered_args, gathered_kwargs = tree_map(
            lambda t: t.full() if isinstance(t, SplitLogits) else t, (args, kwargs)
        )
        return func(*gathered_args, **gathered_kwargs)

    def _keep_split(self, func, rest: tuple, kwargs: dict) -> Tensor | None:
        """The result of ``func(self, *rest)`` computed on the shard when the op commutes with the split, else
        ``None``."""
        local = self.local()
        if func in _ELEMENTWISE:
            out = func(local, *rest, **kwargs)
            return self._like(out) if isinstance(out, Tensor) and out.shape == local.shape else None
        if func in _SCALAR_ARITHMETIC and len(rest) == 1 and isinstance(rest[0], (int, float)) and not kwargs:
            return self._like(func(local, rest[0]))
        if func in (torch.Tensor.argmax, torch.argmax):
            dim = rest[0] if rest else kwargs.get("dim")
            if dim is not None and dim in (-1, local.dim() - 1) and not kwargs.get("keepdim", False) and len(rest) <= 1:
                return _argmax(self)
            return None
        if func in _RESHAPES:
            full_shape = self._full_shape()
            if func is torch.Tensor.__getitem__ and not _leaves_last_dim(rest[0], len(full_shape)):
                return None
            with DisableTorchFunctionSubclass():
                out_shape = func(torch.empty(full_shape, device="meta"), *rest, **kwargs).shape
            if len(out_shape) == 0 or out_shape[-1] != full_shape[-1] or out_shape.numel() == 0:
                return None
            if func is torch.Tensor.__getitem__:
                return self._like(local[rest[0]])
            return self._like(local.reshape(*out_shape[:-1], local.size(-1)))
        return None


def _cat(tensors, dim: int = 0) -> SplitLogits | None:
    """``torch.cat`` of logits split alike, along another dimension than the vocabulary: split too."""
    first = tensors[0] if tensors else None
    if not all(
        isinstance(t, SplitLogits) and t._tp_spec == first._tp_spec and t._tp_group is first._tp_group for t in tensors
    ):
        return None
    locals_ = [t.local() for t in tensors]
    if dim % locals_[0].dim() == locals_[0].dim() - 1:
        return None
    return first._like(torch.cat(locals_, dim))


def _leaves_last_dim(index, ndim: int) -> bool:
    """Whether indexing with ``index`` takes the last dimension whole (does not address it, or with ``:``)."""
    items = index if isinstance(index, tuple) else (index,)
    if any(item is Ellipsis for item in items):
        after = items[[i for i, item in enumerate(items) if item is Ellipsis][0] + 1:]
        after = [item for item in after if item is not None]
        return not after or (after[-1] == slice(None) and len(after) >= 1)
    addressed = [item for item in items if item is not None]
    consumed = sum(item.dim() if isinstance(item, Tensor) and item.dtype == torch.bool else 1 for item in addressed)
    if consumed < ndim:
        return True
    return consumed == ndim and addressed[-1] == slice(None)


def _vocab_starts(spec: ShardSpec, group: dist.ProcessGroup) -> list[tuple[int, int, int]]:
    return spec.chunks(dist.get_rank(group), dist.get_world_size(group))


def _to_local_index(target: Tensor, chunks: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
    """``(local index, whether this rank holds it)`` of global class indices ``target``."""
    local = torch.zeros_like(target)
    held = torch.zeros_like(target, dtype=torch.bool)
    for local_offset, full_offset, length in chunks:
        inside = (target >= full_offset) & (target < full_offset + length)
        local = torch.where(inside, target - full_offset + local_offset, local)
        held |= inside
    return local, held


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-row cross entropy of logits split over the vocabulary (max, sum-exp and the target's logit
    all-reduced over the TP group). Backward: ``softmax - onehot`` on this rank's shard, no communication."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: dist.ProcessGroup, spec: ShardSpec, ignore_index: int):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        row_max = all_reduce(x.max(dim=-1).values, group, "max")
        x = x - row_max.unsqueeze(-1)
        valid = target != ignore_index
        index, held = _to_local_index(torch.where(valid, target, torch.zeros_like(target)), _vocab_starts(spec, group))
        held &= valid
        picked = x.gather(-1, index.unsqueeze(-1)).squeeze(-1) * held
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        both = all_reduce(torch.stack([picked, sum_exp]), group)
        picked, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - picked) * valid
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, held, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, index, held, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -held.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: SplitLogits, target: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """``F.cross_entropy(logits, target)`` for ``[N, V]`` logits split over the vocabulary (``[V]`` with a
    scalar target for one sample), from the shards. Collective over the logits' TP group."""
    local = logits.local()
    squeeze = local.dim() == 1
    if squeeze:
        local, target = local.unsqueeze(0), target.unsqueeze(0)
    rows = _VocabParallelCrossEntropy.apply(local, target, logits._tp_group, logits._tp_spec, ignore_index)
    if reduction == "none":
        return (rows[0] if squeeze else rows).to(local.dtype)
    if reduction == "sum":
        return rows.sum().to(local.dtype)
    return (rows.sum() / (target != ignore_index).sum()).to(local.dtype)


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """The vocab-parallel cross entropy where ``F.cross_entropy``'s arguments allow it, else ``None`` (the
    caller gathers the logits and runs the stock function)."""
    if size_average is not None or reduce is not None:
        return None
    if weight is not None or label_smoothing or reduction not in ("mean", "sum", "none"):
        return None
    if input.dim() not in (1, 2) or target.is_floating_point() or target.dim() != input.dim() - 1:
        return None
    return vocab_parallel_cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction)


def _argmax(logits: SplitLogits) -> Tensor:
    """``argmax(-1)`` from the shards: each rank's best, all-gathered; ties go to the lowest global index, as
    one device's ``argmax`` does."""
    group = logits._tp_group
    local = logits.local().detach()
    values, index = local.max(dim=-1)
    chunks = _vocab_starts(logits._tp_spec, group)
    global_index = torch.zeros_like(index)
    for local_offset, full_offset, length in chunks:
        inside = (index >= local_offset) & (index < local_offset + length)
        global_index = torch.where(inside, index - local_offset + full_offset, global_index)
    # Every rank's best, along a new last dimension.
    values, index = (all_gather(t.unsqueeze(0).contiguous(), group).movedim(0, -1) for t in (values, global_index))
    best = values.max(dim=-1, keepdim=True).values
    candidates = torch.where(values == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    return candidates.min(dim=-1).values
