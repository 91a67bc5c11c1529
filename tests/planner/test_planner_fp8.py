"""The planner on FP8 training (`lightning_hybrid.planner.float8`): torchao's microbenchmarks reproduced, the GEMMs
faster and the casts paid, this codebase's amax all-reduces counted per linear (none for a runtime that does not
reduce them), float8 all-gather under ZeRO-3, the search and the command line, and the errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_hybrid.planner import Layout, ModelSpec, load_cluster, plan
from lightning_hybrid.planner.__main__ import main as planner_main
from lightning_hybrid.planner.cluster import Link
from lightning_hybrid.planner.float8 import (
    FP8_RECIPES,
    MICROBENCHMARKS,
    fp8_amax_time,
    fp8_block_linears,
    fp8_linear_speedup,
)
from lightning_hybrid.planner.time import estimate_time

LLAMA3_8B = ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True, bias=False,
                      learned_positions=False)
H100 = load_cluster("h100")


def test_the_fitted_microbenchmarks_are_reproduced():
    for (m, k, n), published in MICROBENCHMARKS.items():
        assert fp8_linear_speedup(m, k, n, H100) == pytest.approx(published, rel=0.02)
    # Larger GEMMs gain more; the speed-up stays below the peaks' ratio of 2.
    assert 1.39 < fp8_linear_speedup(16384, 16384, 16384, H100) < 2.0


def test_block_linears_cover_the_block_weights():
    for tp in (1, 2, 8):
        linears = fp8_block_linears(LLAMA3_8B, tp)
        assert sum(c * k * n for c, k, n in linears) == pytest.approx(LLAMA3_8B.block_matmul_weights() / tp)
        assert sum(c for c, _, _ in linears) == 7  # q, k, v, o, gate, up, down


def test_fp8_is_faster_and_this_codebase_pays_its_amax_all_reduces():
    layout = Layout(8, 1, 1, 3, 1, 1, recompute="pointwise")
    bf16 = estimate_time(LLAMA3_8B, layout, H100)
    speedups = {}
    for recipe in FP8_RECIPES:
        t = estimate_time(LLAMA3_8B, layout, H100, fp8=recipe)
        speedups[recipe] = bf16.total / t.total
        assert t.compute < bf16.compute
        assert t.as_dict()["fp8_comm"] == t.fp8_comm
    assert speedups["tensorwise"] > speedups["rowwise"] > 1.0
    # This codebase's per-linear amax all-reduces: tensorwise two per linear and micro-batch over the 8 ranks of
    # the stage (plus the head's), each 2 log2(8) hops of NVLink; none where the runtime does not reduce them.
    t = estimate_time(LLAMA3_8B, layout, H100, fp8="tensorwise")
    hop = H100.intra.latency
    one = 2 * math.ceil(math.log2(8)) * hop
    assert t.fp8_comm == pytest.approx((32 * 7 + 1) * 2 * one)
    assert fp8_amax_time("tensorwise", H100, 8, 1, H100.intra, H100.intra) == pytest.approx(2 * one)
    assert fp8_amax_time("rowwise_with_gw_hp", H100, 8, 1, H100.intra, H100.intra) == 0.0  # no TP: nothing split
    local = dataclasses.replace(H100, fp8_amax_reduced=False)
    assert estimate_time(LLAMA3_8B, layout, local, fp8="tensorwise").fp8_comm == 0.0
    assert fp8_amax_time("rowwise", H100, 16, 2, Link(1e9, 1e-5), Link(1e9, 1e-6)) == pytest.approx(
        2 * 4 * 1e-5 + 2 * 1 * 1e-6)


def test_float8_all_gather_shrinks_zero3_gathers_only():
    layout = Layout(64, 1, 1, 3, 1, 1, recompute="pointwise")
    plain = estimate_time(LLAMA3_8B, layout, H100, fp8="tensorwise")
    gathered = estimate_time(LLAMA3_8B, layout, dataclasses.replace(H100, fp8_all_gather=True), fp8="tensorwise")
    assert gathered.dp_comm < plain.dp_comm and gathered.compute == plain.compute
    # This codebase reduces the gathered weights' amaxes once per FSDP unit (a block) and forward.
    one = fp8_amax_time("tensorwise", H100, 64, 1, H100.link(64, 1), H100.intra) / 2
    assert gathered.fp8_comm - plain.fp8_comm == pytest.approx(LLAMA3_8B.n_layer * one * layout.micro_batches)
    zero1 = Layout(64, 1, 1, 1, 1, 1, recompute="pointwise")
    assert (estimate_time(LLAMA3_8B, zero1, dataclasses.replace(H100, fp8_all_gather=True), fp8="tensorwise").dp_comm
            == estimate_time(LLAMA3_8B, zero1, H100, fp8="tensorwise").dp_comm)


def test_the_head_is_converted_where_the_runtime_converts_it():
    layout = Layout(8, 1, 1, 3, 1, 1)
    head_bf16 = dataclasses.replace(H100, fp8_head=False)
    assert (estimate_time(LLAMA3_8B, layout, H100, fp8="tensorwise").compute
            < estimate_time(LLAMA3_8B, layout, head_bf16, fp8="tensorwise").compute)


def test_bad_fp8_requests_are_refused_by_name():
    layout = Layout(8, 1, 1, 3, 1, 1)
    with pytest.raises(ValueError, match="'e4m3'.*tensorwise"):
        estimate_time(LLAMA3_8B, layout, H100, fp8="e4m3")
    with pytest.raises(ValueError, match="no float8 tensor cores"):
        estimate_time(LLAMA3_8B, layout, load_cluster("a100"), fp8="tensorwise")
    moe = dataclasses.replace(LLAMA3_8B, name="moe", experts=8, top_k=2, expert_ffn=4096, params=0)
    with pytest.raises(ValueError, match="experts"):
        plan(moe, H100, 8, 8, fp8="rowwise")


def test_search_and_command_line(capsys):
    small = dataclasses.replace(LLAMA3_8B, seq_len=4096)
    bf16, fp8 = plan(small, H100, 16, 32), plan(small, H100, 16, 32, fp8="tensorwise")
    assert fp8.best.tokens_per_s > bf16.best.tokens_per_s
    args = ["--model", "llama2-7b", "--cluster", "h100", "--devices", "8", "--global-batch", "16", "--top", "2"]
    assert planner_main([*args, "--fp8", "tensorwise"]) == 0
    assert " fp8 " in capsys.readouterr().out  # the amax all-reduces' time in the breakdown
    assert planner_main([*args[:3], "a100", *args[4:], "--fp8", "rowwise"]) == 2
    assert "no float8 tensor cores" in capsys.readouterr().err
    assert planner_main([*args, "--fp8", "tensorwise", "--fp8-all-gather"]) == 0
    assert planner_main([*args, "--fp8", "rowwise", "--fp8-all-gather"]) == 2
    assert "--fp8-all-gather casts each weight shard with the whole weight's one scale" in capsys.readouterr().err


def test_parallel_auto_plans_the_recipes_fp8_where_the_cluster_has_float8():
    from omegaconf import OmegaConf

    from lightning_hybrid.planner.auto import _fp8, choose_layout, predicted_metrics
    from lightning_hybrid.planner.model import ModelSpec as Spec

    model = {"_target_": "lightning_hybrid.models.GPTLightningModule", "n_layer": 16, "n_embd": 2048, "n_head": 16,
             "mlp": "swiglu", "vocab_size": 32000, "bias": False}
    cfg = OmegaConf.create({
        "model": model, "data": {"batch_size": 16, "block_size": 4096},
        "parallel": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "fp8": "tensorwise", "micro_batches": None,
                     "schedule": None, "virtual_stages": None, "activation_checkpointing": False,
                     "bucket_cap_mb": 25},
        "trainer": {"devices": 8, "num_nodes": 1, "accumulate_grad_batches": 1, "accelerator": "gpu"},
        "planner": {"cluster": "h100", "global_batch": None, "show": 3}})
    spec = Spec.from_gpt({k: v for k, v in model.items() if k != "_target_"}, 4096, name="gpt")
    assert _fp8(cfg, H100, spec) == "tensorwise"
    assert _fp8(cfg, load_cluster("a100"), spec) is None  # no float8 tensor cores: planned as bf16
    out, _ = choose_layout(cfg)
    fp8_best = plan(spec, H100, 8, 16, fp8="tensorwise").best.layout
    assert out.parallel.dp == fp8_best.dp and out.parallel.tp == fp8_best.tp
    world = {"dp": 8, "tp": 1, "pp": 1}
    with_fp8 = predicted_metrics(cfg, world)["predicted_step_s"]
    cfg.parallel.fp8 = None
    assert predicted_metrics(cfg, world)["predicted_step_s"] > with_fp8
