"""The optimizer of the package's LightningModules: AdamW, decay on matrices only, fused where the device has it;
and their learning-rate schedule: a linear warmup, then a constant rate or a cosine or linear decay.

Fused AdamW (one kernel for every parameter) is chosen from where the parameters are, that is from the
accelerator the strategy moved them to: CUDA (and XPU) yes; the CPU keeps the default (``foreach``)
implementation, whose numbers the CPU parity runs are measured with. Under ZeRO 1-2 the strategy re-points the
param groups at flat bucket slices on the same device, so the choice holds there too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

FUSED_DEVICE_TYPES = ("cuda", "xpu")
#: The shapes of the learning rate after the warmup (`lr_factor`).
LR_DECAYS = ("none", "cosine", "linear")


def uses_fused(params: Iterable[torch.Tensor]) -> bool:
    """Whether fused AdamW applies: every parameter floating point on a device type in `FUSED_DEVICE_TYPES`."""
    params = list(params)
    return bool(params) and all(p.device.type in FUSED_DEVICE_TYPES and p.is_floating_point() for p in params)


def adamw(
    module: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over ``module``'s trainable parameters, weight decay on those with ``dim >= 2`` (matrices and
    embeddings), none on norms and biases; fused on CUDA/XPU (`uses_fused`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True if uses_fused(params) else None)


def check_schedule(warmup_steps: int, lr_decay: str, min_lr_ratio: float, decay_steps: int) -> None:
    """``ValueError`` naming a schedule argument that is not valid (see `lr_factor`)."""
    if lr_decay not in LR_DECAYS:
        raise ValueError(f"lr_decay={lr_decay!r}: valid values are {list(LR_DECAYS)}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio}: valid values are in [0, 1] (the final lr / lr)")
    if warmup_steps < 0 or decay_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps}, decay_steps={decay_steps}: valid values are >= 0")


def lr_factor(step: int, warmup_steps: int, lr_decay: str, min_lr_ratio: float, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the peak: ``(step + 1) / warmup``
    during the warmup; after it 1 (``"none"``), or from 1 down to ``min_lr_ratio`` at ``total_steps`` along half a
    cosine (``"cosine"``) or a line (``"linear"``), ``min_lr_ratio`` after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_decay == "none":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if lr_decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape
