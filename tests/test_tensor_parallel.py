"""Tensor parallelism: the plan and its candidate variants (pure, no process group), and the TP layers,
`apply_tp` and its setup-time verification (2 real gloo ranks, one spawn).

The plan tests build small modules in the common layouts (separate and fused attention projections, MHA and
GQA, gated and plain MLPs, token embedding + LM head, GPT-2's Conv1D) plus tiny random-init ``transformers``
models, and assert the styles, fused part sizes and the order of the candidate variants.

The distributed checks run in ONE `run_distributed` call at world size 2 (a module-scoped fixture): each TP
layer and each split model is compared, in fp32, with the unsplit module built from the same seed (outputs,
input gradients, gathered weight gradients, full state dicts); the verification is shown to pick the exact
variant for layouts that look alike (fused [q; k; v] blocks, per-head fused, per-key/value-group fused),
to find the per-head inputs (alibi), the replicated parameters with per-rank gradients (per-head norms) and
the attributes to divide, and to reject a wrong explicit split by naming the module.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing, recompute_selection
from lightning_hybrid.tensor_parallel import (
    ColumnParallelLinear,
    LayerPlan,
    RowParallelLinear,
    ShardSpec,
    apply_tp,
    gather_full_state_dict,
    load_full_state_dict,
    resolve_tp_plan,
    tp_sharded_parameter_names,
)
from lightning_hybrid.tensor_parallel.comm import gather_shard, split_shard, sum_grads_over_tp_
from lightning_hybrid.tensor_parallel.layers import linear_shape, shard_embedding, tp_shard_specs
from lightning_hybrid.tensor_parallel.model_plans import model_tp_plan
from tests.helpers import run_distributed

WORLD = 2
ATOL = 1e-5

ROW_PAR = LayerPlan("rowwise", input_is_parallel=True)


def col(*parts: int, gather: bool = False) -> LayerPlan:
    return LayerPlan("colwise", gather_output=gather, part_sizes=tuple(parts))


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


# --------------------------------------------------------------------------------------------------------------
# 1. Pure plan tests
# --------------------------------------------------------------------------------------------------------------


def _unit(plan, name):
    return plan.units[name]


@pytest.mark.parametrize("bias", [False, True])
def test_plan_mha_separate_qkvo(bias):
    plan = resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, bias=bias)), 2)
    assert plan.layers == {"attn.q_proj": col(32), "attn.k_proj": col(32), "attn.v_proj": col(32),
                           "attn.o_proj": ROW_PAR}
    variants = _unit(plan, "attn").variants
    # Fewest attribute changes first; the always-exact fallback (activations gathered) last.
    assert variants[0].divide == () and ("num_heads", "num_key_value_heads") in [v.divide for v in variants]
    assert variants[-1].label == "weights split, activations gathered"
    assert dict(variants[-1].layers)["q_proj"] == col(32, gather=True)
    assert dict(variants[-1].layers)["o_proj"] == LayerPlan("rowwise", input_is_parallel=False)
    assert plan.replicated == {}


def test_plan_gqa_separate_qkvo():
    plan = resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, num_key_value_heads=2)), 2)
    assert plan.layers == {"attn.q_proj": col(32), "attn.k_proj": col(16), "attn.v_proj": col(16),
                           "attn.o_proj": ROW_PAR}


@pytest.mark.parametrize(
    "names, n_head, n_kv_head, with_attrs, first, second",
    [
        (("qkv", "proj"), 4, None, True, (32, 32, 32), (96,)),  # [q; k; v] blocks, then per-head (contiguous)
        (("qkv", "proj"), 4, None, False, (32, 32, 32), (96,)),  # no attributes: equal thirds, then contiguous
        (("qkv", "o_proj"), 4, 2, True, (32, 16, 16), (64,)),  # GQA parts from n_head / n_kv_head / head_dim
        (("c_attn", "c_proj"), 8, 2, True, (32, 8, 8), (48,)),
    ],
)
def test_plan_fused_qkv_candidates(names, n_head, n_kv_head, with_attrs, first, second):
    attn = FusedAttention(32, n_head=n_head, n_kv_head=n_kv_head, names=names, with_attrs=with_attrs)
    plan = resolve_tp_plan(Holder(attn=attn), 2)
    layouts = list(dict.fromkeys(dict(v.layers)[names[0]].part_sizes for v in plan.units["attn"].variants))
    assert layouts[:2] == [first, second]
    assert plan.layers[f"attn.{names[1]}"] == ROW_PAR


def test_plan_fused_gate_up():
    plan = resolve_tp_plan(Holder(mlp=FusedGatedMLP(32, 64)), 2)
    assert plan.layers == {"mlp.gate_up_proj": col(64, 64), "mlp.down_proj": ROW_PAR}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "names, down, hidden",
    [
        (("gate_proj", "up_proj", "down_proj"), "down_proj", 64),
        (("w1", "w2", "w3"), "w2", 64),  # Mixtral: the down projection is registered in the middle
        (("w1", "w2", "w3"), "w2", 32),  # square: shapes cannot tell, the name decides
    ],
)
def test_plan_gated_mlp(names, down, hidden, bias):
    plan = resolve_tp_plan(Holder(mlp=GatedMLP(32, hidden, bias=bias, names=names, down=down)), 2)
    assert plan.layers == {f"mlp.{n}": (ROW_PAR if n == down else col(hidden)) for n in names}


@pytest.mark.parametrize("names", [("fc1", "fc2"), ("c_fc", "c_proj")])
def test_plan_plain_mlp(names):
    plan = resolve_tp_plan(Holder(mlp=PlainMLP(32, 128, names=names)), 4)
    assert plan.layers == {f"mlp.{names[0]}": col(128), f"mlp.{names[1]}": ROW_PAR}


def test_plan_square_unknown_names_registration_order_decides():
    plan = resolve_tp_plan(Holder(pair=Holder(lin_a=nn.Linear(32, 32), lin_b=nn.Linear(32, 32))), 2)
    assert plan.layers == {"pair.lin_b": ROW_PAR, "pair.lin_a": col(32)}


def test_plan_tiny_lm_units_and_kinds():
    plan = resolve_tp_plan(TinyLM(), 2)
    assert set(plan.units) == {"wte", "lm_head"} | {f"blocks.{i}.{m}" for i in range(6) for m in ("attn", "mlp")}
    assert plan.layers["wte"] == LayerPlan("rowwise") and plan.layers["lm_head"] == col(64, gather=True)
    assert plan.replicated == {"wpe": "not the token embedding"}
    assert plan.layers["blocks.1.attn.c_attn"] == col(32, 16, 16)
    assert plan.layers["blocks.2.mlp.gate_up_proj"] == col(64, 64)
    assert "wpe (not the token embedding)" in plan.summary()


def test_plan_gpt2_conv1d():
    model = tiny_gpt2()
    assert linear_shape(model.transformer.h[0].attn.c_attn) == (32, 96, True)
    plan = resolve_tp_plan(model, 2)
    assert plan.layers["transformer.h.0.attn.c_attn"] == col(32, 32, 32)
    assert plan.layers["transformer.h.0.attn.c_proj"] == ROW_PAR
    assert plan.layers["transformer.h.0.mlp.c_fc"] == col(128) and plan.layers["transformer.h.0.mlp.c_proj"] == ROW_PAR
    # GPT-2's vocabulary of 50257 would not divide; this one does (128), so the embedding is split.
    assert plan.layers["transformer.wte"] == LayerPlan("rowwise")


def test_plan_takes_the_models_own_plan_first():
    model = tiny_llama()
    patterns = model_tp_plan(model)
    assert patterns["model.layers.*.self_attn.q_proj"] == "colwise" and patterns["lm_head"] == "colwise_gather_output"
    plan = resolve_tp_plan(model, 2)
    assert {u.source for u in plan.units.values()} == {"model plan"}
    assert plan.layers["model.layers.0.self_attn.k_proj"] == col(16)
    assert plan.layers["model.embed_tokens"] == LayerPlan("rowwise") and plan.layers["lm_head"] == col(128, gather=True)
    # Nested inside another module (a LightningModule's attribute), the patterns get its prefix.
    assert "model.model.layers.*.mlp.down_proj" in model_tp_plan(Holder(model=model))
    assert {u.source for u in resolve_tp_plan(tiny_gpt2(), 2).units.values()} == {"auto"}  # GPT-2 ships none


def test_gqa_with_too_few_kv_heads_falls_back_to_gathered_activations():
    plan = resolve_tp_plan(tiny_llama(), 4)  # 2 key/value heads over 4 ranks: no head split is exact
    labels = [v.label for v in plan.units["model.layers.0.self_attn"].variants]
    assert labels[-1] == "weights split, activations gathered"


def test_explicit_plan_overrides_and_first_match_wins():
    model = TinyLM()
    plan = resolve_tp_plan(model, 2, {"blocks.0.mlp.down_proj": "rowwise", "blocks.0.mlp.*": "replicate"})
    assert plan.units["blocks.0.mlp.down_proj"].variants[0].layers == (("", LayerPlan("rowwise")),)
    assert ("blocks.0.mlp.gate_proj" not in plan.layers
            and plan.replicated["blocks.0.mlp.gate_proj"] == "tp_plan 'blocks.0.mlp.*'")
    assert plan.layers["blocks.1.mlp.c_fc"] == col(64)  # untouched by the explicit plan
    # Pinned fields: a dict value; transformers style names are accepted too.
    plan = resolve_tp_plan(model, 2, {"blocks.1.attn.c_attn": {"style": "colwise", "part_sizes": [64]},
                                      "wpe": "embedding_rowwise"})
    assert plan.layers["blocks.1.attn.c_attn"] == col(64) and plan.units["blocks.1.attn"].explicit
    assert plan.layers["wpe"] == LayerPlan("rowwise")
    plan = resolve_tp_plan(Holder(lone=nn.Linear(32, 8)), 2, {"lone": "colwise"})
    assert plan.layers == {"lone": col(8, gather=True)} and plan.replicated == {}


def test_explicit_plan_errors():
    model = TinyLM()
    with pytest.raises(ValueError,
                       match=r"'columnwise' is invalid: valid styles are \['colwise', 'rowwise', 'replicate'\]"):
        resolve_tp_plan(model, 2, {"*.mlp.*": "columnwise"})
    with pytest.raises(ValueError, match=r"'\*\.nothing_here' matches no"):
        resolve_tp_plan(model, 2, {"*.mlp.*": "replicate", "*.nothing_here": "replicate"})
    with pytest.raises(ValueError, match="tp_plan='manual' is invalid"):
        resolve_tp_plan(model, 2, "manual")
    with pytest.raises(ValueError, match=r"embedding 'wte'.*'colwise'"):
        resolve_tp_plan(model, 2, {"wte": "colwise"})
    with pytest.raises(ValueError,
                       match=r"part_sizes \[32, 16\] of .blocks.1.attn.c_attn. do not add up to its out_features = 64"):
        resolve_tp_plan(model, 2, {"blocks.1.attn.c_attn": {"style": "colwise", "part_sizes": [32, 16]}})
    with pytest.raises(ValueError, match=r"tp=4 does not divide out_features = 30 of module 'lone'"):
        resolve_tp_plan(Holder(lone=nn.Linear(32, 30)), 4, {"lone": "colwise"})
    with pytest.raises(ValueError, match=r"tp=4 does not divide in_features = 30 of module 'lone'"):
        resolve_tp_plan(Holder(lone=nn.Linear(30, 32)), 4, {"lone": "rowwise"})


def test_sizes_that_do_not_divide_leave_the_module_whole_in_the_auto_plan():
    plan = resolve_tp_plan(Holder(mlp=PlainMLP(32, 30), tok_emb=nn.Embedding(30, 32)), 4)
    assert plan.units == {}
    assert plan.replicated["mlp.fc1"] == "tp=4 does not divide its sizes" and "tok_emb" in plan.replicated


def test_embedding_options_vocab_parallel_cannot_honour_stay_replicated():
    class WithMaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(16, 8, max_norm=1.0)

    plan = resolve_tp_plan(WithMaxNorm(), 2)
    assert plan.replicated["tok_emb"] == "max_norm not supported by a vocabulary-parallel embedding"
    with pytest.raises(ValueError, match=r"Embedding 'tok_emb' uses max_norm.*'replicate'"):
        resolve_tp_plan(WithMaxNorm(), 2, {"tok_emb": "rowwise"})


def test_shard_spec_chunks():
    spec = ShardSpec(0, (32, 16, 16))
    assert spec.chunks(0, 2) == [(0, 0, 16), (16, 32, 8), (24, 48, 8)]
    assert spec.chunks(1, 2) == [(0, 16, 16), (16, 40, 8), (24, 56, 8)]
    full = torch.arange(64.0)
    assert torch.equal(split_shard(full, spec, 1, 2), torch.cat([full[16:32], full[40:48], full[56:64]]))


# --------------------------------------------------------------------------------------------------------------
# 2. Distributed checks: one spawn of 2 gloo ranks, every check in `_tp_worker`
# --------------------------------------------------------------------------------------------------------------


def _err(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return (a.detach().float() - b.detach().float()).abs().max().item()


def Conv1D(nf: int, nx: int) -> nn.Module:
    """transformers' own Conv1D as GPT-2 uses it (``y = x W + b``, ``W`` of shape ``[in, out]``; TP recognises the
    class itself), with random weights and bias."""
    from transformers.pytorch_utils import Conv1D as HFConv1D

    module = HFConv1D(nf, nx)
    with torch.no_grad():
        module.weight.copy_(torch.randn(nx, nf) * 0.1)
        module.bias.copy_(torch.randn(nf) * 0.1)
    return module


def _check_layer(res, key, group, make_ref, make_tp, in_split, out_split, in_f, out_f):
    """A TP layer against its unsplit original: outputs, input gradient, gathered weight gradients."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1)
    ref = make_ref()
    tp = make_tp(copy.deepcopy(ref))
    x, g = torch.randn(3, 5, in_f), torch.randn(3, 5, out_f)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * g).sum().backward()
    xt = (split_shard(x, in_split, rank, world) if in_split else x.clone()).requires_grad_()
    yt = tp(xt)
    g_t = split_shard(g, out_split, rank, world) if out_split else g
    (yt * g_t).sum().backward()
    res["err"][f"{key}/out"] = _err(yt, split_shard(yr, out_split, rank, world) if out_split else yr)
    res["err"][f"{key}/dx"] = _err(xt.grad, split_shard(xr.grad, in_split, rank, world) if in_split else xr.grad)
    for name, (spec, grp) in tp_shard_specs(tp).items():
        res["err"][f"{key}/d{name}"] = _err(gather_shard(dict(tp.named_parameters())[name].grad, spec, grp),
                                            dict(ref.named_parameters())[name].grad)


def _layer_checks(res, group):
    for gather in (True, False):
        for parts in ((24,), (8, 8, 8)):
            out_split = None if gather else ShardSpec(-1, parts)
            _check_layer(res, f"col/gather={gather}/parts={parts}", group, lambda: nn.Linear(16, 24),
                         lambda m, g=gather, p=parts: ColumnParallelLinear(m, group, g, p), None, out_split, 16, 24)
            _check_layer(res, f"conv1d_col/gather={gather}/parts={parts}", group, lambda: Conv1D(24, 16),
                         lambda m, g=gather, p=parts: ColumnParallelLinear(m, group, g, p), None, out_split, 16, 24)
    for parallel in (True, False):
        in_split = ShardSpec(-1, (24,)) if parallel else None
        _check_layer(res, f"row/parallel={parallel}", group, lambda: nn.Linear(24, 16),
                     lambda m, p=parallel: RowParallelLinear(m, group, p), in_split, None, 24, 16)
        _check_layer(res, f"conv1d_row/parallel={parallel}", group, lambda: Conv1D(16, 24),
                     lambda m, p=parallel: RowParallelLinear(m, group, p), in_split, None, 24, 16)
    # Embeddings split in place, a subclass with its own forward (scaled) and a padding index included.
    for cls, pad in ((nn.Embedding, None), (ScaledEmbedding, 11)):
        torch.manual_seed(3)
        ref = cls(16, 8, padding_idx=pad)
        tp = shard_embedding(copy.deepcopy(ref), group)
        ids = torch.randint(0, 16, (4, 7))
        ids[0, :3] = torch.tensor([0, 7, 15])
        ids[1, 0] = 8
        g = torch.randn(4, 7, 8)
        (ref(ids) * g).sum().backward()
        yt = tp(ids)
        (yt * g).sum().backward()
        key = f"emb/{cls.__name__}"
        res["err"][f"{key}/out"] = _err(yt, ref(ids))
        res["err"][f"{key}/dW"] = _err(gather_shard(tp.weight.grad, ShardSpec(0, (16,)), group), ref.weight.grad)
        res["ok"][f"{key}/keeps_class"] = type(tp) is cls and tuple(tp.weight.shape) == (8, 8)


def _lm_loss(model, ids):
    logits = model(ids)
    return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _hf_loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def _check_model(res, key, group, make_model, loss_fn, vocab, run_example, tp_plan="auto", **options):
    """Verify and split a copy of the model (``options``: `apply_tp`'s sequence parallelism and split logits);
    compare logits, loss and every gradient with the unsplit model; the full state dict round trip. Returns the
    split model and `apply_tp`'s result."""
    err, ok = res["err"], res["ok"]
    ref = make_model()
    tpm = copy.deepcopy(ref)
    result = apply_tp(tpm, group, resolve_tp_plan(tpm, dist.get_world_size(group), tp_plan),
                      run_example=lambda: run_example(tpm), **options)
    res["results"][key] = result
    if result.errors:
        return tpm, result
    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (2, 12))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # token ids in every rank's vocabulary slice
    logits_r, loss_r = loss_fn(ref, ids)
    loss_r.backward()
    logits_t, loss_t = loss_fn(tpm, ids)
    loss_t.backward()
    sum_grads_over_tp_([tpm.get_parameter(n).grad for n in sorted(result.partial_grads)], group)  # as the strategy does
    err[f"{key}/logits"] = _err(logits_t, logits_r)
    err[f"{key}/loss"] = _err(loss_t, loss_r)
    specs = tp_shard_specs(tpm)
    grads_t = {n: (gather_shard(p.grad, specs[n][0], group) if n in specs else p.grad)
               for n, p in tpm.named_parameters()}
    err[f"{key}/grads"] = max(_err(grads_t.get(n), p.grad) for n, p in ref.named_parameters() if p.grad is not None)
    err[f"{key}/gathered_state_dict"] = max(_err(v, ref.state_dict()[k])
                                            for k, v in gather_full_state_dict(tpm).items())
    ok[f"{key}/split_something"] = bool(tp_sharded_parameter_names(tpm))
    # Idempotent: a second apply splits nothing more.
    ok[f"{key}/idempotent"] = apply_tp(tpm, group, resolve_tp_plan(tpm, dist.get_world_size(group))).chosen == {}
    # load_full_state_dict round trip: perturb the unsplit weights, load them, gather them back, same outputs.
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    load_full_state_dict(tpm, new_sd)
    err[f"{key}/roundtrip_state_dict"] = max(_err(v, new_sd[k]) for k, v in gather_full_state_dict(tpm).items())
    with torch.no_grad():
        err[f"{key}/roundtrip_logits"] = _err(loss_fn(tpm, ids)[0], loss_fn(ref, ids)[0])
    return tpm, result


def _tiny_lm(tie=False):
    torch.manual_seed(0)
    return TinyLM(tie=tie)


def _alibi_model():
    torch.manual_seed(0)
    return AlibiModel()


class ShuffledBetweenBlocks(TinyLM):
    """Mixes the tokens between two blocks: blocks that see part of the sequence cannot reproduce it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for index, block in enumerate(self.blocks):
            x = block(x.flip(1) if index == 3 else x)
        return self.lm_head(self.ln_f(x))


def _sequence_parallel_checks(res, group, ids, hf_ids):
    """Sequence parallelism with logits kept split: every block layout of TinyLM (incl. per-head norms and
    gathered activations), Llama and GPT-2 (Conv1D, a position embedding after the token embedding) equal the
    unsplit model; the blocks run on half the sequence; a model that mixes tokens between blocks is refused; a
    sequence that does not divide is an error naming it."""
    even = torch.cat([ids, ids[:, :5]], dim=1)  # 16 tokens: divides by tp
    options = dict(sequence_parallel=True, split_logits=True)
    tpm, result = _check_model(res, "sp_tiny_lm", group, _tiny_lm, _lm_loss, 64, lambda m: m(even), **options)
    res["ok"]["sp_tiny_lm/one_run"] = result.sequence_runs == [[f"blocks.{i}" for i in range(6)]]
    seen = []
    handle = tpm.blocks[2].register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    tpm(even)
    handle.remove()
    res["ok"]["sp_tiny_lm/blocks_see_half"] = seen == [8]
    res["ok"]["sp_tiny_lm/logits_split"] = type(tpm(even)).__name__ == "SplitLogits"
    res["ok"]["sp_tiny_lm/norms_summed"] = {"blocks.0.ln_1.weight", "blocks.5.ln_2.bias"} <= set(result.partial_grads)
    try:
        tpm(ids)  # 11 tokens
        res["ok"]["sp_tiny_lm/odd_length_refused"] = False
    except ValueError as err:
        res["ok"]["sp_tiny_lm/odd_length_refused"] = ("sequence length divides by tp=2" in str(err)
                                                      and "[2, 11, 32]" in str(err))
    hf_even = torch.cat([hf_ids, hf_ids[:, :5]], dim=1)
    _check_model(res, "sp_llama", group, tiny_llama, _hf_loss, 128, lambda m: m(input_ids=hf_even), **options)
    _check_model(res, "sp_gpt2", group, tiny_gpt2, _hf_loss, 128, lambda m: m(input_ids=hf_even), **options)
    torch.manual_seed(0)
    shuffled = ShuffledBetweenBlocks()
    result = apply_tp(shuffled, group, resolve_tp_plan(shuffled, 2), run_example=lambda: shuffled(even), **options)
    res["results"]["sp_shuffled"] = result
    from tests.user_modules import UserLM  # attention and MLP in one module

    user = UserLM()
    res["results"]["sp_user"] = apply_tp(user, group, resolve_tp_plan(user, 2), run_example=lambda: user(even),
                                         **options)


class _CollectiveCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace in ("c10d", "_c10d_functional") and func.__name__ != "wait_tensor.default"
        return func(*args, **(kwargs or {}))


def _selective_recompute_checks(res, group, hf_ids):
    """Selective recompute of split layers (eager attention, dropout 0.1, with and without SP) gives exactly
    the gradients of the same split model without recompute, and its backward communicates no more than without
    recompute: reductions are kept, all-gathers run again where SP all-gathers its kept shards anyway. (A model with
    dropout is compared with itself: under TP its masks are not the unsplit model's.)"""
    even = torch.cat([hf_ids, hf_ids[:, :5]], dim=1)
    for mode, sp in (("attention", True), ("pointwise", False)):
        key = f"selective_{mode}{'_sp' if sp else ''}"
        models = []
        for recompute in (False, True):
            model = tiny_llama(attention_dropout=0.1, attn_implementation="eager").train()
            res["results"][key] = apply_tp(model, group, resolve_tp_plan(model, dist.get_world_size(group)),
                                           sequence_parallel=sp, run_example=lambda: model(input_ids=even),
                                           split_logits=True)
            if recompute:
                apply_activation_checkpointing(model, [f"model.layers.{i}" for i in range(2)],
                                               recompute_selection(mode))
            models.append(model)
        grads, collectives = [], []
        for model in models:
            torch.manual_seed(9)
            loss = _hf_loss(model, even)[1]
            with _CollectiveCounter() as counter:
                loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
            collectives.append(counter.count)
        res["err"][f"{key}/grads"] = max(_err(grads[1][n], g) for n, g in grads[0].items() if g is not None)
        res["ok"][f"{key}/no_more_communication_in_recompute"] = collectives[0] == collectives[1] > 0


def _split_logits_checks(res, group):
    """`SplitLogits` against the gathered logits: what stays split, cross entropy (mean, sum, none, ignored
    targets) and its gradient from the shards, argmax, fused parts, and every other op through a gather."""
    from lightning_hybrid.tensor_parallel.loss import SplitLogits

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    err, ok = res["err"], res["ok"]
    torch.manual_seed(6)
    full = torch.randn(2, 5, 12)
    y = torch.randint(0, 12, (2, 5))
    y[0, 1] = -100
    for parts in ((12,), (4, 8)):
        spec = ShardSpec(-1, parts)
        ref = full.clone().requires_grad_()
        local = split_shard(full, spec, rank, world).requires_grad_()
        split = SplitLogits.wrap(local * 1.0, group, spec)
        key = f"split_logits/{parts}"
        ok[f"{key}/shape"] = tuple(split.shape) == (2, 5, 12) and split.size(-1) == 12 and split.numel() == 120
        for reduction in ("mean", "sum", "none"):
            err[f"{key}/ce_{reduction}"] = _err(F.cross_entropy(split.flatten(0, 1), y.flatten(), reduction=reduction),
                                                F.cross_entropy(full.flatten(0, 1), y.flatten(), reduction=reduction))
        ok[f"{key}/stays_split"] = all(type(t) is SplitLogits for t in (
            split.flatten(0, 1), split.view(-1, 12), split[:, :-1], split[..., :], split.float(), split / 2.0,
            split.detach(), torch.cat([split, split], dim=0)))
        F.cross_entropy(split[:, :-1].reshape(-1, split.size(-1)), y[:, 1:].reshape(-1)).backward()
        F.cross_entropy(ref[:, :-1].reshape(-1, ref.size(-1)), y[:, 1:].reshape(-1)).backward()
        err[f"{key}/ce_grad"] = _err(local.grad, split_shard(ref.grad, spec, rank, world))
        ok[f"{key}/argmax"] = torch.equal(split.argmax(-1), full.argmax(-1))
        err[f"{key}/gathered_ops"] = max(
            _err(split.softmax(-1), full.softmax(-1)), _err(split[..., 3], full[..., 3]), _err(split.sum(), full.sum()),
            _err(F.cross_entropy(split.view(-1, 12), y.flatten(), label_smoothing=0.1),
                 F.cross_entropy(full.view(-1, 12), y.flatten(), label_smoothing=0.1)),
        )


def _tp_worker() -> dict:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    res: dict = {"err": {}, "ok": {}, "results": {}}
    _layer_checks(res, group)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(7))
    _check_model(res, "tiny_lm", group, _tiny_lm, _lm_loss, 64, lambda m: m(ids))
    tied, _ = _check_model(res, "tiny_lm_tied", group, lambda: _tiny_lm(tie=True), _lm_loss, 64, lambda m: m(ids))
    res["ok"]["tiny_lm_tied/still_tied"] = tied.lm_head.weight is tied.wte.weight and tied.wte.weight.shape[0] == 32
    _check_model(res, "alibi", group, _alibi_model, _lm_loss, 64, lambda m: m(ids))
    hf_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(8))
    _check_model(res, "llama", group, tiny_llama, _hf_loss, 128, lambda m: m(input_ids=hf_ids))
    _check_model(res, "gpt2", group, tiny_gpt2, _hf_loss, 128, lambda m: m(input_ids=hf_ids))
    _sequence_parallel_checks(res, group, ids, hf_ids)
    _split_logits_checks(res, group)
    _selective_recompute_checks(res, group, hf_ids)
    # A wrong explicit split (parts that are not the layout of the fused projection) is named, not trained.
    _check_model(res, "planted", group, _tiny_lm, _lm_loss, 64, lambda m: m(ids),
                 tp_plan={"blocks.1.attn.c_attn": {"style": "colwise", "part_sizes": [16, 16, 32]}})
    res["results"] = {k: (r.summary(), {n: (v.label, v.divide, v.head_inputs) for n, v in r.chosen.items()},
                          sorted(r.partial_grads), r.errors)
                      for k, r in res["results"].items()}
    return res


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, WORLD)


def _assert_close(results, prefix: str):
    checked = 0
    for rank, res in enumerate(results):
        errs = {k: v for k, v in res["err"].items() if k.startswith(prefix)}
        bad = {k: v for k, v in errs.items() if not v < ATOL}
        assert not bad, f"rank {rank}: errors >= {ATOL}: {bad}"
        failed = [k for k, v in res["ok"].items() if k.startswith(prefix) and not v]
        assert not failed, f"rank {rank}: failed checks {failed}"
        checked += len(errs)
    assert checked, f"no checks recorded under {prefix!r}"


@pytest.mark.parametrize("prefix", ["col/", "conv1d_col/", "row/", "conv1d_row/", "emb/"])
def test_tp_layers_match_unsplit(tp_results, prefix):
    _assert_close(tp_results, prefix)


@pytest.mark.parametrize("model", ["tiny_lm", "tiny_lm_tied", "alibi", "llama", "gpt2", "sp_tiny_lm", "sp_llama",
                                   "sp_gpt2", "selective_attention_sp", "selective_pointwise"])
def test_verified_split_models_match_unsplit(tp_results, model):
    assert tp_results[0]["results"][model][3] == []
    _assert_close(tp_results, f"{model}/")


def test_sequence_parallel_splits_the_blocks_and_refuses_what_it_cannot_reproduce(tp_results):
    summary = tp_results[0]["results"]["sp_llama"][0]
    assert "sequence split in [model.layers.0..model.layers.1]" in summary
    assert "model.layers.0.input_layernorm.weight" in tp_results[0]["results"]["sp_llama"][2]
    for res in tp_results:
        errors = res["results"]["sp_shuffled"][3]
        assert len(errors) == 1 and "blocks.3 does not receive blocks.2's output" in errors[0], errors
        errors = res["results"]["sp_user"][3]
        assert len(errors) == 2 and "blocks.0 holds its column and row layers itself" in errors[0], errors


def test_split_logits_behave_as_the_whole(tp_results):
    _assert_close(tp_results, "split_logits/")


def test_verification_picks_the_exact_layout(tp_results):
    summary, chosen, partial, _ = tp_results[0]["results"]["tiny_lm"]
    assert chosen["blocks.0.attn"][0] == "heads + heads + heads"
    assert chosen["blocks.1.attn"][0] == "[q; k; v]"  # blocks: n_head / n_kv_head divided
    assert chosen["blocks.1.attn"][1] == ("n_head", "n_kv_head")
    assert chosen["blocks.2.attn"][0] == "per-head q/k/v"
    assert chosen["blocks.3.attn"][0] == "per-head q/k/v"  # per key/value group: a contiguous split too
    assert chosen["blocks.2.mlp"][0] == "[gate; up]"
    assert chosen["blocks.5.attn"][0] == "weights split, activations gathered"  # GQA with nothing to read heads from
    assert partial == ["blocks.4.attn.k_norm.weight", "blocks.4.attn.q_norm.weight"]
    assert "verified" in summary and chosen["wte"][0] == "vocabulary split"


def test_verification_finds_per_head_inputs_and_hf_attributes(tp_results):
    _, chosen, _, _ = tp_results[0]["results"]["alibi"]
    assert chosen["h.0"][2] == (("alibi", 0),) or chosen["h.0"][2] == ((1, 0),)
    _, chosen, _, _ = tp_results[0]["results"]["gpt2"]
    assert chosen["transformer.h.0.attn"][0] == "[q; k; v]" and "split_size" in chosen["transformer.h.0.attn"][1]


def test_planted_wrong_split_is_named(tp_results):
    for res in tp_results:  # on every rank
        errors = res["results"]["planted"][3]
        assert len(errors) == 1 and "blocks.1.attn" in errors[0] and "tp_plan" in errors[0]


def test_ranks_agree(tp_results):
    assert tp_results[0]["ok"].keys() == tp_results[1]["ok"].keys()
    decisions = [{k: r[1:] for k, r in res["results"].items()} for res in tp_results]  # all but the timed summary
    assert decisions[0] == decisions[1]
