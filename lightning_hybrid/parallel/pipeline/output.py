"""The output of a pipelined forward outside training: it stays on the last stage until something small is
asked of it.

Validation code written for one device (``loss = self.loss_fn(logits, y)``, ``acc.update(logits.argmax(-1),
y)``) runs on every pipeline rank, but only the last stage has the logits. Broadcasting them to every rank
(``[B, T, V]`` per batch) is what one device's code seems to need; what it really needs is a loss and a few
indices. So ``self(x)`` gives a `PipelineOutput` on every pipeline rank: a tensor that knows its shape, dtype and
device everywhere and holds the data on the last stage only. Every other op on it runs on the last stage and:

* a result at least a quarter the output's size (``flatten``, ``float()``, ``logits / t``) stays there, as
  another `PipelineOutput`;
* a smaller one (a loss, ``argmax``, ``item()``, a Python value) is broadcast to every pipeline rank.

So the output itself never travels between pipeline ranks unless code really needs all of it (then the ops
that need it run where it is, and only their results move). Every op on it is collective over the pipeline
group: the pipeline ranks run the same validation code in the same order, as Lightning's ranks do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_map

from lightning_hybrid.core.split_logits import SplitLogits

__all__ = ["PipelineOutput"]

#: A result this fraction of the output's bytes or more stays on the last stage.
KEEP_FRACTION = 0.25

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__, torch.Tensor.size,
    torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.is_floating_point,
    torch.Tensor.requires_grad.__get__, torch.Tensor.__len__,
}


class PipelineOutput(Tensor):
    """A tensor of the last pipeline stage, seen from every rank of the pipeline group (see the module doc).

    It is a meta tensor of the output's shape and dtype; ``_value`` is the output on the last stage and
    ``None`` elsewhere."""

    _value: Tensor | None
    _device: torch.device
    _group: dist.ProcessGroup
    _src: int  # the last stage's global rank

    @staticmethod
    def create(value: Tensor | None, src: int, group: dist.ProcessGroup, device: torch.device) -> "PipelineOutput":
        """Collective over ``group``: ``value`` on the rank ``src`` (global), ``None`` on the others."""
        meta = [(tuple(value.shape), value.dtype) if value is not None else None]
        dist.broadcast_object_list(meta, src=src, group=group, device=_object_device(device))
        return PipelineOutput._of(value, meta[0], src, group, device)

    @staticmethod
    def _of(
        value: Tensor | None, meta: tuple, src: int, group: dist.ProcessGroup, device: torch.device,
    ) -> "PipelineOutput":
        shape, dtype = meta
        with DisableTorchFunctionSubclass():
            out = torch.empty(shape, dtype=dtype, device="meta").as_subclass(PipelineOutput)
        out._value, out._src, out._group, out._device = value, src, group, device
        return out

    def materialize(self) -> Tensor:
        """The whole output on every pipeline rank (one broadcast of it)."""
        return _run(lambda t: t, (self,), {}, self, keep=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        anchor = next(a for a in _leaves((args, kwargs)) if isinstance(a, PipelineOutput))
        if func in _METADATA and args and args[0] is anchor:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.device.__get__:
            return anchor._device
        return _run(func, args, kwargs, anchor, keep=True)


def _leaves(tree) -> list:
    out = []
    tree_map(out.append, tree)
    return out


def _object_device(device: torch.device) -> torch.device:
    """``broadcast_object_list`` stages objects on this device (NCCL needs the rank's GPU)."""
    return device if device.type == "cuda" else torch.device("cpu")


def _run(func, args: tuple, kwargs: dict, anchor: PipelineOutput, keep: bool) -> Any:
    """``func(*args, **kwargs)`` on the last stage; its result kept there or broadcast (see the module doc)."""
    group, src, device = anchor._group, anchor._src, anchor._device
    on_source = dist.get_rank() == src
    message: list[Any] = [None]
    result = None
    if on_source:
        values = tree_map(lambda a: a._value if isinstance(a, PipelineOutput) else a, (args, kwargs))
        result = func(*values[0], **values[1])
        big = isinstance(result, Tensor) and result.numel() * result.element_size() >= KEEP_FRACTION * _nbytes(anchor)
        if keep and big:
            message[0] = ("keep", (tuple(result.shape), result.dtype))
        else:
            message[0] = ("value", tree_map(lambda t: _portable(t) if isinstance(t, Tensor) else t, result))
    dist.broadcast_object_list(message, src=src, group=group, device=_object_device(device))
    kind, payload = message[0]
    if kind == "keep":
        return PipelineOutput._of(result if on_source else None, payload, src, group, device)
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, payload)


def _portable(t: Tensor) -> Tensor:
    """A plain CPU copy that pickles to any rank (logits split over TP gathered first)."""
    full = t.full() if isinstance(t, SplitLogits) else t
    with DisableTorchFunctionSubclass():
        return full.detach().cpu().as_subclass(Tensor)


def _nbytes(t: PipelineOutput) -> int:
    with DisableTorchFunctionSubclass():
        return t.numel() * t.element_size()
