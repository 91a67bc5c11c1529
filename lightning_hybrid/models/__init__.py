"""Reference models: a readable GPT and its LightningModule."""

from lightning_hybrid.models.gpt import GPT, GPTConfig
from lightning_hybrid.models.lightning_gpt import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule"]
