"""A small, readable reference GPT (in the spirit of nanoGPT).

The model is deliberately built only from plain ``nn.Linear``, ``nn.Embedding``
and ``nn.LayerNorm`` modules and imports nothing from ``torch.distributed``.
Parallelism is applied from the outside by the strategy.

Tensor-parallel friendliness
----------------------------
A tensor-parallel strategy may replace ``q_proj``/``k_proj``/``v_proj`` (and
``fc1``/``gate_proj``/``up_proj``) by layers that hold only a slice of their
*output* features, and ``o_proj`` (and ``fc2``/``down_proj``) by layers that hold
only a slice of their *input* features. It also divides the ``n_head`` /
``n_kv_head`` attributes by the TP size. For this to work the forward pass never
reshapes with ``n_embd`` (or ``C``) after a projection: the number of heads is
inferred from the projected tensors (``view(B, T, -1, head_dim)``), and the GQA
repeat factor from the actual q/k tensors.

Shape legend: ``B`` batch, ``T`` sequence length, ``C`` = ``n_embd``,
``H`` query heads, ``Hkv`` key/value heads, ``D`` = ``head_dim`` = ``C // n_head``,
``F`` = MLP hidden size = ``mlp_ratio * C``, ``V`` vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hybrid.core.document_attention import document_attention

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "GatedMLP", "Block", "GPT"]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`.

    Attributes:
        vocab_size: number of tokens ``V``.
        block_size: maximum sequence length (size of the positional table).
        n_layer: number of transformer blocks.
        n_head: number of query heads ``H``.
        n_kv_head: number of key/value heads ``Hkv``; ``None`` means ``n_head``
            (plain multi-head attention); fewer means grouped-query attention.
        n_embd: model width ``C``; must be divisible by ``n_head``.
        mlp: ``"gelu"`` (``fc1`` -> GELU -> ``fc2``) or ``"swiglu"``
            (``down_proj(silu(gate_proj(x)) * up_proj(x))``).
        mlp_ratio: MLP hidden size is ``mlp_ratio * n_embd`` (both MLP kinds).
        bias: whether Linear layers (except ``lm_head``) and LayerNorms have a bias.
        dropout: dropout probability (embeddings, attention, residuals).
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: Optional[int] = None
    n_embd: int = 64
    mlp: str = "gelu"
    mlp_ratio: int = 4
    bias: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if not isinstance(self.n_kv_head, int) or self.n_kv_head <= 0:
            raise ValueError(f"n_kv_head must be a positive int or None, got {self.n_kv_head!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}"
            )
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        """Per-head width ``D = n_embd // n_head``."""
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """MLP hidden size ``F = mlp_ratio * n_embd``."""
        return self.mlp_ratio * self.n_embd


class CausalSelfAttention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention.

    ``forward(x: (B, T, C), position_ids: (B, T) | None) -> (B, T, C)``; with ``position_ids`` (a padded or packed
    batch, `lightning_hybrid.core.batch`) each token attends only to the tokens of its own document.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # Registered in this order: q, k, v, o.
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=config.bias)  # C -> H*D
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=config.bias)  # C -> Hkv*D
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=config.bias)  # C -> Hkv*D
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)  # H*D -> C
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts are inferred (-1) so that sharded projections just work.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        repeat = q.size(1) // k.size(1)  # GQA: query heads per key/value head
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(repeat, dim=1)  # (B, H, T, D)
        # Causal within each document of a packed or padded batch, one SDPA call per document (no T x T mask).
        y = document_attention(q, k, v, position_ids, dropout_p=self.dropout if self.training else 0.0)  # (B,H,T,D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.resid_dropout(self.o_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Plain GELU MLP: ``fc2(gelu(fc1(x)))``; ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)  # C -> F
        self.act = nn.GELU()
        self.fc2 = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)  # F -> C
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))  # (B, T, F)
        return self.dropout(self.fc2(h))  # (B, T, C)


class GatedMLP(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)  # C -> F
        self.up_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)  # C -> F
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)  # F -> C
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, F)
        return self.dropout(self.down_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block; ``(B, T, C) -> (B, T, C)`` (``position_ids``: see `CausalSelfAttention`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GatedMLP(config) if config.mlp == "swiglu" else MLP(config)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), position_ids)  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class Embedding(nn.Module):
    """Token + position embeddings; ``idx (B, T) -> (B, T, C)`` at ``position_ids`` (default ``0..T-1``). The
    first pipeline layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)  # V -> C
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)  # block_size -> C
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids  # (T,) or (B, T)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)


class Head(nn.Module):
    """Final norm + LM head; ``(B, T, C) -> logits (B, T, V)``. The last pipeline layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # C -> V (not tied)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V); positions are the blocks' business


class GPT(nn.Module):
    """Decoder-only transformer language model: ``embed``, ``blocks``, ``head`` applied in sequence.

    ``forward(idx: LongTensor (B, T), position_ids=None) -> logits (B, T, V)`` with ``T <= block_size``;
    ``position_ids`` ``(B, T)``: each token's position in its document (padded or packed batches,
    `lightning_hybrid.core.batch`), every layer taking them as a keyword.
    `layers()` lists those pieces in order (what pipeline parallelism splits into stages), and
    `init_layer(i)` initialises piece ``i`` from ``(init_seed, i)`` alone, so a rank that materialises
    only some pieces gets exactly the weights a one-device init gives.
    """

    #: names of output projections that write into the residual stream; they get
    #: the GPT-2 scaled init ``0.02 / sqrt(2 * n_layer)``.
    RESIDUAL_PROJECTIONS = ("o_proj", "fc2", "down_proj")

    def __init__(self, config: GPTConfig, init_seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.init_seed = init_seed
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        self.reset_parameters()

    def layers(self) -> list[nn.Module]:
        """The model as a sequence: ``embed, *blocks, head``."""
        return [self.embed, *self.blocks, self.head]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for index in range(len(self.layers())):
            self.init_layer(index)

    @torch.no_grad()
    def init_layer(self, index: int, layer: nn.Module | None = None) -> None:
        """nanoGPT init of piece ``index`` (N(0, 0.02) weights, zero biases, scaled residual projections),
        seeded by ``(init_seed, index)``; ``layer`` defaults to ``self.layers()[index]``."""
        layer = self.layers()[index] if layer is None else layer
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        generator = torch.Generator(device="cpu").manual_seed(self.init_seed * 100_003 + index)
        for name, module in layer.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module.weight.is_meta:  # built on the meta device: a pipeline rank initialises its own layers
                    continue
                std = residual_std if name.rsplit(".", 1)[-1] in self.RESIDUAL_PROJECTIONS else 0.02
                # Drawn on the generator's device, then copied: the same values on every device.
                values = torch.empty(module.weight.shape, device=generator.device).normal_(
                    0.0, std, generator=generator
                )
                module.weight.copy_(values)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = idx
        side = {} if position_ids is None else {"position_ids": position_ids}
        for layer in self.layers():
            x = layer(x, **side)  # (B, T) -> (B, T, C) -> ... -> (B, T, V)
        return x

    def num_parameters(self) -> int:
        """Total number of parameters."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len`` (PaLM, appendix B):
        6 per weight of every matmul -- q/k/v/o, the MLP and the LM head; embeddings are lookups -- plus
        ``12 * n_layer * n_embd * seq_len`` for the attention scores and their weighted sum. From the config
        alone, so it is the whole model's count also where a rank holds only some of its layers."""
        c = self.config
        attention = 2 * c.n_embd * c.n_head * c.head_dim + 2 * c.n_embd * c.n_kv_head * c.head_dim
        mlp = (3 if c.mlp == "swiglu" else 2) * c.n_embd * c.mlp_hidden
        matmul_weights = c.n_layer * (attention + mlp) + c.n_embd * c.vocab_size
        return 6 * matmul_weights + 12 * c.n_layer * c.n_embd * seq_len
