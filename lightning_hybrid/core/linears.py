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
