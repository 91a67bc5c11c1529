"""Tensor parallelism's plan and its candidate variants, pure (no process group): small modules in the common
layouts (separate and fused attention projections, MHA and GQA, gated and plain MLPs, token embedding + LM head,
GPT-2's Conv1D) plus tiny random-init ``transformers`` models; the styles, fused part sizes and the order of the
candidate variants, explicit plans and their errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid.core.collectives import split_shard
from lightning_hybrid.parallel.tensor_parallel import LayerPlan, ShardSpec, resolve_tp_plan
from lightning_hybrid.parallel.tensor_parallel.layers import linear_shape
from lightning_hybrid.parallel.tensor_parallel.model_plans import model_tp_plan
from tests.tensor_parallel.tp_models import (
    Attention,
    FusedAttention,
    FusedGatedMLP,
    GatedMLP,
    Holder,
    PlainMLP,
    TinyLM,
    tiny_gpt2,
    tiny_llama,
)

ROW_PAR = LayerPlan("rowwise", input_is_parallel=True)


def col(*parts: int, gather: bool = False) -> LayerPlan:
    return LayerPlan("colwise", gather_output=gather, part_sizes=tuple(parts))


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
