"""The planner on any Hugging Face model (`ModelSpec.from_hf`, ``--hf-config``, ``parallel=auto`` in the finetune
recipe): the parameter count derived from a config equals the model's own, built on the meta device, for tiny
configs of the families that matter. Cheap: configs and meta-device models only, no process, no download."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from lightning_hybrid.planner import ModelSpec, load_cluster
from lightning_hybrid.planner.__main__ import main as planner_main
from lightning_hybrid.planner.__main__ import parse_layout, parse_overrides
from lightning_hybrid.planner.model import hf_config, hf_notes, hf_parameter_count

ROOT = Path(__file__).resolve().parents[2]

# Sizes chosen so that nothing coincides: 4 heads of 16 (2 key/value heads), MLP 96, vocabulary 100, 3 layers.
_BASE = dict(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128)
_MOE = dict(num_experts_per_tok=2)
_MLA = dict(_BASE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_group=2, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12, **_MOE)
FAMILIES = {
    "llama": _BASE,  # GQA
    "qwen2": _BASE,  # q/k/v biases
    "qwen2-tied": dict(_BASE, tie_word_embeddings=True),
    "mistral": dict(_BASE, sliding_window=32),
    "gemma": dict(_BASE, head_dim=24),  # tied, heads of 24 (4 x 24 != 64), GeGLU
    "phi3": dict(_BASE, pad_token_id=0),  # fused qkv and gate_up
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, vocab_size=100, n_positions=128),  # tied, learned positions
    "gpt_neox": {k: v for k, v in _BASE.items() if k != "num_key_value_heads"},  # biases, plain MLP
    "mixtral": dict(_BASE, num_local_experts=4, **_MOE),
    "qwen2_moe": dict(_BASE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[0], **_MOE),  # a shared expert and its gate, a dense first layer
    "qwen3_moe": dict(_BASE, num_experts=4, moe_intermediate_size=32, **_MOE),  # q/k norms
    "olmoe": dict(_BASE, num_experts=4, **_MOE),  # q/k norms over all heads
    "deepseek_v3": dict(_MLA, q_lora_rank=24, n_shared_experts=1),  # MLA, a dense first layer, a shared expert
    "deepseek_v3-no-q-lora": dict(_MLA, q_lora_rank=None, n_shared_experts=2),
    "qwen3": dict(_BASE, head_dim=24),
    # every other layer MoE (its moe_layers list), one shared expert of the expert width, dense MLP of its own width
    "llama4_text": dict(_BASE, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                        num_experts_per_tok=1, interleave_moe_layer_step=2),
    # MoE from layer 1 to 2, two shared experts
    "ernie4_5_moe": dict(_BASE, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
                         moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1),
}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.disable(logging.WARNING)  # tiny vocabularies below the configs' default token ids
    yield
    logging.disable(logging.NOTSET)


def _real_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_count_from_the_config_is_the_models(family):
    config = hf_config(family.split("-")[0], FAMILIES[family])
    spec = ModelSpec.from_hf(config, seq_len=64)
    assert spec.params == sum(spec.pipeline_layer_params()) == _real_count(config) == hf_parameter_count(config)


def test_what_the_config_describes():
    gemma = ModelSpec.from_hf(hf_config("gemma", FAMILIES["gemma"]))
    assert (gemma.head_dim, gemma.tied_embeddings, gemma.gated_mlp, gemma.bias) == (24, True, True, False)
    gpt2 = ModelSpec.from_hf(hf_config("gpt2", FAMILIES["gpt2"]), seq_len=64)
    assert gpt2.learned_positions and gpt2.positions == 128 and not gpt2.gated_mlp and gpt2.bias
    ds = ModelSpec.from_hf(hf_config("deepseek_v3", FAMILIES["deepseek_v3"]))
    assert (ds.experts, ds.top_k, ds.expert_ffn, ds.moe_layers, ds.shared_ffn, ds.head_dim) == (4, 2, 32, 2, 32, 12)
    qwen = ModelSpec.from_hf(hf_config("qwen2_moe", FAMILIES["qwen2_moe"]))
    assert (qwen.moe_layers, qwen.shared_ffn, qwen.shared_expert_gate, qwen.qkv_bias) == (2, 48, True, True)
    # MoE: the active parameters count top_k of the experts.
    mixtral = ModelSpec.from_hf(hf_config("mixtral", FAMILIES["mixtral"]))
    assert mixtral.params - mixtral.active_params() == 3 * 2 * 3 * 64 * 96


def test_a_folder_config_json_is_read_with_fields_its_class_lacks(tmp_path):
    # Qwen3-MoE checkpoints carry head_dim (128 for hidden 2048 / 32 heads), which Qwen3MoeConfig does not declare.
    fields = dict(FAMILIES["qwen3_moe"], model_type="qwen3_moe", head_dim=24)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = hf_config(tmp_path)
    spec = ModelSpec.from_hf(config)
    assert spec.head_dim == 24 and spec.params == _real_count(config)
    assert hf_config(tmp_path / "config.json").head_dim == 24
    with pytest.raises(ValueError, match="not fields of LlamaConfig"):
        hf_config("llama", {"hiden_size": 64})


def test_notes_say_what_is_not_modelled():
    mistral = hf_config("mistral", FAMILIES["mistral"])
    assert any("sliding-window" in n for n in hf_notes(mistral, ModelSpec.from_hf(mistral, seq_len=64)))
    assert not hf_notes(mistral, ModelSpec.from_hf(mistral, seq_len=32))  # the window covers the sequence
    ds = hf_config("deepseek_v3", FAMILIES["deepseek_v3"])
    assert any("MLA" in n and "parameters exact" in n for n in hf_notes(ds, ModelSpec.from_hf(ds)))
    gpt2 = hf_config("gpt2", FAMILIES["gpt2"])
    assert any("cannot run" in n for n in hf_notes(gpt2, ModelSpec.from_hf(gpt2, seq_len=256)))


def test_overrides_and_layouts_from_the_command_line():
    assert parse_overrides(["hidden_size=64,num_hidden_layers=2", "mlp_only_layers=[0,1]", "hidden_act=silu"]) == {
        "hidden_size": 64, "num_hidden_layers": 2, "mlp_only_layers": [0, 1], "hidden_act": "silu"}
    spec = ModelSpec.from_hf(hf_config("mixtral", FAMILIES["mixtral"]), seq_len=64)
    lay = parse_layout("dp4xtp2xpp2 ep2 zero1 mb2x2 1f1b ac sp", spec, 16, 16)
    assert (lay.dp, lay.tp, lay.pp, lay.ep, lay.zero_stage, lay.micro_batch, lay.micro_batches) == (4, 2, 2, 2, 1, 2, 2)
    assert lay.activation_checkpointing and lay.sequence_parallel and lay.schedule == "1f1b"
    lay = parse_layout("tp2", spec, 16, 64)  # dp from the devices, micro-batches of 1 from the global batch
    assert (lay.dp, lay.tp, lay.micro_batch, lay.micro_batches) == (8, 2, 1, 8)
    for bad, match in (("dp4xtp2", "not the 16 devices"), ("tp8", "must divide"), ("dp16 ep3", "ep=3"),
                       ("dp16 mb1x4", "not the global batch"), ("dp16 mb2", "does not split"),
                       ("dp16 turbo", "not a part")):
        with pytest.raises(ValueError, match=match):
            parse_layout(bad, spec, 16, 16)


def test_command_line_will_it_fit(capsys, tmp_path):
    args = ["--hf-config", "llama", "--override", "hidden_size=256,num_hidden_layers=4,intermediate_size=512",
            "--override", "num_attention_heads=8,num_key_value_heads=2,vocab_size=1000", "--cluster", "h100",
            "--devices", "8", "--global-batch", "16", "--seq-len", "512", "--top", "3"]
    assert planner_main([*args, "--layout", "dp4xtp2 zero1"]) == 0
    out = capsys.readouterr().out
    assert "the same as AutoModelForCausalLM.from_config's" in out and "rank layout" in out
    assert "layout dp4xtp2 zero1 mb1x4: peak" in out and "optimizer state" in out and "fits:" in out
    # A small cluster: the layout does not fit, by how much; exit code 1.
    cluster = load_cluster("h100")
    tiny = {**json.loads(cluster.to_json()), "memory": 2**24, "name": "tiny"}
    path = tmp_path / "tiny_cluster.json"
    path.write_text(json.dumps(tiny))
    assert planner_main([*args[:-6], "--cluster", str(path), "--devices", "1", "--global-batch", "1",
                         "--seq-len", "512", "--layout", "dp1"]) == 1
    assert "does not fit:" in capsys.readouterr().out
    assert planner_main([*args, "--layout", "dp3"]) == 2
    assert planner_main(["--hf-config", "nope-model", "--devices", "1", "--global-batch", "1"]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse formats the help with %: a bare % in it would crash it
        planner_main(["--help"])
    assert exit_.value.code == 0 and "--allow-mismatch" in capsys.readouterr().out


def test_command_line_refuses_what_it_cannot_describe(capsys):
    import dataclasses

    from lightning_hybrid.planner.__main__ import describe_hf

    base = ["--cluster", "h100", "--devices", "8", "--global-batch", "8", "--seq-len", "128", "--top", "1"]
    # Layers that are not softmax attention, named in the config's layer_types (Jamba's Mamba mixers).
    jamba = ["--hf-config", "jamba", "--override", "hidden_size=64,num_hidden_layers=4,num_attention_heads=4,"
             "num_key_value_heads=2,intermediate_size=96,vocab_size=100,num_experts=2,attn_layer_period=2,"
             "attn_layer_offset=1,expert_layer_period=2,expert_layer_offset=1,mamba_d_state=4"]
    assert planner_main([*jamba, *base]) == 2
    err = capsys.readouterr().err
    assert "jamba: 2 of its 4 layers are linear_attention" in err and "--allow-mismatch" in err
    assert planner_main([*jamba, *base, "--allow-mismatch"]) == 0
    assert "parts of jamba the planner does not describe" in capsys.readouterr().out  # and its count is off
    # A description whose count is more than 2% from the model's is refused; within it, said.
    config = hf_config("llama", _BASE)
    spec = ModelSpec.from_hf(config, 64)
    wrong = dataclasses.replace(spec, n_layer=spec.n_layer + 1, params=0)  # params: counted again
    with pytest.raises(ValueError, match=r"llama: the planner describes .* beyond 2%"):
        describe_hf(config, wrong)
    assert "parts of llama the planner does not describe" in describe_hf(config, wrong, allow_mismatch=True)
    assert "the same as AutoModelForCausalLM.from_config's" in describe_hf(config, spec)
    # A config transformers cannot build: described, said to be unchecked, not a crash.
    broken = hf_config("llama", dict(_BASE, hidden_act="no-such-activation"))
    assert "not checked: transformers could not build" in describe_hf(broken, ModelSpec.from_hf(broken, 64))


def test_finetune_recipe_parallel_auto_reads_the_folders_config(tmp_path):
    from hydra import compose, initialize_config_dir

    from lightning_hybrid.planner import plan
    from lightning_hybrid.planner.auto import _adds_router_loss, _model, choose_layout
    from lightning_hybrid.runs.config import register_configs

    fields = dict(FAMILIES["qwen2_moe"], model_type="qwen2_moe", output_router_logits=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[
            f"model.model={tmp_path}", "parallel=auto", "planner.cluster=a100", "trainer.devices=8",
            "data.batch_size=16", "data.block_size=128"])
    spec = _model(cfg)
    assert spec.name == "qwen2_moe" and spec.seq_len == 128 and spec.params == _real_count(hf_config(tmp_path))
    assert _adds_router_loss(cfg)
    out, why = choose_layout(cfg)
    best = plan(spec, load_cluster("a100"), 8, 16, whole_batch_loss=True).best.layout
    assert why.startswith("planner: qwen2_moe") and why.endswith(best.label())
    assert out.parallel.dp == best.dp and out.trainer.devices == best.devices
