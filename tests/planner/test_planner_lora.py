"""The planner on LoRA runs (``ModelSpec.lora_rank``, ``--lora-rank``, a recipe's ``peft=lora``): the adapters it
counts are the ones peft puts on the model (whole and TP-split as `split_adapted` splits them), the frozen base gets
no gradients or optimizer state and no weight-gradient GEMMs, only the adapters' gradients are reduced, and a base
too large to train fully fits with LoRA. Cheap: meta-device models and the planner's arithmetic only."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, estimate_time, load_cluster, model_spec, plan
from lightning_hybrid.planner.__main__ import main as planner_main
from lightning_hybrid.planner.activations import PRECISIONS
from lightning_hybrid.planner.model import hf_config
from lightning_hybrid.planner.placement import rank_trainable

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
_BASE = dict(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("family, fields", [
    ("llama", _BASE), ("qwen3", dict(_BASE, head_dim=24)), ("phi3", dict(_BASE, pad_token_id=0)),  # fused qkv, gate_up
    ("gpt_neox", {k: v for k, v in _BASE.items() if k != "num_key_value_heads"}),  # fused qkv, plain MLP
    ("mixtral", dict(_BASE, num_local_experts=4, num_experts_per_tok=2)),  # the router's and the experts' adapters
    ("olmoe", dict(_BASE, num_experts=4, num_experts_per_tok=2)),
])
def test_the_adapters_counted_are_peft_s(family, fields):
    """peft's ``all-linear`` on the blocks (not the LM head): the planner's count, whole and split over tp2 as TP
    splits them (a column layer's A whole and B split, a row layer's A split and B whole)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    config = hf_config(family, fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inject_adapter_in_model(LoraConfig(r=8, target_modules="all-linear"), model, low_cpu_mem_usage=True)
    adapters = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    spec = dataclasses.replace(ModelSpec.from_hf(config, 64), lora_rank=8)
    layers = tuple(range(spec.n_layer + 2))
    on_experts = sum(n for name, n in adapters.items() if ".experts." in name)
    assert rank_trainable(spec, layers, 1) == (sum(adapters.values()) - on_experts, on_experts)
    columns = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "query_key_value",
               "dense_h_to_4h")
    whole = sum(n for name, n in adapters.items()
                if ".experts." not in name and ((".lora_A." in name) == any(c in name for c in columns)
                                                or ".gate." in name))  # (the router: whole)
    assert rank_trainable(spec, layers, 2, 2) == (whole + (sum(adapters.values()) - on_experts - whole) / 2,
                                                   on_experts / 2)


def test_a_frozen_base_keeps_no_gradients_or_optimizer_state_and_skips_weight_gradients():
    # ZeRO-1's gather in the step: the communication whole, not hidden under the next forward
    cluster = dataclasses.replace(load_cluster("h100"), param_gather_overlap=False)
    full = model_spec("llama2-7b")
    lora = dataclasses.replace(full, lora_rank=16)
    layout = Layout(dp=8, tp=1, pp=1, zero_stage=1, micro_batch=1, micro_batches=4, activation_checkpointing=True)
    m_full, m_lora = (estimate_memory(m, layout, cluster.precision) for m in (full, lora))
    adapters = sum(rank_trainable(lora, tuple(range(lora.n_layer + 2)), 1))
    assert 0 < adapters < 0.01 * full.params
    pb, gb, ob, _ = PRECISIONS[cluster.precision]
    assert m_lora.grads == gb * adapters and m_lora.optimizer == pytest.approx(ob * adapters / 8)  # ZeRO-1 over dp8
    assert m_lora.params == pytest.approx(m_full.params + pb * adapters) and m_lora.activations == m_full.activations
    t_full, t_lora = (estimate_time(m, layout, cluster) for m in (full, lora))
    # The weights' GEMMs: 3 passes of 4 (forward, recomputation, backward's two) -> 3 of 4 minus the weight gradient.
    assert t_lora.compute < t_full.compute and t_lora.dp_comm < 0.05 * t_full.dp_comm
    assert t_lora.optimizer < 0.01 * t_full.optimizer
    assert lora.flops_per_token() < full.flops_per_token()
    # ZeRO-3 still gathers the frozen weights; it reduce-scatters the adapters' gradients alone.
    zero3 = dataclasses.replace(layout, zero_stage=3)
    z_full, z_lora = (estimate_time(m, zero3, cluster) for m in (full, lora))
    assert 0 < z_lora.dp_comm < z_full.dp_comm


def test_lora_fits_where_full_training_does_not(capsys):
    """Llama 3 70B on one node of 8 H100: full training fits nowhere, LoRA r=16 does (the command line too)."""
    cluster = load_cluster("h100")
    full = model_spec("llama3-70b")
    assert not plan(full, cluster, 8, 8).ranked
    best = plan(dataclasses.replace(full, lora_rank=16), cluster, 8, 8).best
    assert best.memory.optimizer < 2**30 and best.memory.grads < 2**30
    args = ["--model", "llama3-70b", "--cluster", "h100", "--devices", "8", "--global-batch", "8", "--top", "1"]
    assert planner_main(args) == 1
    capsys.readouterr()
    assert planner_main([*args, "--lora-rank", "16"]) == 0
    assert "rank layout" in capsys.readouterr().out


def test_a_recipe_with_lora_is_planned_with_its_rank(tmp_path):
    import json

    from hydra import compose, initialize_config_dir

    from lightning_hybrid.planner.auto import _model
    from lightning_hybrid.runs.config import fold_peft, register_configs

    (tmp_path / "config.json").write_text(json.dumps(dict(_BASE, model_type="llama")))
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[f"model.model={tmp_path}", "parallel=auto", "peft=lora",
                                                         "peft.r=4", "trainer.devices=2", "data.block_size=64"])
    assert _model(fold_peft(cfg)).lora_rank == 4
