"""The planner's model description against the models themselves, the search's validity against the
strategy's own checks, the command line (``--json``), and ``parallel=auto`` in the pretrain recipe end to end
(with the sweep summary of predictions and ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hybrid import HybridStrategy
from lightning_hybrid.models import GPT, GPTConfig, GPTLightningModule
from lightning_hybrid.planner import ModelSpec, load_cluster, model_spec, plan
from lightning_hybrid.planner.__main__ import main as planner_main

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- the model
def test_model_spec_counts_the_reference_gpt():
    for config in (GPTConfig(n_layer=3, n_embd=64, n_head=4),
                   GPTConfig(n_layer=2, n_embd=48, n_head=6, n_kv_head=2, mlp="swiglu", bias=False)):
        gpt = GPT(config)
        spec = ModelSpec.from_gpt(config)
        assert spec.params == gpt.num_parameters()
        assert spec.pipeline_layer_params() == [sum(p.numel() for p in layer.parameters()) for layer in gpt.layers()]
        assert spec.flops_per_token() == gpt.flops_per_token(config.block_size)
    module = GPTLightningModule(n_layer=2, n_embd=32)
    module.configure_model()
    assert ModelSpec.from_module(module).params == module.model.num_parameters()


def test_model_spec_from_a_hugging_face_config():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32)
    spec = ModelSpec.from_hf(config)
    assert ((spec.n_layer, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.seq_len)
            == (2, 64, 8, 2, 160, 128, 32))
    assert spec.gated_mlp and not spec.bias and not spec.learned_positions
    assert spec.params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_model_spec_from_the_command_line(tmp_path):
    assert model_spec("gpt3-175b").params == pytest.approx(175e9, rel=0.01)
    assert model_spec("n_layer=2,n_embd=32,mlp=swiglu", seq_len=16).seq_len == 16
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(tmp_path)
    assert model_spec(str(tmp_path)).hidden == 64
    with pytest.raises(ValueError, match="neither a preset"):
        model_spec("gpt-9000")


# ---------------------------------------------------------------------------------------------- the search
def test_every_planned_layout_is_one_the_strategy_accepts():
    model = model_spec("small")
    result = plan(model, load_cluster("cpu"), devices=4, global_batch=8)
    layouts = [c.layout for c in result.ranked + result.too_big]
    assert layouts and len(set(layouts)) == len(layouts)
    assert {lay.schedule for lay in layouts if lay.pp > 1} == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    for lay in layouts:
        assert lay.devices == 4 and lay.dp * lay.micro_batch * lay.micro_batches == 8
        assert model.heads % lay.tp == 0 and (lay.zero_stage == 0 or lay.dp > 1)
        assert lay.sequence_parallel <= (lay.tp > 1)
        HybridStrategy(**lay.strategy_kwargs())  # the strategy's own checks pass
    times = [c.time.total for c in result.ranked]
    assert times == sorted(times) and result.rank_of(result.ranked[1].layout) == 2


def test_a_model_too_big_for_the_devices_says_why():
    result = plan(model_spec("gpt3-175b"), load_cluster("a100"), devices=8, global_batch=8)
    assert not result.ranked and result.too_big
    assert "GiB usable" in result.too_big[0].reason
    with pytest.raises(ValueError, match="No layout of gpt3-175b fits 8"):
        _ = result.best


def test_command_line_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hybrid.planner", "--model", "small", "--cluster", "a100", "--devices", "16",
         "--global-batch", "32", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("model small:") and "   1 dp" in proc.stdout
    data = json.loads(out.read_text())
    best = data["ranked"][0]
    assert best["dp"] * best["tp"] * best["pp"] == 16 and best["fits"]
    assert best["time_s"]["total"] >= best["time_s"]["compute"] > 0
    assert set(best["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}


def test_command_line_bad_model_is_one_error_line(capsys):
    assert planner_main(["--model", "nope", "--devices", "2", "--global-batch", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --model 'nope' is neither a preset")


# ---------------------------------------------------------------------------------------------- parallel=auto
def _recipe(args, cwd: Path, cluster_file: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LIGHTNING_HYBRID_CLUSTER=str(cluster_file),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    for k in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "HYDRA_FULL_ERROR"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "pretrain.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def test_auto_layout_config_is_typed():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from lightning_hybrid.runs.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="pretrain", overrides=["parallel=auto", "planner.cluster=a100"])
        assert cfg.planner.cluster == "a100" and cfg.planner.global_batch is None
        assert compose(config_name="pretrain").planner is None
        with pytest.raises(ConfigCompositionException):
            compose(config_name="pretrain", overrides=["parallel=auto", "planner.clusterr=a100"])


def test_recipe_parallel_auto_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    # No calibration file: this machine's defaults, so the choice does not depend on who calibrated what.
    res = _recipe(["parallel=auto", "trainer.devices=2", "trainer.max_steps=2", "data.max_bytes=30000",
                   "data.batch_size=4", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
                   f"hydra.run.dir={run_dir}"], tmp_path, tmp_path / "none.json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    why = [ln for ln in res.stdout.splitlines() if ln.startswith("planner:")]
    assert len(why) == 2 and "layouts fit" in why[0] and why[1].startswith("planner: running dp"), res.stdout[-2000:]
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["name"] == "auto" and m["world_size"] == 2 and m["steps"] == 2
    assert why[1].split()[2] == m["layout"].split("xzero")[0]  # the layout the log names is the one that ran
    assert m["predicted_peak_mib"] > 0 and m["predicted_tokens_per_s"] > 0 and m["predicted_cluster"] == "cpu-default"
    # A bad planner setting is a config error: one line, exit code 2, before any rank starts.
    bad = _recipe(["parallel=auto", "planner.cluster=nope", "trainer.devices=2"], tmp_path, tmp_path / "none.json")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: parallel=auto: cluster 'nope' is neither a preset (['a100', 'a100-40gb', 'cpu', 'h100']) nor a cluster"
        " JSON file."]


def test_sweep_summary_shows_predictions_and_ranks(tmp_path):
    import csv

    from lightning_hybrid.runs.sweep import spearman, write_summary

    for job, (measured, predicted) in enumerate([(100.0, 900.0), (300.0, 1000.0), (200.0, 950.0)]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps(
            {"layout": f"l{job}", "tokens_per_s": measured, "predicted_tokens_per_s": predicted,
             "peak_mib_max": 5.0, "predicted_peak_mib": 5.5}))
    assert write_summary(tmp_path)["spearman"] == pytest.approx(1.0)
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["measured_rank"], r["planner_rank"]) for r in rows] == [("3", "3"), ("1", "1"), ("2", "2")]
    assert rows[0]["predicted_peak_mib"] == "5.5"
    assert "Spearman rank correlation of predicted and measured tokens/s: 1.00" in (tmp_path / "summary.md").read_text()
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
