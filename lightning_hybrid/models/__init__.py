"""Reference models: a readable GPT and its LightningModule, and the next-token training shared with
`lightning_hybrid.hf.CausalLM` (`LanguageModel`)."""

from lightning_hybrid.models.gpt import GPT, GPTConfig
from lightning_hybrid.models.language_model import LanguageModel
from lightning_hybrid.models.lightning_gpt import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "LanguageModel"]
