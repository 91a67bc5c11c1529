"""A LightningModule written the way most people write one: layers held directly (``self.embed``, an
``nn.ModuleList`` of blocks, ``self.head``), the first pipeline layer a bare ``nn.Embedding`` and the last a bare
``nn.Linear``, attention reshaped by head-count and head-size attributes, attention and MLP in one module. No helper
of this package is used."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class UserBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No attention biases: a key bias gets an exactly-zero gradient (softmax ignores it), which Adam turns
        # into updates from rounding noise alone, in any layout.
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class UserLM(L.LightningModule):
    def __init__(self, vocab: int = 256, dim: int = 32, layers: int = 2, heads: int = 4, lr: float = 5e-4) -> None:
        super().__init__()
        self.lr = lr
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(UserBlock(dim, heads) for _ in range(layers))
            self.head = nn.Linear(dim, vocab)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab, average="micro")

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits.argmax(-1).flatten(), y.flatten())
        self.log("val_loss", self.loss_fn(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TiedUserLM(UserLM):
    """`UserLM` with its LM head tied to the token embedding (one parameter; across pipeline stages, two copies kept
    tied by the strategy)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head.weight = self.embed.weight
