"""Tensor parallelism: the plan (pure, no process group) and the TP layers / `apply_tp` (2 real gloo ranks).

The plan tests build small modules in the common layouts (separate and fused attention projections, MHA and
GQA, gated and plain MLPs, token embedding + LM head) plus a tiny random-init ``transformers`` Llama, and
assert the exact styles, flags and fused part sizes, the explicit-plan rules and the error messages.

The distributed tests run every check in ONE `run_distributed` call at world size 2 (a module-scoped
fixture): each TP layer / TP model is compared, in fp32, with the unsplit module built from the same seed
on every rank (outputs, input gradients, all-gathered weight gradients, gradient norms, full state dicts).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hybrid.tensor_parallel import (
    ColumnParallelLinear,
    LayerPlan,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tp,
    gather_full_state_dict,
    load_full_state_dict,
    resolve_tp_plan,
    tp_sharded_parameter_names,
)
from lightning_hybrid.tensor_parallel.comm import gather_parts, split_parts
from tests.helpers import run_distributed

WORLD = 2
ATOL = 1e-5

COL = LayerPlan("colwise")  # building blocks for the expected plans
ROW_PAR = LayerPlan("rowwise", input_is_parallel=True)


def col(*parts: int, gather: bool = False) -> LayerPlan:
    return LayerPlan("colwise", gather_output=gather, part_sizes=tuple(parts))


# --------------------------------------------------------------------------------------------------------------
# Small models in the common layouts (module-level: the spawned ranks import them too)
# --------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Separate q/k/v/o projections, MHA or GQA; head counts read from attributes (divided by `apply_tp`)."""

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
    """One fused projection (``qkv`` / ``c_attn``) and an output projection; GPT-style ``n_head`` attributes."""

    def __init__(
        self,
        dim: int = 32,
        n_head: int = 4,
        n_kv_head: int | None = None,
        bias: bool = True,
        names: tuple[str, str] = ("qkv", "proj"),
        with_attrs: bool = True,
    ):
        super().__init__()
        self._names = names
        head_dim, kv = dim // n_head, n_kv_head or n_head
        if with_attrs:
            self.n_head, self.head_dim = n_head, head_dim
            if n_kv_head is not None:
                self.n_kv_head = n_kv_head
        setattr(self, names[0], nn.Linear(dim, (n_head + 2 * kv) * head_dim, bias=bias))
        setattr(self, names[1], nn.Linear(n_head * head_dim, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        kv = getattr(self, "n_kv_head", self.n_head)
        hd = self.head_dim
        q, k, v = getattr(self, self._names[0])(x).split([self.n_head * hd, kv * hd, kv * hd], dim=-1)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, kv, hd).transpose(1, 2)
        v = v.view(B, T, kv, hd).transpose(1, 2)
        return getattr(self, self._names[1])(_attend(q, k, v))


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
            setattr(self, name, nn.Linear(hidden, dim, bias=bias) if name == down else nn.Linear(dim, hidden, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._down)(F.silu(getattr(self, self._gate)(x)) * getattr(self, self._up)(x))


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


class TinyLM(nn.Module):
    """Token + position embeddings, a GQA/gated-MLP block, a fused-GQA/plain-MLP block, norm and LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, block_size: int = 16, tie: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(
            [
                Block(Attention(dim, num_heads=4, num_key_value_heads=2), GatedMLP(dim, 64)),
                Block(FusedAttention(dim, n_head=4, n_kv_head=2, names=("c_attn", "c_proj")), PlainMLP(dim, 64, names=("c_fc", "c_proj"))),
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

    kwargs = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).float()


# --------------------------------------------------------------------------------------------------------------
# 1. Pure plan tests
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_plan_mha_separate_qkvo(bias):
    plan = resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, bias=bias)), 2)
    assert plan.layers == {
        "attn.o_proj": ROW_PAR,
        "attn.q_proj": col(32),
        "attn.k_proj": col(32),
        "attn.v_proj": col(32),
    }
    assert plan.head_attrs == {"attn": ("num_heads", "num_key_value_heads")}
    assert plan.replicated == {}


def test_plan_gqa_separate_qkvo():
    plan = resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, num_key_value_heads=2)), 2)
    assert plan.layers == {
        "attn.o_proj": ROW_PAR,
        "attn.q_proj": col(32),
        "attn.k_proj": col(16),
        "attn.v_proj": col(16),
    }
    assert plan.head_attrs == {"attn": ("num_heads", "num_key_value_heads")}


@pytest.mark.parametrize(
    "names, n_head, n_kv_head, with_attrs, parts",
    [
        (("qkv", "proj"), 4, None, True, (32, 32, 32)),  # MHA from n_head * head_dim
        (("qkv", "proj"), 4, None, False, (32, 32, 32)),  # no attributes: equal thirds
        (("qkv", "o_proj"), 4, 2, True, (32, 16, 16)),  # GQA parts from n_head / n_kv_head / head_dim
        (("c_attn", "c_proj"), 4, None, True, (32, 32, 32)),
        (("c_attn", "c_proj"), 8, 2, True, (32, 8, 8)),
    ],
)
def test_plan_fused_qkv(names, n_head, n_kv_head, with_attrs, parts):
    attn = FusedAttention(32, n_head=n_head, n_kv_head=n_kv_head, names=names, with_attrs=with_attrs)
    plan = resolve_tp_plan(Holder(attn=attn), 2)
    assert plan.layers == {f"attn.{names[1]}": ROW_PAR, f"attn.{names[0]}": col(*parts)}
    expected_heads = ("n_head",) + (("n_kv_head",) if n_kv_head else ()) if with_attrs else None
    assert plan.head_attrs == ({"attn": expected_heads} if expected_heads else {})


def test_plan_fused_gqa_without_attributes_stays_replicated():
    # [q; k; v] = 32 + 16 + 16: without head attributes the parts cannot be known, so nothing is split.
    attn = FusedAttention(32, n_head=4, n_kv_head=2, with_attrs=False)
    plan = resolve_tp_plan(Holder(attn=attn), 2)
    assert plan.layers == {}
    assert plan.replicated == {"attn.qkv": "no column/row pair found", "attn.proj": "no column/row pair found"}


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
    expected = {f"mlp.{n}": (ROW_PAR if n == down else col(hidden)) for n in names}
    assert plan.layers == expected
    assert list(plan.layers)[0] == f"mlp.{down}"
    assert plan.head_attrs == {}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("names", [("fc1", "fc2"), ("c_fc", "c_proj")])
def test_plan_plain_mlp(names, bias):
    plan = resolve_tp_plan(Holder(mlp=PlainMLP(32, 128, bias=bias, names=names)), 4)
    assert plan.layers == {f"mlp.{names[1]}": ROW_PAR, f"mlp.{names[0]}": col(128)}


def test_plan_square_unknown_names_registration_order_decides():
    plan = resolve_tp_plan(Holder(pair=Holder(lin_a=nn.Linear(32, 32), lin_b=nn.Linear(32, 32))), 2)
    assert plan.layers == {"pair.lin_b": ROW_PAR, "pair.lin_a": col(32)}


def test_plan_tiny_lm():
    plan = resolve_tp_plan(TinyLM(), 2)
    assert plan.layers == {
        "blocks.0.attn.o_proj": ROW_PAR,
        "blocks.0.attn.q_proj": col(32),
        "blocks.0.attn.k_proj": col(16),
        "blocks.0.attn.v_proj": col(16),
        "blocks.0.mlp.down_proj": ROW_PAR,
        "blocks.0.mlp.gate_proj": col(64),
        "blocks.0.mlp.up_proj": col(64),
        "blocks.1.attn.c_proj": ROW_PAR,
        "blocks.1.attn.c_attn": col(32, 16, 16),
        "blocks.1.mlp.c_proj": ROW_PAR,
        "blocks.1.mlp.c_fc": col(64),
        "wte": LayerPlan("rowwise"),
        "lm_head": col(64, gather=True),
    }
    assert plan.replicated == {"wpe": "not the token embedding"}
    assert plan.head_attrs == {
        "blocks.0.attn": ("num_heads", "num_key_value_heads"),
        "blocks.1.attn": ("n_head", "n_kv_head"),
    }
    assert "lm_head=colwise (gathered)" in plan.summary() and "wpe (not the token embedding)" in plan.summary()


def test_plan_tied_lm_and_embedding_found_by_shape():
    plan = resolve_tp_plan(TinyLM(tie=True), 2)
    assert plan.layers["wte"] == LayerPlan("rowwise") and plan.layers["lm_head"] == col(64, gather=True)
    # An embedding whose name says nothing is still the token embedding when an LM head matches its shape.
    plan = resolve_tp_plan(Holder(emb=nn.Embedding(50, 16), out_head=nn.Linear(16, 50)), 2)
    assert plan.layers == {"emb": LayerPlan("rowwise"), "out_head": col(50, gather=True)}
    plan = resolve_tp_plan(Holder(emb=nn.Embedding(50, 16), lone=nn.Linear(16, 8)), 2)
    assert plan.layers == {} and plan.replicated == {"emb": "not the token embedding", "lone": "no column/row pair found"}


def test_plan_tiny_llama():
    plan = resolve_tp_plan(tiny_llama(), 2)
    expected = {}
    for i in range(2):
        p = f"model.layers.{i}"
        expected.update(
            {
                f"{p}.self_attn.o_proj": ROW_PAR,
                f"{p}.self_attn.q_proj": col(32),
                f"{p}.self_attn.k_proj": col(16),
                f"{p}.self_attn.v_proj": col(16),
                f"{p}.mlp.down_proj": ROW_PAR,
                f"{p}.mlp.gate_proj": col(64),
                f"{p}.mlp.up_proj": col(64),
            }
        )
    expected.update({"model.embed_tokens": LayerPlan("rowwise"), "lm_head": col(128, gather=True)})
    assert plan.layers == expected
    assert plan.replicated == {}
    # transformers' LlamaAttention keeps no head-count attributes (it views with -1 heads): nothing to divide.
    assert plan.head_attrs == {}


def test_plan_tiny_llama_kv_heads_not_divisible():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        resolve_tp_plan(tiny_llama(), 4)


def test_explicit_plan_on_llama_replicates_mlp():
    plan = resolve_tp_plan(tiny_llama(), 2, {"*.mlp.*": "replicate"})
    for i in range(2):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{i}.mlp.{leaf}" not in plan.layers
            assert plan.replicated[f"model.layers.{i}.mlp.{leaf}"] == "tp_plan '*.mlp.*'"
        assert plan.layers[f"model.layers.{i}.self_attn.o_proj"] == ROW_PAR
        assert plan.layers[f"model.layers.{i}.self_attn.k_proj"] == col(16)
    assert plan.layers["lm_head"] == col(128, gather=True)


def test_explicit_plan_overrides_and_first_match_wins():
    model = TinyLM()
    # down_proj is matched first by 'rowwise', so the later '*.mlp.*' -> 'replicate' leaves it alone; its
    # column partners are now replicated, so it takes the full input and slices it itself.
    plan = resolve_tp_plan(model, 2, {"blocks.0.mlp.down_proj": "rowwise", "blocks.0.mlp.*": "replicate"})
    assert plan.layers["blocks.0.mlp.down_proj"] == LayerPlan("rowwise", input_is_parallel=False)
    assert "blocks.0.mlp.gate_proj" not in plan.layers and "blocks.0.mlp.up_proj" not in plan.layers
    assert plan.replicated["blocks.0.mlp.gate_proj"] == "tp_plan 'blocks.0.mlp.*'"
    assert plan.layers["blocks.1.mlp.c_fc"] == col(64)  # untouched by the explicit plan

    # Replicating the output projection makes the column projections gather their outputs (and keeps the heads).
    plan = resolve_tp_plan(model, 2, {"blocks.0.attn.o_proj": "replicate"})
    assert plan.layers["blocks.0.attn.q_proj"] == col(32, gather=True)
    assert plan.layers["blocks.0.attn.k_proj"] == col(16, gather=True)
    assert "blocks.0.attn" not in plan.head_attrs and "blocks.1.attn" in plan.head_attrs

    # An explicit style on an auto-replicated module; first match wins over a later broader pattern.
    plan = resolve_tp_plan(model, 2, {"wpe": "rowwise", "w*": "replicate"})
    assert plan.layers["wpe"] == LayerPlan("rowwise") and "wte" not in plan.layers
    assert plan.replicated["wte"] == "tp_plan 'w*'" and "wpe" not in plan.replicated

    plan = resolve_tp_plan(Holder(lone=nn.Linear(32, 8)), 2, {"lone": "colwise"})
    assert plan.layers == {"lone": col(8, gather=True)} and plan.replicated == {}
    plan = resolve_tp_plan(Holder(lone=nn.Linear(32, 8)), 2, {"lone": "rowwise"})
    assert plan.layers == {"lone": LayerPlan("rowwise")}


def test_explicit_plan_errors():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"'columnwise'.*\['colwise', 'rowwise', 'replicate'\]"):
        resolve_tp_plan(model, 2, {"*.mlp.*": "columnwise"})
    with pytest.raises(ValueError, match=r"'\*\.nothing_here' matches no"):
        resolve_tp_plan(model, 2, {"*.mlp.*": "replicate", "*.nothing_here": "replicate"})
    with pytest.raises(ValueError, match="tp_plan='manual' is invalid"):
        resolve_tp_plan(model, 2, "manual")
    with pytest.raises(ValueError, match=r"embedding 'wte'.*'colwise'"):
        resolve_tp_plan(model, 2, {"wte": "colwise"})


def test_size_errors_name_the_module():
    with pytest.raises(ValueError, match=r"tp=4 does not divide out_features = 30 of module 'lone'"):
        resolve_tp_plan(Holder(lone=nn.Linear(32, 30)), 4, {"lone": "colwise"})
    with pytest.raises(ValueError, match=r"tp=4 does not divide in_features = 30 of module 'lone'"):
        resolve_tp_plan(Holder(lone=nn.Linear(30, 32)), 4, {"lone": "rowwise"})
    # A pair: the row layer is checked first, and names its in_features.
    with pytest.raises(ValueError, match=r"in_features = 30 of module 'mlp.fc2'"):
        resolve_tp_plan(Holder(mlp=PlainMLP(32, 30)), 4)
    with pytest.raises(ValueError, match=r"num_embeddings \(vocabulary\) = 30 of module 'tok_emb'"):
        resolve_tp_plan(Holder(tok_emb=nn.Embedding(30, 32)), 4)
    # Fused GQA parts [24; 12; 12]: tp=8 divides the model dim (24) but not the k/v parts.
    attn = FusedAttention(24, n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match=r"tp=8 does not divide fused part of size 12 = 12 of module 'attn.qkv'"):
        resolve_tp_plan(Holder(attn=attn), 8)


def test_head_count_errors_name_the_attention_module():
    # 2 heads of 16: every feature size divides by 4, the heads do not.
    with pytest.raises(ValueError, match=r"tp=4 does not divide blocks.attn.num_heads = 2.*\[1, 2\]"):
        resolve_tp_plan(Holder(blocks=Holder(attn=Attention(32, num_heads=2))), 4)
    # GQA 4 query heads / 2 kv heads of 8: tp=4 divides the features and the query heads, not the kv heads.
    with pytest.raises(ValueError, match=r"tp=4 does not divide attn.num_key_value_heads = 2"):
        resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, num_key_value_heads=2)), 4)
    with pytest.raises(ValueError, match=r"tp=4 does not divide attn.n_kv_head = 2"):
        resolve_tp_plan(Holder(attn=FusedAttention(32, n_head=4, n_kv_head=2)), 4)
    assert resolve_tp_plan(Holder(attn=Attention(32, num_heads=4, num_key_value_heads=2)), 2).layers


# --------------------------------------------------------------------------------------------------------------
# 2. Distributed checks: one spawn of 2 gloo ranks, every check in `_tp_worker`
# --------------------------------------------------------------------------------------------------------------


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a is None or b is None or a.shape != b.shape:
        return math.inf
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _check_column(res, key, group, in_f, out_f, parts, gather, bias):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1)
    ref = nn.Linear(in_f, out_f, bias=bias)
    tp = ColumnParallelLinear(ref, group, gather, parts)
    x, g = torch.randn(3, 5, in_f), torch.randn(3, 5, out_f)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * g).sum().backward()
    xt = x.clone().requires_grad_()
    yt = tp(xt)
    exp_y, g_t = (yr, g) if gather else (split_parts(yr, -1, parts, rank, world), split_parts(g, -1, parts, rank, world))
    (yt * g_t).sum().backward()
    err = res["err"]
    err[f"{key}/out"] = _err(yt, exp_y)
    err[f"{key}/dx"] = _err(xt.grad, xr.grad)
    err[f"{key}/dW"] = _err(gather_parts(tp.weight.grad, 0, parts, group), ref.weight.grad)
    err[f"{key}/W"] = _err(gather_parts(tp.weight.detach(), 0, parts, group), ref.weight)
    if bias:
        err[f"{key}/db"] = _err(gather_parts(tp.bias.grad, 0, parts, group), ref.bias.grad)
    res["ok"][f"{key}/local_shape"] = tuple(tp.weight.shape) == (out_f // world, in_f)


def _check_row(res, key, group, in_f, out_f, input_is_parallel, bias):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(2)
    ref = nn.Linear(in_f, out_f, bias=bias)
    tp = RowParallelLinear(ref, group, input_is_parallel)
    x, g = torch.randn(3, 5, in_f), torch.randn(3, 5, out_f)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * g).sum().backward()
    xt = (split_parts(x, -1, (in_f,), rank, world) if input_is_parallel else x.clone()).requires_grad_()
    yt = tp(xt)
    (yt * g).sum().backward()
    exp_dx = split_parts(xr.grad, -1, (in_f,), rank, world) if input_is_parallel else xr.grad
    err = res["err"]
    err[f"{key}/out"] = _err(yt, yr)
    err[f"{key}/dx"] = _err(xt.grad, exp_dx)
    err[f"{key}/dW"] = _err(gather_parts(tp.weight.grad, 1, (in_f,), group), ref.weight.grad)
    if bias:
        err[f"{key}/db"] = _err(tp.bias.grad, ref.bias.grad)
    res["ok"][f"{key}/local_shape"] = tuple(tp.weight.shape) == (out_f, in_f // world)


def _check_embedding(res, key, group, padding_idx):
    world = dist.get_world_size(group)
    vocab, dim = 16, 8
    torch.manual_seed(3)
    ref = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    tp = VocabParallelEmbedding(ref, group)
    ids = torch.randint(0, vocab, (4, 7))
    ids[0, :3] = torch.tensor([0, vocab // 2 - 1, vocab - 1])  # both halves and the edges of each
    ids[1, 0] = vocab // 2
    if padding_idx is not None:
        ids[2, :2] = padding_idx
    g = torch.randn(4, 7, dim)
    (ref(ids) * g).sum().backward()
    yt = tp(ids)
    (yt * g).sum().backward()
    err = res["err"]
    err[f"{key}/out"] = _err(yt, ref(ids))
    err[f"{key}/dW"] = _err(gather_parts(tp.weight.grad, 0, (vocab,), group), ref.weight.grad)
    res["ok"][f"{key}/both_halves"] = bool((ids < vocab // world).any() and (ids >= vocab // world).any())
    res["ok"][f"{key}/local_shape"] = tuple(tp.weight.shape) == (vocab // world, dim)


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = (spec, module.group)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and name in specs:
            spec, group = specs[name]
            grad = gather_parts(grad, spec.dim, spec.part_sizes, group)
        grads[name] = grad
    return grads


def _tp_grad_norm(model: nn.Module, group) -> float:
    """The global gradient norm the way a TP run computes it: shard squares summed over the group, once."""
    sharded = tp_sharded_parameter_names(model)
    shard_sq, rep_sq = torch.zeros(()), torch.zeros(())
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if name in sharded:
            shard_sq += param.grad.pow(2).sum()
        else:
            rep_sq += param.grad.pow(2).sum()
    dist.all_reduce(shard_sq, group=group)
    return (shard_sq + rep_sq).sqrt().item()


def _state_dict_err(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return math.inf
    return max((_err(a[k], b[k]) for k in a), default=0.0)


def _check_model(res, key, group, make_model, forward, vocab):
    """``forward(model, ids) -> (logits, loss)``. Compares the TP model with the unsplit one in every respect."""
    err, ok = res["err"], res["ok"]
    ref = make_model()
    tpm = copy.deepcopy(ref)
    plan = resolve_tp_plan(tpm, dist.get_world_size(group))
    apply_tp(tpm, group, plan)
    ok[f"{key}/all_planned_replaced"] = all(
        isinstance(tpm.get_submodule(n), (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) for n in plan.layers
    )

    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (2, 12))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # token ids in every rank's vocabulary slice
    logits_r, loss_r = forward(ref, ids)
    loss_r.backward()
    logits_t, loss_t = forward(tpm, ids)
    loss_t.backward()
    err[f"{key}/logits"] = _err(logits_t, logits_r)
    err[f"{key}/loss"] = _err(loss_t, loss_r)
    grads_r, grads_t = _full_grads(ref), _full_grads(tpm)
    ok[f"{key}/grad_names"] = set(grads_r) == set(grads_t) and all(g is not None for g in grads_t.values())
    err[f"{key}/grads"] = max(_err(grads_t.get(n), g) for n, g in grads_r.items())
    norm_r = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads_r.values()])).item()
    err[f"{key}/grad_norm_rel"] = abs(_tp_grad_norm(tpm, group) - norm_r) / norm_r

    # The full state dict of the TP model is the unsplit model's.
    err[f"{key}/gathered_state_dict"] = _state_dict_err(gather_full_state_dict(tpm), ref.state_dict())

    # apply_tp is idempotent: a second call changes nothing (no module replaced, no head count divided twice).
    heads_before = {n: {a: getattr(m, a) for a in attrs} for n, attrs in plan.head_attrs.items() for m in [tpm.get_submodule(n)]}
    apply_tp(tpm, group, plan)
    heads_after = {n: {a: getattr(m, a) for a in attrs} for n, attrs in plan.head_attrs.items() for m in [tpm.get_submodule(n)]}
    ok[f"{key}/idempotent"] = heads_before == heads_after

    # load_full_state_dict round trip: perturb the unsplit weights, load them, gather them back, same outputs.
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    load_full_state_dict(tpm, new_sd)
    err[f"{key}/roundtrip_state_dict"] = _state_dict_err(gather_full_state_dict(tpm), new_sd)
    with torch.no_grad():
        err[f"{key}/roundtrip_logits"] = _err(forward(tpm, ids)[0], forward(ref, ids)[0])

    missing = dict(new_sd)
    dropped = sorted(missing)[0]
    del missing[dropped]
    try:
        load_full_state_dict(tpm, missing)
        ok[f"{key}/strict_missing_raises"] = False
    except KeyError as e:
        ok[f"{key}/strict_missing_raises"] = dropped in str(e)
    sharded = sorted(tp_sharded_parameter_names(tpm) & set(new_sd))[0]
    bad = dict(new_sd)
    bad[sharded] = torch.zeros(*[s + 1 for s in new_sd[sharded].shape])
    try:
        load_full_state_dict(tpm, bad)
        ok[f"{key}/bad_shape_raises"] = False
    except ValueError as e:
        ok[f"{key}/bad_shape_raises"] = sharded in str(e)
    return tpm


def _lm_forward(model, ids):
    logits = model(ids)
    return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _llama_forward(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


def _tiny_lm(tie: bool = False) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(tie=tie)


def _tiny_lm_tied() -> TinyLM:
    return _tiny_lm(tie=True)


def _tp_worker() -> dict:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    sub_group = dist.new_group(list(range(dist.get_world_size())))
    res: dict = {"err": {}, "ok": {}}

    for gather in (True, False):
        for bias in (True, False):
            _check_column(res, f"col/gather={gather}/bias={bias}", group, 16, 24, (24,), gather, bias)
        # Fused GQA [q; k; v] with unequal parts: 4 heads of 4 and 2 kv heads of 4.
        _check_column(res, f"col_fused/gather={gather}", sub_group, 16, 32, (16, 8, 8), gather, True)
    for parallel in (True, False):
        for bias in (True, False):
            _check_row(res, f"row/parallel={parallel}/bias={bias}", group, 24, 16, parallel, bias)
    _check_embedding(res, "emb", group, None)
    _check_embedding(res, "emb/pad", sub_group, 11)

    tpm = _check_model(res, "tiny_lm", group, _tiny_lm, _lm_forward, 64)
    world = dist.get_world_size(group)
    res["ok"]["tiny_lm/heads_divided"] = (
        tpm.blocks[0].attn.num_heads == 4 // world
        and tpm.blocks[0].attn.num_key_value_heads == 2 // world
        and tpm.blocks[1].attn.n_head == 4 // world
        and tpm.blocks[1].attn.n_kv_head == 2 // world
    )
    res["ok"]["tiny_lm/types"] = (
        isinstance(tpm.wte, VocabParallelEmbedding)
        and isinstance(tpm.wpe, nn.Embedding)
        and isinstance(tpm.lm_head, ColumnParallelLinear)
        and tpm.lm_head.gather_output
        and isinstance(tpm.blocks[1].attn.c_attn, ColumnParallelLinear)
        and tpm.blocks[1].attn.c_attn.part_sizes == (32, 16, 16)
        and isinstance(tpm.blocks[1].mlp.c_proj, RowParallelLinear)
    )
    tied = _check_model(res, "tiny_lm_tied", group, _tiny_lm_tied, _lm_forward, 64)
    res["ok"]["tiny_lm_tied/still_tied"] = tied.lm_head.weight is tied.wte.weight

    llama = _check_model(res, "llama", group, tiny_llama, _llama_forward, 128)
    attn = llama.model.layers[0].self_attn
    res["ok"]["llama/types"] = (
        isinstance(attn.k_proj, ColumnParallelLinear)
        and tuple(attn.k_proj.weight.shape) == (16 // world, 32)
        and isinstance(llama.model.embed_tokens, VocabParallelEmbedding)
    )
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
        flags = {k: v for k, v in res["ok"].items() if k.startswith(prefix)}
        failed = [k for k, v in flags.items() if not v]
        assert not failed, f"rank {rank}: failed checks {failed}"
        checked += len(errs) + len(flags)
    assert checked, f"no checks recorded under {prefix!r}"


def test_column_parallel_linear(tp_results):
    _assert_close(tp_results, "col/")


def test_column_parallel_linear_fused_gqa_parts(tp_results):
    _assert_close(tp_results, "col_fused/")


def test_row_parallel_linear(tp_results):
    _assert_close(tp_results, "row/")


def test_vocab_parallel_embedding(tp_results):
    _assert_close(tp_results, "emb")


def test_apply_tp_tiny_lm(tp_results):
    _assert_close(tp_results, "tiny_lm/")


def test_apply_tp_tiny_lm_tied_embeddings(tp_results):
    _assert_close(tp_results, "tiny_lm_tied/")


def test_apply_tp_tiny_llama(tp_results):
    _assert_close(tp_results, "llama/")


def test_ranks_agree_on_replicated_results(tp_results):
    # Gathered/replicated quantities are the same on both ranks (same check keys, same verdicts).
    assert tp_results[0]["ok"].keys() == tp_results[1]["ok"].keys()
    assert tp_results[0]["err"].keys() == tp_results[1]["err"].keys()


def test_embedding_options_vocab_parallel_cannot_honour_stay_replicated():
    class WithMaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(16, 8, max_norm=1.0)
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    plan = resolve_tp_plan(WithMaxNorm(), 2)
    assert "tok_emb" not in plan.layers
    assert plan.replicated["tok_emb"] == "max_norm not supported by VocabParallelEmbedding"
    with pytest.raises(ValueError, match=r"Embedding 'tok_emb' uses max_norm.*'replicate'"):
        resolve_tp_plan(WithMaxNorm(), 2, {"tok_emb": "rowwise"})
