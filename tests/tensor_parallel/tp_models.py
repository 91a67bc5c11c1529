"""Small models in the common layouts for the tensor-parallel tests (`test_tensor_parallel_plan.py` and
`test_tensor_parallel_apply.py`): separate and fused attention projections, MHA and GQA, per-head norms, alibi,
gated and plain MLPs, a scaled token embedding, a tiny LM of them all, and tiny random-init ``transformers`` Llama
and GPT-2. Module-level: the spawned ranks import them too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------------------------
# Small models in the common layouts (module-level: the spawned ranks import them too)
# --------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Separate q/k/v/o projections, MHA or GQA; head counts read from attributes (divided when split)."""

    def __init__(self, dim: int = 32, num_heads: int = 4, num_key_value_heads: int | None = None, bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        self.head_dim = dim // num_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(_attend(q, k, v))


class FusedAttention(nn.Module):
    """One fused projection laid out as ``layout`` says and an output projection.

    ``"blocks"``: ``[q; k; v]`` (GPT-2, Phi-3); ``"per_head"``: ``[h0: q k v][h1: q k v]...`` (GPT-NeoX, Bloom);
    ``"groups"``: per key/value group ``[g0: q.. k v]...`` (Falcon's new architecture). ``with_attrs=False``:
    head counts only in the forward's constants (nothing to read).
    """

    def __init__(
        self, dim=32, n_head=4, n_kv_head=None, bias=True, names=("qkv", "proj"), with_attrs=True, layout="blocks",
    ):
        super().__init__()
        self._names, self._layout = names, layout
        head_dim, kv = dim // n_head, n_kv_head or n_head
        self._fixed = (n_head, kv, head_dim)
        if with_attrs:
            self.n_head, self.head_dim = n_head, head_dim
            if n_kv_head is not None:
                self.n_kv_head = n_kv_head
        setattr(self, names[0], nn.Linear(dim, (n_head + 2 * kv) * head_dim, bias=bias))
        setattr(self, names[1], nn.Linear(n_head * head_dim, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        n_head, kv, hd = (getattr(self, "n_head", None), getattr(self, "n_kv_head", None),
                          getattr(self, "head_dim", None))
        n_head, kv, hd = (n_head or self._fixed[0], kv or (n_head if hasattr(self, "n_head") else self._fixed[1]),
                          hd or self._fixed[2])
        y = getattr(self, self._names[0])(x)
        if self._layout == "blocks":
            q, k, v = y.split([n_head * hd, kv * hd, kv * hd], dim=-1)
        elif self._layout == "per_head":
            q, k, v = y.view(B, T, -1, 3 * hd).chunk(3, dim=-1)
        else:
            g = y.view(B, T, -1, n_head // kv + 2, hd)
            q, k, v = g[..., :-2, :].flatten(2, 3), g[..., -2, :], g[..., -1, :]
        q = q.reshape(B, T, -1, hd).transpose(1, 2)
        k = k.reshape(B, T, -1, hd).transpose(1, 2)
        v = v.reshape(B, T, -1, hd).transpose(1, 2)
        return getattr(self, self._names[1])(_attend(q, k, v))


class NormedHeadsAttention(Attention):
    """Qwen3-style: an RMS norm over each head's features (one weight shared by all heads) on q and k; with
    heads split, each rank's norm-weight gradient covers only its heads."""

    def __init__(self, dim=32, num_heads=4):
        super().__init__(dim, num_heads)
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        return self.o_proj(_attend(q, k, v))


class AlibiAttention(nn.Module):
    """Bloom-style: a per-head bias ``[B * H, 1, T]`` handed in by the caller; attention reshaped by ``num_heads``."""

    def __init__(self, dim=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)

    def forward(self, x, alibi):
        B, T, _ = x.shape
        q, k, v = self.query_key_value(x).view(B, T, self.num_heads, 3, self.head_dim).unbind(3)
        q, k, v = (t.transpose(1, 2).reshape(B * self.num_heads, T, self.head_dim) for t in (q, k, v))
        scores = alibi.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=self.head_dim**-0.5)
        probs = scores.view(B, self.num_heads, T, T).softmax(-1).view(B * self.num_heads, T, T)
        y = torch.bmm(probs, v).view(B, self.num_heads, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)
        out = self.dense(y)
        out += x  # the residual added in place to the row layer's (all-reduced) output, as Falcon does
        return out


class AlibiModel(nn.Module):
    def __init__(self, vocab=64, dim=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList([AlibiAttention(dim, num_heads) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        B, T = ids.shape
        slopes = torch.tensor([2.0 ** -(i + 1) for i in range(self.num_heads)])
        alibi = (slopes[:, None, None] * torch.arange(T)).repeat(B, 1, 1)  # [B * H, 1, T]
        x = self.wte(ids)
        for block in self.h:
            x = block(x, alibi)
        return self.lm_head(x)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(q.size(0), q.size(2), -1)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``names`` in registration order (Mixtral: w1, w2 (down), w3)."""

    def __init__(self, dim=32, hidden=64, bias=False, names=("gate_proj", "up_proj", "down_proj"), down="down_proj"):
        super().__init__()
        self._gate, self._up = [n for n in names if n != down]
        self._down = down
        for name in names:
            setattr(self, name,
                    nn.Linear(hidden, dim, bias=bias) if name == down else nn.Linear(dim, hidden, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._down)(F.silu(getattr(self, self._gate)(x)) * getattr(self, self._up)(x))


class FusedGatedMLP(nn.Module):
    """Phi-3-style: one ``gate_up_proj`` whose output is ``[gate; up]``."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PlainMLP(nn.Module):
    def __init__(self, dim=32, hidden=128, bias=True, names=("fc1", "fc2")):
        super().__init__()
        self._names = names
        setattr(self, names[0], nn.Linear(dim, hidden, bias=bias))
        setattr(self, names[1], nn.Linear(hidden, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._names[1])(F.gelu(getattr(self, self._names[0])(x)))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, dim: int = 32):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(dim), attn, nn.LayerNorm(dim), mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ScaledEmbedding(nn.Embedding):
    """Gemma-style: the module's own forward scales the looked-up rows."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim**0.5


class TinyLM(nn.Module):
    """Token + position embeddings and blocks of every attention/MLP layout above, norm and LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, block_size: int = 16, tie: bool = False):
        super().__init__()
        self.wte = ScaledEmbedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(
            [
                Block(Attention(dim, num_heads=4, num_key_value_heads=2), GatedMLP(dim, 64)),
                Block(FusedAttention(dim, n_head=4, n_kv_head=2, names=("c_attn", "c_proj")),
                      PlainMLP(dim, 64, names=("c_fc", "c_proj"))),
                Block(FusedAttention(dim, n_head=4, names=("query_key_value", "dense"), layout="per_head"),
                      FusedGatedMLP(dim, 64)),
                Block(FusedAttention(dim, n_head=4, n_kv_head=2, names=("query_key_value", "dense"), layout="groups"),
                      PlainMLP(dim, 64)),
                Block(NormedHeadsAttention(dim, 4), PlainMLP(dim, 64)),
                Block(FusedAttention(dim, n_head=4, n_kv_head=2, with_attrs=False), PlainMLP(dim, 64)),
            ]
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Holder(nn.Module):
    """Registers the given modules under the given names (for layout-only plan tests)."""

    def __init__(self, **modules: nn.Module):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    kwargs.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).float()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                        embd_pdrop=0.0)
    return GPT2LMHeadModel(config).float()


class TorchEncoderLM(nn.Module):
    """Token embedding, ``nn.TransformerEncoderLayer`` blocks under a causal mask, LM head: torch's own layers, whose
    eval forward without autograd takes a fused fast path that reads their weights directly
    (``torch._transformer_encoder_layer_fwd``), not through their linears' forwards."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(depth))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(x)
