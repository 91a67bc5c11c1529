"""The optimizer of the package's LightningModules: AdamW, decay on matrices only, fused where the device has it.

Fused AdamW (one kernel for every parameter) is chosen from where the parameters are, that is from the
accelerator the strategy moved them to: CUDA (and XPU) yes; the CPU keeps the default (``foreach``)
implementation, whose numbers the CPU parity runs are measured with. Under ZeRO 1-2 the strategy re-points the
param groups at flat bucket slices on the same device, so the choice holds there too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

FUSED_DEVICE_TYPES = ("cuda", "xpu")


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
