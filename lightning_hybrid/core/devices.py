"""Where a module lives: the helpers every dimension shares (one of each)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer; the CPU for a module that holds none."""
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return torch.device("cpu")


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2's parameters and their gradients); a plain tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def device_memory_bytes(device: torch.device) -> int:
    """The memory of ``device``: a CUDA device's total, else the host's physical memory (a CPU rank's bound)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
