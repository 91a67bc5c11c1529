"""The planner on mixture of experts with expert parallelism: parameters and FLOPs of Mixtral by hand, experts
read from Hugging Face configs and the command line, expert memory per ``ep``, the all-to-all volume, the
search choosing ``ep``, and the pipelines planned for a model adding its router's loss."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from lightning_hybrid import HybridStrategy
from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, load_cluster, model_spec, plan
from lightning_hybrid.planner.__main__ import main as planner_main
from lightning_hybrid.planner.cluster import Link
from lightning_hybrid.planner.time import all_to_all_bytes, estimate_time


def test_mixtral_parameters_and_flops_by_hand():
    # Mixtral 8x7B (Jiang et al. 2024): 32 layers, h 4096, 32 heads / 8 kv heads of 128, 8 SwiGLU experts of
    # 14336, top-2, vocabulary 32000, untied head, RMSNorm: 46.7B parameters, 12.9B active per token.
    m = model_spec("mixtral-8x7b")
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    block = attention + 8 * expert + 8 * 4096 + 2 * 4096  # + router + two norms
    total = 32 * block + 2 * 32000 * 4096 + 4096  # + embedding, head, final norm
    assert m.params == total == 46_702_792_704
    assert m.active_params() == total - 32 * 6 * expert == 12_879_925_248
    assert m.params == pytest.approx(46.7e9, rel=1e-3) and m.active_params() == pytest.approx(12.9e9, rel=1e-2)
    # FLOPs: 6 per weight a token multiplies by (attention, 2 experts, the router; the head) + 12 L h s.
    assert m.flops_per_token() == 6 * (32 * (attention + 2 * expert + 8 * 4096) + 4096 * 32000) + 12 * 32 * 4096 * 4096
    # Shared experts and dense first layers (DeepSeek style): 2 MoE layers of 3, a shared MLP of 64.
    s = ModelSpec("s", n_layer=3, hidden=32, heads=4, kv_heads=4, ffn=128, vocab=64, seq_len=16, bias=False,
                  learned_positions=False, experts=4, top_k=1, expert_ffn=16, moe_layers=2, shared_ffn=64)
    attention, norms = 4 * 32 * 32, 2 * 32
    dense, moe = attention + 2 * 32 * 128 + norms, attention + 4 * 2 * 32 * 16 + 2 * 32 * 64 + 4 * 32 + norms
    assert s.pipeline_layer_params() == [64 * 32, dense, moe, moe, 64 * 32 + 32]
    assert [s.is_moe_block(i) for i in range(5)] == [False, False, True, True, False]  # embed, blocks, head
    assert s.flops_per_token() == 6 * (attention + 2 * 32 * 128 + 2 * (attention + 2 * 32 * 16 + 2 * 32 * 64
                                                                       + 4 * 32) + 32 * 64) + 12 * 3 * 32 * 16


def test_model_spec_reads_experts_from_hugging_face_configs_and_the_command_line():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig

    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    spec = ModelSpec.from_hf(config)
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.moe_layers, spec.shared_ffn) == (4, 2, 48, 2, 0)
    assert spec.params == sum(p.numel() for p in MixtralForCausalLM(config).parameters())
    qwen = ModelSpec.from_hf(Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                            moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                            mlp_only_layers=[0], max_position_embeddings=64))
    assert (qwen.experts, qwen.top_k, qwen.expert_ffn, qwen.moe_layers, qwen.ffn) == (8, 2, 16, 3, 64)
    cli = model_spec("n_layer=2,n_embd=32,n_head=4,mlp=swiglu,experts=4,top_k=2,expert_ffn=48,shared_ffn=32")
    assert (cli.experts, cli.top_k, cli.expert_ffn, cli.moe_layers, cli.shared_ffn, cli.gated_mlp) == (
        4, 2, 48, 2, 32, True)
    assert model_spec("llama2-7b,experts=8,top_k=2").params > 8 * model_spec("llama2-7b").params / 2
    with pytest.raises(ValueError, match="top_k"):
        model_spec("n_layer=2,n_embd=32,n_head=4,experts=4")
    with pytest.raises(ValueError, match="set experts > 0"):
        model_spec("n_layer=2,n_embd=32,n_head=4,top_k=2")


def test_expert_memory_per_rank_halves_from_ep1_to_ep2():
    m = model_spec("mixtral-8x7b")
    experts = 32 * 8 * 3 * 4096 * 14336
    rest = m.params - experts
    for zero in (0, 1, 2):
        one, two = (estimate_memory(m, Layout(8, 1, 1, zero, 1, 1, ep=ep), "bf16-mixed") for ep in (1, 2))
        # fp32 weights: the experts' 4 bytes per parameter halve, the rest is the same.
        assert one.params == 4 * (rest + experts) and two.params == 4 * (rest + experts / 2)
        assert one.activations == two.activations  # a rank computes k pairs per token it routes, whatever ep
    # ZeRO-1: Adam's 8 bytes of the experts over their dp/ep = 4 ranks (ep 2), of the rest over dp = 8.
    zero1 = estimate_memory(m, Layout(8, 1, 1, 1, 1, 1, ep=2), "bf16-mixed")
    assert zero1.optimizer == pytest.approx(8 * (rest / 8 + experts / 2 / 4))
    # Experts stay whole across TP: tp2 does not split them.
    whole = 32 * (2 * 4096 + 8 * 4096) + 4096  # norms and routers, the final norm: whole across TP
    assert estimate_memory(m, Layout(4, 2, 1, 0, 1, 1, ep=2), "bf16-mixed").params == pytest.approx(
        4 * ((rest - whole) / 2 + whole + experts / 2))
    with pytest.raises(ValueError, match="no experts"):
        estimate_memory(model_spec("small"), Layout(2, 1, 1, 0, 1, 1, ep=2), "32-true")
    with pytest.raises(ValueError, match="does not divide the 8 experts"):
        estimate_memory(m, Layout(6, 1, 1, 0, 1, 1, ep=3), "bf16-mixed")
    with pytest.raises(ValueError, match="divisor of dp"):
        Layout(6, 1, 1, 0, 1, 1, ep=4)


def test_all_to_all_bytes_by_hand():
    # 2 MoE layers, h 32, top-2; a replica of 2 x 3 sequences of 16 tokens = 96 tokens; fp32; ep 2: half the
    # pairs leave. 4 exchanges (dispatch, combine, and their reverses) x 2 layers x 96 x 2 x 32 x 4 B x 1/2.
    m = model_spec("n_layer=2,n_embd=32,n_head=4,block_size=16,experts=4,top_k=2")
    lay = Layout(4, 1, 1, 0, 2, 3, ep=2)
    assert all_to_all_bytes(m, lay, precision="32-true") == 4 * 2 * 96 * 2 * 32 * 4 / 2 == 98304
    assert all_to_all_bytes(m, lay, 1000, bytes_per_element=2) == 4 * 2 * 1000 * 2 * 32 * 2 / 2
    assert all_to_all_bytes(m, Layout(4, 1, 1, 0, 2, 3, ep=4), precision="32-true") == 98304 * 2 * 3 / 4
    assert all_to_all_bytes(m, Layout(4, 1, 1, 0, 2, 3, ep=1)) == 0
    sp = Layout(4, 2, 1, 0, 2, 3, sequence_parallel=True, ep=2)  # each TP rank routes half of the sequence
    assert all_to_all_bytes(m, sp, precision="32-true") == 98304 / 2
    assert all_to_all_bytes(m, Layout(4, 2, 1, 0, 2, 3, ep=2), precision="32-true") == 98304  # without SP: all
    checkpointed = Layout(4, 1, 1, 0, 2, 3, activation_checkpointing=True, ep=2)  # the forward exchanges again
    assert all_to_all_bytes(m, checkpointed, precision="32-true") == 98304 * 6 / 4
    pipeline = Layout(2, 1, 2, 0, 2, 3, ep=2)  # one MoE layer per pipeline rank
    assert all_to_all_bytes(m, pipeline, precision="32-true") == 98304 / 2
    # Time: the bytes at the EP link's bandwidth (the ranks of an EP group on one node: intra), not overlapped.
    cluster = dataclasses.replace(load_cluster("a100"), precision="32-true", intra=Link(1e9, 0.0))
    t = estimate_time(m, lay, cluster)
    sizes = 3 * 2 * 8  # micro-batches x layers x the split sizes' 8 (ep - 1) bytes
    assert t.ep_comm == pytest.approx((98304 + sizes) / 1e9) and t.total > t.compute + t.ep_comm
    assert estimate_time(m, Layout(4, 1, 1, 0, 2, 3), cluster).ep_comm == 0


def test_the_search_enumerates_ep_and_picks_it_when_memory_needs_it():
    small = model_spec("small-moe")
    result = plan(small, load_cluster("cpu"), devices=4, global_batch=8)
    layouts = [c.layout for c in result.ranked + result.too_big]
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    for lay in layouts:
        assert lay.dp % lay.ep == 0 and small.experts % lay.ep == 0
    for lay in {lay for lay in layouts if lay.ep > 1 and lay.pp == 1 and lay.micro_batch == 1}:
        assert HybridStrategy(**lay.strategy_kwargs()).parallel_dims.ep == lay.ep  # the strategy's own checks pass
    assert all(c.layout.ep == 1 for c in plan(model_spec("small"), load_cluster("cpu"), 4, 8).ranked)
    # Mixtral 8x7B at 32k tokens on 16 A100s: no layout without EP fits (every rank would hold every expert of
    # its layers: 16 bytes per parameter) but ZeRO-3 reduce-scattering every micro-batch (all of it sharded over the
    # 16 ranks); with EP more do, and the best is one of them.
    result = plan(model_spec("mixtral-8x7b", seq_len=32768), load_cluster("a100"), devices=16, global_batch=16)
    assert result.ranked and all(c.layout.ep > 1 or (c.layout.zero_stage == 3 and c.layout.grad_reduce == "micro_batch")
                                 for c in result.ranked)
    assert any(c.layout.ep == 1 for c in result.too_big)
    assert result.best.layout.strategy_kwargs()["ep"] == result.best.layout.ep > 1


def test_command_line_takes_experts_and_prints_ep(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert planner_main(["--model", "n_layer=2,n_embd=64,n_head=4,block_size=64,experts=8,top_k=2", "--cluster",
                         "a100", "--devices", "8", "--global-batch", "8", "--top", "400", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "MoE: 2 layers of 8 experts top-2" in out.splitlines()[0]
    assert " ep2 " in out and re.search(r" ep \d", out)  # ep in the layouts, and their all-to-all time
    data = json.loads(out_json.read_text())
    assert {c["ep"] for c in data["ranked"]} == {1, 2, 4, 8} and data["model"]["experts"] == 8
    assert all(c["time_s"]["ep_comm"] > 0 for c in data["ranked"] if c["ep"] > 1)


def test_a_model_adding_its_routers_loss_is_planned_with_gpipe_pipelines_only():
    """A pipeline computes the load-balancing loss of the whole batch under GPipe only, without sequence parallelism
    (docs/moe.md): parallel=auto searches those layouts for such a model."""
    from omegaconf import OmegaConf

    from lightning_hybrid.planner.auto import _adds_router_loss
    from lightning_hybrid.planner.search import enumerate_layouts

    cfg = OmegaConf.create({"model": {"_target_": "lightning_hybrid.hf.CausalLM", "model": "mixtral",
                                      "config": {"output_router_logits": True, "num_hidden_layers": 2}}})
    assert _adds_router_loss(cfg)
    cfg.model.config.output_router_logits = False
    assert not _adds_router_loss(cfg)
    small = model_spec("small-moe")
    layouts = list(enumerate_layouts(small, load_cluster("cpu"), 4, 8, whole_batch_loss=True))
    piped = [lay for lay in layouts if lay.pp > 1]
    assert piped and all(lay.schedule == "gpipe" and not lay.sequence_parallel for lay in piped)
    assert any(lay.pp == 1 and lay.sequence_parallel for lay in layouts)
    assert all(lay.pp == 1 for lay in enumerate_layouts(small, load_cluster("cpu"), 4, 8, pipeline=False))
    assert {lay.schedule for lay in enumerate_layouts(small, load_cluster("cpu"), 4, 8) if lay.pp > 1} > {"gpipe"}
