"""lightning-hybrid: DP x TP x PP with ZeRO behind one PyTorch Lightning strategy.

``HybridStrategy`` and ``ParallelDims`` are imported on first use (PEP 562): importing one of the package's light
modules -- ``lightning_hybrid.data.prepare``, whose tokenising worker processes need neither torch nor Lightning -- does
not import torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_hybrid.core.dims import ParallelDims
    from lightning_hybrid.strategy import HybridStrategy

__all__ = ["HybridStrategy", "ParallelDims"]
__version__ = "0.1.0"

_LAZY = {"HybridStrategy": "lightning_hybrid.strategy", "ParallelDims": "lightning_hybrid.core.dims"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_hybrid' has no attribute {name!r}")


def __dir__() -> list:
    return sorted({*globals(), *_LAZY})
