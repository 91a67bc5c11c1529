"""lightning-hybrid: DP x TP x PP with ZeRO behind one PyTorch Lightning strategy."""

from lightning_hybrid.mesh import ParallelDims
from lightning_hybrid.strategy import HybridStrategy

__all__ = ["HybridStrategy", "ParallelDims"]
__version__ = "0.1.0"
