"""Autocast's casts for the ops it does not see: the inputs of this codebase's own lower-precision ops."""

from __future__ import annotations

import torch
from torch import Tensor


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` as autocast casts the inputs of one of its lower-precision ops (a matmul, SDPA): the floating ones
    in its dtype where it is on for their device, else unchanged. For this codebase's own ops that autocast does not
    see: a custom op (a TP row layer under a selective checkpoint,
    `lightning_hybrid.parallel.tensor_parallel.layers`) and SDPA caught by a ``TorchFunctionMode`` before autocast
    casts its inputs (`lightning_hybrid.parallel.context_parallel`, where transformers' Llama hands fp32 queries and
    keys beside a bf16 value)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
