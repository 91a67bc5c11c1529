"""What the planner can now describe of other runs: sliding-window attention (its keys counted from the mask itself,
read from transformers' configs, costed where the kernel skips what the window masks) and gradient accumulation
around a pipeline schedule (a bubble per run, one reduction)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, load_cluster, model_spec
from lightning_hybrid.planner.__main__ import parse_layout
from lightning_hybrid.planner.model import hf_config
from lightning_hybrid.planner.time import estimate_time


def _keys(s: int, window: int) -> int:
    """Pairs (query, key) a causal mask with a sliding window allows, counted from the mask itself (transformers'
    convention: key within ``window`` positions up to the query)."""
    q, k = torch.arange(s, device="cpu")[:, None], torch.arange(s, device="cpu")[None, :]
    return int(((k <= q) & (q - k < window)).sum())


@pytest.mark.parametrize("window", [1, 5, 31, 32, 64])
def test_attention_span_is_the_masks_share_of_causal_keys(window):
    s, layers = 32, 6
    for windowed in (1, 3, 6):
        m = ModelSpec("w", layers, 64, 4, 4, 256, 100, s, window=window, window_layers=windowed)
        expected = (windowed * _keys(s, window) + (layers - windowed) * _keys(s, s)) / (layers * _keys(s, s))
        assert m.attention_span() == pytest.approx(expected)
    assert ModelSpec("w", layers, 64, 4, 4, 256, 100, s, window=window).window_layers == layers  # 0: every layer
    with pytest.raises(ValueError, match="window_layers=7"):
        ModelSpec("w", layers, 64, 4, 4, 256, 100, s, window=window, window_layers=7)
    with pytest.raises(ValueError, match="window_layers=2"):
        ModelSpec("w", layers, 64, 4, 4, 256, 100, s, window_layers=2)


def test_windows_read_from_transformers_configs():
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=6, vocab_size=128, max_position_embeddings=256)
    mistral = ModelSpec.from_hf(hf_config("mistral", dict(base, sliding_window=32)))
    assert (mistral.window, mistral.window_layers) == (32, 6)
    gemma = ModelSpec.from_hf(hf_config("gemma2", dict(base, sliding_window=16, head_dim=16)))
    assert gemma.window == 16 and gemma.window_layers == 3  # alternating sliding and full layers
    assert ModelSpec.from_hf(hf_config("qwen2", dict(base, sliding_window=16))).window == 0  # use_sliding_window off
    qwen = ModelSpec.from_hf(hf_config("qwen2", dict(base, sliding_window=16, use_sliding_window=True,
                                                     max_window_layers=2)))
    assert (qwen.window, qwen.window_layers) == (16, 4)  # layers from max_window_layers on use the window
    oss = hf_config("gpt_oss", dict(base, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16))
    spec = ModelSpec.from_hf(oss)
    assert (spec.window, spec.window_layers) == (8, 3)
    assert ModelSpec.from_hf(hf_config("llama", base)).attention_span() == 1.0


def test_windowed_attention_costs_its_keys_where_the_kernel_skips_the_rest():
    full = ModelSpec("m", 8, 1024, 16, 4, 4096, 32000, 4096, gated_mlp=True, bias=False, learned_positions=False)
    windowed = dataclasses.replace(full, window=512, window_layers=0, params=0)
    span = windowed.attention_span()
    assert 0.2 < span < 0.25
    lay = Layout(8, 1, 1, 1, 1, 2)
    h100 = dataclasses.replace(load_cluster("h100"), precision="megatron-flash")
    skips = dataclasses.replace(h100, window_kernels=True)
    # The attention core's time is its FLOPs at attention_speed of the GEMMs' rate: a window of span f costs what the
    # whole causal attention costs at speed 1/f -- nothing else in the block changes.
    assert estimate_time(windowed, lay, skips).compute == pytest.approx(
        estimate_time(full, lay, dataclasses.replace(h100, attention_speed=1 / span)).compute)
    assert estimate_time(windowed, lay, h100).compute == estimate_time(full, lay, h100).compute  # a masked SDPA
    assert estimate_time(windowed, lay, skips).compute < estimate_time(full, lay, skips).compute
    attention = 12 * full.n_layer * full.hidden * full.seq_len
    assert full.flops_per_token() - windowed.flops_per_token() == round(attention * (1 - span)) or (
        abs(full.flops_per_token() - windowed.flops_per_token() - attention * (1 - span)) <= 1)
    assert estimate_memory(windowed, lay, "megatron-flash").total == estimate_memory(full, lay, "megatron-flash").total


def test_accumulation_around_a_pipeline_runs_the_schedule_again():
    m = model_spec("gpt3-175b")
    cluster = dataclasses.replace(load_cluster("a100"), precision="megatron")
    once = Layout(8, 8, 8, 1, 1, 16, activation_checkpointing=True)
    twice = dataclasses.replace(once, micro_batches=8, accumulate=2)
    assert twice.sequences == once.sequences and twice.accumulation == 2 and once.accumulation == 1
    assert twice.label() == "dp8xtp8xpp8 zero1 mb1x8 1f1b acc2 ac"
    a, b = estimate_time(m, once, cluster), estimate_time(m, twice, cluster)
    assert b.compute == pytest.approx(a.compute)  # the same micro-batches
    assert b.bubble == pytest.approx(2 * a.bubble)  # a bubble per run: (pp - 1) micro-batch times each
    assert b.dp_comm == pytest.approx(a.dp_comm)  # reduced once, after the last run
    assert b.total > a.total
    assert estimate_memory(m, twice, "megatron").total == estimate_memory(m, once, "megatron").total  # 1F1B holds pp
    assert parse_layout("dp8xtp8xpp8 zero1 mb1x8 acc2 ac", m, 512, 128) == twice
    with pytest.raises(ValueError, match="acc2 runs a pipeline's schedule"):
        parse_layout("dp64xtp8 mb1x1 acc2", m, 512, 128)
    with pytest.raises(ValueError, match="accumulate=2 is invalid for pp=1"):
        Layout(8, 8, 1, 1, 1, 16, accumulate=2)


def test_a_recipe_accumulating_around_its_pipeline_is_read_as_such():
    from omegaconf import OmegaConf

    from lightning_hybrid.planner.auto import _recipe_layout

    cfg = OmegaConf.create({
        "data": {"batch_size": 8}, "trainer": {"accumulate_grad_batches": 3},
        "parallel": {"zero_stage": 1, "micro_batches": 4, "schedule": "1f1b", "virtual_stages": None,
                     "activation_checkpointing": False}})
    layout, global_batch = _recipe_layout(cfg, {"dp": 2, "tp": 1, "pp": 2})
    assert (layout.micro_batch, layout.micro_batches, layout.accumulate) == (2, 4, 3)
    assert global_batch == layout.sequences == 48


def test_per_op_recompute_keeps_every_other_matmul_and_the_attention_as_torchtitans_policy():
    from lightning_hybrid.planner.activations import op_coefficients, op_recomputed_weights

    m = ModelSpec("llama", 4, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True, bias=False, learned_positions=False)
    h, q, kv, F = 4096, 4096, 1024, 14336
    # Call order wq wk wv wo w1 w3 w2: the 1st, 3rd, 5th and 7th kept (wq, wv, w1, w2), the others recomputed.
    c = op_coefficients(m, "megatron-flash")
    assert c.rep * h == pytest.approx(2 * h + 2 * h)  # the block's input, w2's output
    assert c.split * h == pytest.approx(2 * q + 2 * kv + 2 * F + 2 * q + 4 * 32)  # wq, wv, w1; attention out + lse
    assert op_recomputed_weights(m) == (h * kv + q * h + h * F, 0.0)  # wk, wo, w3
    lay, none = Layout(8, 1, 1, 3, 1, 1, recompute="op"), Layout(8, 1, 1, 3, 1, 1)
    assert lay.label() == "dp8xtp1 zero3 mb1x1 op" and parse_layout("dp8 zero3 mb1x1 op", m, 8, 8) == lay
    with pytest.raises(ValueError, match="per-op selective recompute"):
        lay.strategy_kwargs()
    kept = estimate_memory(m, lay, "megatron-flash").activations
    assert kept < estimate_memory(m, none, "megatron-flash").activations
    # Without element-wise cost the difference in compute is the recomputed GEMMs alone.
    cluster = dataclasses.replace(load_cluster("h100"), precision="megatron-flash", memory_bandwidth=float("inf"))
    extra = (estimate_time(m, lay, cluster).compute - estimate_time(m, none, cluster).compute) / m.n_layer
    from lightning_hybrid.planner.gemm import matmul_time_factor

    gemm = 2 * m.seq_len * sum(op_recomputed_weights(m)) * matmul_time_factor(m, 1, cluster.matmul_k0)
    assert extra == pytest.approx(gemm / cluster.achievable_flops("megatron-flash"))


def test_transformer_engines_fused_casts_and_neMos_published_fp8_runs():
    import sys
    from pathlib import Path

    from lightning_hybrid.planner.float8 import FUSED_CAST_BYTES, fp8_traffic

    linears = [(1, 4096, 4096)]
    # Fused: the input's and weight's casts cost nothing of their own, the output gradient 4 bytes an element.
    assert fp8_traffic("tensorwise", linears, 1000, True, fused=True) == FUSED_CAST_BYTES[2] * 1000 * 4096
    m = ModelSpec("llama", 4, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True, bias=False, learned_positions=False)
    lay = Layout(8, 1, 1, 1, 1, 4)
    h100 = load_cluster("h100")
    te = dataclasses.replace(h100, fp8_fused_casts=True)
    assert estimate_time(m, lay, te, fp8="tensorwise").total < estimate_time(m, lay, h100, fp8="tensorwise").total
    assert estimate_time(m, lay, te).total == estimate_time(m, lay, h100).total  # bf16 unchanged
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.bench_planner import nemo_fp8_rows

    _, errors = nemo_fp8_rows()  # benchmarks/PLANNER.md: 13 runs, nothing fitted
    assert sum(abs(e) for e in errors) / len(errors) <= 0.10 and max(abs(e) for e in errors) <= 0.20
