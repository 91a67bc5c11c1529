"""A LightningModule and a LightningDataModule written the way a user would, outside the package: what the
recipe tests name by ``_target_`` on the command line (``model=custom model._target_=tests.user_model.TinyLM``).

The module follows the pipeline protocol (``pipeline_layers`` and ``loss_fn``), returns ``{"loss": ...}`` from a
dict batch, and sets ``example_input_array``, which Lightning's model summary runs through the model on every
rank (under ``pp > 1``: the pipeline's forward-only path).
"""

from __future__ import annotations

import atexit
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader


class Block(nn.Module):
    """Pre-norm residual MLP: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)  # C -> 4C
        self.fc2 = nn.Linear(4 * width, width)  # 4C -> C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(L.LightningModule):
    """Token embedding, ``depth`` MLP blocks, LM head: ``tokens (B, T) -> logits (B, T, vocab)``."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        logits = self(batch["tokens"])
        loss = self.loss_fn(logits, batch["targets"])
        self.log("train_loss", loss, sync_dist=True)
        return {"loss": loss}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.loss_fn(self(batch["tokens"]), batch["targets"]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class CountingTokens(L.LightningDataModule):
    """Sequences that count modulo ``vocab`` from random starts: ``{"tokens": (B, T), "targets": (B, T)}``."""

    def __init__(self, vocab: int = 64, seq_len: int = 8, batch_size: int = 4, samples: int = 256) -> None:
        super().__init__()
        self.vocab, self.seq_len, self.batch_size, self.samples = vocab, seq_len, batch_size, samples

    def setup(self, stage: str) -> None:
        starts = torch.randint(self.vocab, (self.samples, 1), generator=torch.Generator().manual_seed(0))
        sequences = (starts + torch.arange(self.seq_len + 1)) % self.vocab  # (N, T + 1)
        self.items = [{"tokens": s[:-1], "targets": s[1:]} for s in sequences]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.items, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.items[: 4 * self.batch_size], batch_size=self.batch_size, drop_last=True)


class AbortAtExitOnRank1(L.Callback):
    """Rank 1's process aborts while its interpreter shuts down, after a complete run (as a TP rank's teardown
    rarely does, "terminate called without an active exception")."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            atexit.register(os.abort)
