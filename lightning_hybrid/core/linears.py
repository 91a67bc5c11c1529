"""Linear-like modules as every dimension sees them: ``nn.Linear`` (weight ``[out, in]``) and ``transformers``'
``Conv1D`` (GPT-2; weight ``[in, out]``, ``y = x W + b``)."""

from __future__ import annotations

import sys
from typing import NamedTuple

from torch import nn


class LinearShape(NamedTuple):
    in_features: int
    out_features: int
    transposed: bool  # weight stored [in, out] (Conv1D)


def _is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D``. Nothing is imported: an instance exists only once
    ``transformers.pytorch_utils`` has been imported, so the class is looked up there only when it is loaded."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def linear_shape(module: nn.Module) -> LinearShape | None:
    """Shape of a linear-like module (``nn.Linear`` or transformers' ``Conv1D``), else ``None``."""
    if isinstance(module, nn.Linear):
        return LinearShape(module.in_features, module.out_features, False)
    if _is_conv1d(module) and module.weight is not None and module.weight.dim() == 2:
        return LinearShape(module.weight.size(0), module.weight.size(1), True)
    return None


def lora_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA wrapper: peft's ``lora.Linear`` / ``lora.Embedding`` (the wrapped layer as
    ``base_layer``, the adapters in ``lora_A`` / ``lora_B``, one per adapter name). Recognised by these attributes;
    nothing is imported."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def lora_base(module: nn.Module) -> nn.Module | None:
    """The linear-like layer a LoRA wrapper adapts (`lora_wrapper`), else ``None``."""
    if lora_wrapper(module) and linear_shape(module.base_layer) is not None:
        return module.base_layer
    return None
