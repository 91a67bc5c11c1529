"""Hydra recipes: config composition (every named config, typo'd fields failing, schemas derived from the
signatures), the checks before launch, the pretrain recipe end to end (the reference GPT in one run; a user's module
and data module from outside the package, named by `_target_` on the command line, in a 4-job layout sweep that
includes dp2 x tp2 x pp2, with its summary), what a run prints (its log file, no library notices, every step's
train loss), and bad configs giving one error line with exit code 2."""

from __future__ import annotations

import csv
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule
from lightning_hybrid.runs.config import ParallelConfig, fold_peft, register_configs, schema_from_signature
from lightning_hybrid.runs.recipe import ConfigError, check, exit_on_config_error, import_target, run, world_layout
from tests.user_model import CountingTokens, TinyLM

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
RECIPE = ROOT / "recipes" / "pretrain.py"
LAYOUTS = {"single": (1, 1, 1, 0), "dp": (2, 1, 1, 0), "tp": (1, 2, 1, 0), "dp_tp": (2, 2, 1, 0),
           "zero1": (2, 1, 1, 1), "zero2": (2, 1, 1, 2), "zero3": (2, 1, 1, 3),
           "dp_pp": (2, 1, 2, 0), "tp_pp": (1, 2, 2, 0), "3d": (2, 2, 2, 0), "hsdp": (4, 1, 1, 3)}
TINY = ["trainer.max_steps=3", "data.max_bytes=30000", "data.batch_size=4", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false"]
TIMEOUT_S = 240
#: What libraries would print on every run, which a run leaves out (`recipe.without_library_notices`, and
#: `ReplicaThroughputMonitor` for a module without FLOPs).
LIBRARY_NOTICES = ("LeafSpec", "💡 Tip", "flops_per_batch")


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="pretrain", overrides=list(overrides))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_named_layout_composes(name):
    cfg = _compose(f"parallel={name}")
    dp, tp, pp, zero = LAYOUTS[name]
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage) == (dp, tp, pp, zero)
    assert world_layout(cfg)["devices"] == dp * tp * pp  # trainer.devices=null -> dp*tp*pp
    strategy = instantiate(cfg.parallel)  # HybridStrategy(**cfg.parallel)
    assert isinstance(strategy, HybridStrategy) and strategy.options.zero_stage == zero


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("data", ["stdlib", "text"])
@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_model_data_trainer_configs_compose(model, data, trainer, tmp_path):
    overrides = [f"model={model}", f"data={data}", f"trainer={trainer}", "max_steps=7"]
    if data == "text":
        overrides.append(f"data.paths=[{tmp_path}]")
    cfg = _compose(*overrides)
    module, datamodule = instantiate(cfg.model), instantiate(cfg.data)
    assert isinstance(module, GPTLightningModule) and isinstance(datamodule, ByteCorpusDataModule)
    assert module.config.n_layer == cfg.model.n_layer
    assert datamodule.block_size == cfg.model.block_size == module.config.block_size
    assert cfg.trainer.max_steps == 7 and cfg.trainer.val_check_interval == 7
    assert cfg.trainer.accelerator == {"cpu": "cpu", "gpu": "cuda"}[trainer]
    if trainer == "gpu":
        assert cfg.trainer.precision == "bf16-mixed"
    assert (cfg.data.paths is None) == (data == "stdlib")


def test_layout_fields_are_overridable():
    cfg = _compose("parallel=dp_tp", "parallel.tp=4", "parallel.zero_stage=2", "trainer.devices=8")
    assert world_layout(cfg) == {"devices": 8, "num_nodes": 1, "dp": 2, "tp": 4, "pp": 1, "cp": 1}
    # FP8 in a recipe: the strategy's own arguments, any layout.
    fp8 = instantiate(_compose("parallel=dp_tp", "parallel.fp8=rowwise", "parallel.fp8_exclude=[model.head.*]")
                      .parallel)
    assert fp8.options.fp8 == "rowwise" and fp8.options.fp8_exclude == ("model.head.*",)
    gathered = instantiate(_compose("parallel=zero3", "parallel.fp8=tensorwise", "parallel.fp8_all_gather=true")
                           .parallel)
    assert gathered.options.fp8_all_gather and gathered.options.zero_stage == 3


@pytest.mark.parametrize("typo", ["parallel.tpp=2", "model.n_layers=3", "data.batchsize=3", "trainer.max_step=3",
                                  "lrr=1e-3"])
def test_typod_field_fails_at_composition(typo):
    with pytest.raises(ConfigCompositionException):
        _compose(typo)


def test_schemas_follow_the_signatures():
    # One parameter list: every HybridStrategy argument but those Lightning fills in (and the timedelta timeout).
    lightning_fills = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                       "timeout"}
    params = inspect.signature(HybridStrategy).parameters
    assert set(ParallelConfig.__dataclass_fields__) == {"_target_"} | (set(params) - lightning_fills)
    assert all(ParallelConfig.__dataclass_fields__[n].default == params[n].default
               for n in set(params) - lightning_fills)

    class WithAnotherArgument(HybridStrategy):
        def __init__(self, *args, overlap_comm: bool = True, **kwargs):
            super().__init__(*args, **kwargs)

    schema = schema_from_signature("S", WithAnotherArgument, "x.WithAnotherArgument")
    assert schema.__dataclass_fields__["overlap_comm"].default is True


def test_layout_not_fitting_world_size_is_a_config_error():
    with pytest.raises(ConfigError, match="does not equal the world size 2"):
        world_layout(_compose("parallel=dp_tp", "trainer.devices=2"))


def test_arguments_of_any_target_are_checked_before_launch():
    own = ["model=custom", "model._target_=tests.user_model.TinyLM"]
    assert check(_compose(*own, "model.width=16", "parallel=3d"))["devices"] == 8
    with pytest.raises(ConfigError, match=r"model: tests.user_model.TinyLM got an unexpected keyword argument 'widht';"
                                          r" its arguments are \['vocab', 'width', 'depth', 'lr'\]$"):
        check(_compose(*own, "model.widht=16"))
    # `_target_` changed on the GPT's typed node: its fields do not fit, and the message says how to start afresh.
    with pytest.raises(ConfigError, match=r"unexpected keyword argument .*start from an empty node: model=custom"):
        check(_compose("model._target_=tests.user_model.TinyLM"))
    with pytest.raises(ConfigError, match=r"model._target_='tests.user_model.Nothing' cannot be imported"):
        check(_compose("model=custom", "model._target_=tests.user_model.Nothing"))
    with pytest.raises(ConfigError, match=r"^model._target_ is required"):
        check(_compose("model=custom"))


def test_a_target_that_does_not_import_says_which_part_is_missing(tmp_path, monkeypatch):
    (tmp_path / "needs_a_dependency.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    here = re.escape(str(ROOT / "tests"))
    cases = {
        "tests.user_model.Missing": rf"tests.user_model has no attribute 'Missing' \(module found at {here}/user_mo",
        "tests.user_model.TinyLM.Missing": r"tests.user_model.TinyLM has no attribute 'Missing' \(module found at ",
        "tests.no_such_module.LM": rf"no module named 'tests.no_such_module' \(package found at {here}\)$",
        "no_such_pkg.lm.LM": r"no module named 'no_such_pkg' \(installed\? on PYTHONPATH\?\)$",
        # A module that is there but fails to import is not reported as missing.
        "needs_a_dependency.LM": r"importing needs_a_dependency failed: ModuleNotFoundError: .*'no_such_dependency'$",
        "my pkg.LM": r"not an import path",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=rf"^data._target_='{re.escape(path)}' cannot be imported: {message}"):
            import_target("data", path)
    assert import_target("model", "tests.user_model.TinyLM") is TinyLM


def test_train_loss_history_has_one_loss_per_optimizer_step():
    """Under gradient accumulation too: one value per optimizer step, the one the module logged; and a module with
    no FLOPs gets no warning of Lightning's that it has none."""
    import lightning as L

    from lightning_hybrid.runs.callbacks import ReplicaThroughputMonitor, TrainLossHistory

    class Logged(L.Callback):
        def __init__(self) -> None:
            self.values = []

        def on_train_batch_end(self, trainer, *args) -> None:
            self.values.append(float(trainer.callback_metrics["train_loss"]))

    history, logged = TrainLossHistory(), Logged()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, limit_val_batches=0,
                        callbacks=[history, logged, ReplicaThroughputMonitor(window_size=2)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyLM(width=16), CountingTokens())
    assert history.steps == [1, 2, 3] and history.values == logged.values[1::2]  # the batches that end a step
    assert not [w for w in caught if "flops_per_batch" in str(w.message)]


# ---------------------------------------------------------------------------------------------- end to end
def _run(args, cwd: Path, recipe: Path = RECIPE) -> subprocess.CompletedProcess:
    # PYTHONPATH: the user's module (tests/user_model.py) must import in every rank, as a user's own package would.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
    for k in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "HYDRA_FULL_ERROR"):
        env.pop(k, None)
    # A session of its own: on a timeout every rank (the ranks Lightning starts stay in it) prints its threads'
    # stacks (the recipe's SIGUSR1 handler) before all are killed, and the failure shows what they waited in.
    proc = subprocess.Popen([sys.executable, str(recipe), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(5)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"recipe run timed out after {TIMEOUT_S} s: {args}\n--- stdout (end)\n{out[-4000:]}"
                             f"\n--- stderr (end, with every rank's stacks)\n{err[-20000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _check_metrics(path: Path, layout: str, world_size: int) -> dict:
    m = json.loads(path.read_text())
    assert m["layout"] == layout and m["world_size"] == world_size and m["steps"] == 3
    assert 0 < m["val_loss"] < 10 and m["tokens_per_s"] > 0
    # Lightning's ThroughputMonitor counting model replicas: the global rate is dp (not world_size) replicas'.
    assert m["tokens_per_s"] == pytest.approx(m["dp"] * m["tokens_per_s_per_replica"], rel=1e-9)
    assert len(m["peak_mib_per_rank"]) == world_size and all(x > 0 for x in m["peak_mib_per_rank"])
    assert m["peak_breakdown_mib"]["parameters"] > 0
    return m


def test_recipe_single_run_tp2(tmp_path):
    run_dir = tmp_path / "run"
    res = _run(["parallel=tp", "parallel.tp=2", *TINY, "trainer.log_every_n_steps=1", f"hydra.run.dir={run_dir}"],
               cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = _check_metrics(run_dir / "metrics.json", "dp1xtp2", 2)
    # AdamW's moments are counted: 2 x the parameters once the first step has made them.
    after = m["after_step_mib"]
    assert after["optimizer_state"] == pytest.approx(2 * after["parameters"], abs=2e-3), m
    assert len(m["peak_mib_per_step"]) == 3 and max(m["peak_mib_per_step"]) == m["peak_mib_max"], m
    assert m["peak_mib_max"] >= sum(after.values()) - 1e-3, m
    final = [ln for ln in res.stdout.splitlines() if "final val_loss=" in ln]
    assert len(final) == 1 and "tokens/s=" in final[0] and "peak_mib/rank=" in final[0]
    assert final[0].startswith("[dp1xtp2] final val_loss=")  # printed as it is, the log file's format is its own
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    # The run's log in the job's log file: Lightning's lines, the TP layout, the validation and the final line.
    log = (run_dir / "pretrain.log").read_text()
    assert all(line in log for line in ["GPU available:", "tensor parallel:", "step 3: val_acc=", final[0]]), log
    output = res.stdout + res.stderr
    assert not [notice for notice in LIBRARY_NOTICES if notice in output], output[-3000:]
    # Every optimizer step's train_loss: the values the CSV logger keeps at log_every_n_steps=1.
    with open(run_dir / "csv" / "metrics.csv") as f:
        logged = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    losses = json.loads((run_dir / "train_losses.json").read_text())
    assert losses["step"] == [1, 2, 3] and losses["train_loss"] == pytest.approx(logged, rel=1e-6), (losses, logged)


def test_recipe_run_with_context_parallelism(tmp_path):
    """``parallel=dp_cp`` with ``parallel.dp=1``: each sequence split over the 2 ranks; the run's metrics name cp."""
    run_dir = tmp_path / "run"
    res = _run(["parallel=dp_cp", "parallel.dp=1", *TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = _check_metrics(run_dir / "metrics.json", "dp1xtp1xcp2", 2)
    assert m["cp"] == 2 and m["dp"] == 1


USER_MODEL = ["model=custom", "model._target_=tests.user_model.TinyLM", "model.width=32",
              "data=custom", "data._target_=tests.user_model.CountingTokens", "data.batch_size=4",
              "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]


def test_user_module_and_data_in_a_layout_sweep_up_to_3d(tmp_path):
    """A LightningModule and a LightningDataModule of the user's own, named by `_target_` on the command line,
    in a 4-job sweep up to dp2 x tp2 x pp2 (13 ranks in all), with its summary. The data module is left at its own
    batch size (no ``data.batch_size`` in the config: the metrics take the module's). Rank 1 of every job aborts
    while its interpreter shuts down, after the job completed: the job's results stand (reported), and the next job
    runs (Lightning's observer would kill the Hydra process)."""
    sweep = tmp_path / "sweep"
    res = _run(["-m", "parallel=single,dp,tp,3d", *[a for a in USER_MODEL if not a.startswith("data.batch_size")],
                "+callbacks.abort._target_=tests.user_model.AbortAtExitOnRank1", f"hydra.sweep.dir={sweep}"],
               cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(re.findall(r"rank 1 \(pid \d+\) exited with code -6 after the run had finished", res.stderr)) == 3, (
        res.stderr[-3000:])
    jobs = {name: _check_metrics(sweep / str(i) / "metrics.json", layout, world)
            for i, (name, layout, world) in enumerate([("single", "dp1xtp1", 1), ("dp", "dp2xtp1", 2),
                                                       ("tp", "dp1xtp2", 2), ("3d", "dp2xtp2xpp2", 8)])}
    assert all(m["model"] == "tests.user_model.TinyLM" and m["name"] == name for name, m in jobs.items())
    # The same data split trains the same model: tp2 as one device, dp2 x tp2 x pp2 as dp2.
    assert jobs["tp"]["val_loss"] == pytest.approx(jobs["single"]["val_loss"], rel=1e-5)
    assert jobs["3d"]["val_loss"] == pytest.approx(jobs["dp"]["val_loss"], rel=1e-5)
    # Each job ran its own ranks in RUN mode (rank 0 + launched children), not a nested sweep; and no rank
    # outlived its job: subprocess.run reads the pipes to EOF, so it would time out while any rank held them.
    assert sorted(p.name for p in (sweep / "1").glob("*.log")) == ["pretrain.log", "train_ddp_process_1.log"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["layout"] for r in rows] == ["dp1xtp1", "dp2xtp1", "dp1xtp2", "dp2xtp2xpp2"]
    assert sum(int(r["fastest"]) for r in rows) == 1 and "(fastest)" in (sweep / "summary.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (sweep / "summary.png").stat().st_size > 1000
    # The model summary counts the whole model and each rank's share (its example_input_array ran through
    # the pipeline on every rank), and library warnings come from rank 0 only: at most one copy per job.
    whole = f"{sum(p.numel() for p in TinyLM(width=32).parameters()) / 1000:.1f} K"  # 21.0 K
    assert len(re.findall(rf"(Total params: {whole}|{whole}\s+Total params)", res.stdout)) == 4  # rich or plain
    output = res.stdout + res.stderr
    assert re.search(rf"Params per device: [\d.]+ K( - [\d.]+ K)? of {whole} \(8 devices\)", output)
    assert output.count("is deprecated") <= 4, res.stderr[-3000:]  # Lightning's LeafSpec use, 13 copies unfiltered
    assert not [notice for notice in LIBRARY_NOTICES if notice in output], output[-3000:]  # TinyLM has no FLOPs
    for i, m in enumerate(jobs.values()):  # each job's log file, with its own final line
        log = (sweep / str(i) / "pretrain.log").read_text()
        assert log.count("final val_loss=") == 1 and f"[{m['layout']}] final val_loss=" in log, log


def test_sweep_module_cli(tmp_path):
    for i, (layout, speed) in enumerate([("dp2xtp1", 10.0), ("dp1xtp2", 20.0)]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "metrics.json").write_text(json.dumps(
            {"layout": layout, "name": layout, "world_size": 2, "tokens_per_s": speed, "peak_mib_max": 1.0}))
    res = subprocess.run([sys.executable, "-m", "lightning_hybrid.runs.sweep", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, MPLBACKEND="Agg"))
    assert res.returncode == 0, res.stderr
    assert "**dp1xtp2** (fastest)" in (tmp_path / "summary.md").read_text()


def test_sweep_summary_without_matplotlib(tmp_path, monkeypatch, capsys):
    from lightning_hybrid.runs.sweep import write_summary

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.json").write_text(json.dumps({"layout": "dp1xtp1", "tokens_per_s": 1.0}))
    for name in [k for k in sys.modules if k == "matplotlib" or k.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_summary(tmp_path)
    assert "skipping summary.png" in capsys.readouterr().out
    assert not (tmp_path / "summary.png").exists() and (tmp_path / "summary.md").exists()
    assert written["fastest"] == "0"


def test_bad_config_is_one_error_line_exit_2(tmp_path):
    """The recipe as a user runs it, on a composition error (Hydra's, before the run function)."""
    res = _run(["parallel.tpp=2", *TINY, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    message = "Key 'tpp' not in 'ParallelConfig'"
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["parallel=dp_tp", "trainer.devices=2"], "does not equal the world size 2"),
        (["parallel=dp_pp", "parallel.schedule=round_robin"], "parallel: schedule='round_robin' is unknown"),
        (["data=text", "data.paths=[/no/such/corpus]"], "data: paths: '/no/such/corpus' does not exist"),
        (["data=text"], "data.paths is required"),
        (["+ckpt_pth=last"], "ckpt_pth: not a key of the recipe (it would be ignored); its keys are"),
        (["ckpt_path=last"], "ckpt_path=last: no checkpoints/last.ckpt in"),
        (["data=shards", "data.path=/no/such/tokens"], "data.path='/no/such/tokens' is not a folder"),
        (["data=text", f"data.paths=[{ROOT / 'README.md'}]", "model.vocab_size=100"],
         "data: a vocabulary of 256 tokens, more than the model's vocabulary of 100 embeds"),
        (["data=custom", "data._target_=tests.user_model.Missing"],
         "data._target_='tests.user_model.Missing' cannot be imported: tests.user_model has no attribute 'Missing'"
         f" (module found at {ROOT / 'tests' / 'user_model.py'})"),
        (["model=custom", "model._target_=no_such_pkg.lm.LM"], "cannot be imported: no module named 'no_such_pkg'"),
    ],
)
def test_what_a_run_refuses_before_launching_is_one_error_line(args, message, tmp_path, monkeypatch, capfd):
    """The run function (in this process: it stops before any rank starts) on configs it refuses: the recipe's one
    ``error:`` line and exit code 2 (`exit_on_config_error`, as the recipes apply it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    tiny = [a for a in TINY if "data=shards" not in args or not a.startswith("data.max_bytes")]
    cfg = _compose(*args, *tiny)
    with pytest.raises(SystemExit) as exit_:
        exit_on_config_error(run)(cfg)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_a_batch_the_layout_cannot_split_is_one_error_line_before_the_ranks_start(tmp_path):
    """Found from the data module before Lightning starts the other ranks (`HybridStrategy.check_before_launch`):
    after Lightning's own lines about the devices, one ``error:`` line, exit code 2, no traceback."""
    args = ["parallel=dp_pp", "+parallel.micro_batches=3", *TINY, f"hydra.run.dir={tmp_path / 'run'}"]
    res = _run(args, cwd=tmp_path)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: batch_size=4 (per data-parallel rank) does not split into micro_batches=3"), last
    assert "Traceback" not in res.stdout + res.stderr and "Initializing distributed" not in res.stderr


def test_slurm_launcher_config_composes():
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="pretrain", overrides=["hydra/launcher=slurm", "parallel=3d"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node * cfg.hydra.launcher.nodes == world_layout(cfg)["devices"]


# ---------------------------------------------------------------------------------------------- fine-tuning
def _pretrained_folder_with_tokenizer(folder: Path) -> Path:
    """A tiny Llama (random init) and a byte-level BPE tokenizer trained here (256 tokens: the model's vocabulary),
    saved as a Hugging Face folder."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.families import tiny_config

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ByteCorpusDataModule(max_bytes=50_000).corpus_bytes().decode("utf-8", errors="replace")
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=256,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder)
    return folder


def test_finetune_recipe_end_to_end(tmp_path):
    """The fine-tuning recipe on chat JSONL (``data=sft``, the folder's chat template) under tp2 x pp2: what the data
    held in ``metrics.json``, the trained model exported as a transformers folder, the sharded checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _pretrained_folder_with_tokenizer(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)  # its 256 tokens are the model's vocabulary: no new ones
    tokenizer.chat_template = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
                               "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    tokenizer.save_pretrained(folder)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{2 * i}."}]}) + "\n"
                            for i in range(200)))
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("data.max_bytes")]  # a corpus option the SFT data has not
    res = _run([f"model.model={folder}", "data=sft", f"data.path={chat}", "data.block_size=64", "parallel=tp_pp",
                *tiny, f"hydra.run.dir={run_dir}"], cwd=tmp_path, recipe=ROOT / "recipes" / "finetune.py")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = _check_metrics(run_dir / "metrics.json", "dp1xtp2xpp2", 4)
    assert m["model"] == "lightning_hybrid.hf.CausalLM"
    data = m["data"]  # every record accounted for, and said before the first step
    assert data["records"] == 200 and data["documents"] + data["val_documents"] == 200 and not data["dropped"]
    assert re.search(r"data: .*records=200", (run_dir / "finetune.log").read_text())
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    exported = run_dir / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(exported)  # the trained weights, as transformers reads them
    source = AutoModelForCausalLM.from_pretrained(folder)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
    # The run's sharded checkpoint, on one process, is the exported model.
    from lightning_hybrid.hf import CausalLM

    ids = torch.randint(0, 256, (2, 8))
    restored = CausalLM.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt").eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(ids), model.eval()(input_ids=ids).logits, rtol=0, atol=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(exported)  # the folder's tokenizer travels with it
    assert tokenizer("def f(x):")["input_ids"] == AutoTokenizer.from_pretrained(folder)("def f(x):")["input_ids"]


def test_token_corpus_uses_the_folders_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from lightning_hybrid.data.corpus import TokenCorpusDataModule

    folder = _pretrained_folder_with_tokenizer(tmp_path)
    data = TokenCorpusDataModule(tokenizer=folder, max_bytes=20_000, block_size=16, batch_size=2)
    data.setup()
    text = data.corpus_bytes().decode("utf-8", errors="replace")
    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    x, y = data.train_dataset[0]
    assert (x.tolist() == ids[:16] and y.tolist() == ids[1:17]
            and data.vocab_size == len(AutoTokenizer.from_pretrained(folder)))
    assert ids[:16] != list(data.corpus_bytes()[:16])  # the tokenizer's ids, not the bytes
    (tmp_path / "weights-only").mkdir()
    no_tokenizer = TokenCorpusDataModule(tokenizer=tmp_path / "weights-only", max_bytes=20_000)
    assert no_tokenizer.tokenizer is None and no_tokenizer.vocab_size == 256  # bytes
    with pytest.raises(FileNotFoundError, match="tokenizer: '/no/such/model' is not a folder"):
        TokenCorpusDataModule(tokenizer="/no/such/model")


# ---------------------------------------------------------------------------------------------- shards, resume
def test_shards_run_resumed_from_last_in_its_folder_trains_the_same_losses_across_an_epoch(tmp_path):
    """``data=shards`` under dp2: a run of 8 steps (5 batches per rank and epoch), then the same run resumed
    (``ckpt_path=last``, no run folder given: the newest run of the recipe) from its step-3 checkpoint put back as
    ``last.ckpt`` -- as if killed after it -- into the same folder: steps 4-8, across the epoch's end, bit-equal."""
    from lightning_hybrid.data.prepare import prepare

    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(10):  # 8 train documents of 81 tokens (with the end of text): 20 windows of 32
        (src / f"{i}.txt").write_text(f"document {i} " + "abcdefghij"[i] * 69)
    prepare([src], tmp_path / "tokens", val_fraction=0.2)
    args = ["data=shards", f"data.path={tmp_path / 'tokens'}", "data.batch_size=2", "model.vocab_size=256",
            "parallel=dp", "max_steps=8", "trainer.enable_progress_bar=false", "model.warmup_steps=2",
            "model.lr_decay=cosine"]
    run_dir = tmp_path / "outputs" / "first"
    keep = ["+callbacks.keep._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.keep.save_top_k=-1",
            f"+callbacks.keep.dirpath={tmp_path / 'kept'}", "+callbacks.keep.every_n_train_steps=3"]
    res = _run([*args, *keep, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    full = json.loads((run_dir / "train_losses.json").read_text())
    assert full["step"] == list(range(1, 9))
    data = json.loads((run_dir / "metrics.json").read_text())["data"]
    assert data["rows"] == 20 and data["documents"] == 8 and data["tokens"] == 8 * 81
    assert "data: source=" in (run_dir / "pretrain.log").read_text()
    last = run_dir / "checkpoints" / "last.ckpt"
    step3 = next((tmp_path / "kept").glob("*step=3*"))
    shutil.rmtree(last) if last.is_dir() else last.unlink()
    (shutil.copytree if step3.is_dir() else shutil.copy)(step3, last)
    (run_dir / "metrics.json").unlink()
    (run_dir / "train_losses.json").unlink()  # as after a kill: the history of steps 1-3 is in the checkpoint
    res = _run([*args, "ckpt_path=last"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = json.loads((run_dir / "train_losses.json").read_text())
    assert resumed == full  # steps 1-3 from the checkpoint, 4-8 trained again: the same floats
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(last) and metrics["steps"] == 8
    assert f"Restored all states from the checkpoint at {last}" in (run_dir / "pretrain.log").read_text()
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first"]  # no new run folder


def test_a_recipe_trains_lora_through_the_peft_group_or_the_models_arguments():
    """``peft=lora peft.r=4 ...`` (configs/peft/lora.yaml) or ``model.lora={...}``: CausalLM's ``lora`` (peft's
    LoraConfig fields); refused for a model without adapters, and when given both ways."""
    pytest.importorskip("peft")
    tiny = ("model=hf", "model.model=llama", "+model.config={vocab_size: 256, hidden_size: 32, num_hidden_layers: 1,"
            " num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64}")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        def finetune(*overrides: str):
            return compose(config_name="finetune", overrides=list(overrides))

        cfg = finetune(*tiny, "peft=lora", "peft.r=4", "peft.target_modules=[q_proj,v_proj]")
        assert finetune(*tiny).peft is None  # no adapters by default
        both = finetune(*tiny, "model.lora={r: 4, target_modules: [q_proj]}", "peft=lora")
        gpt = finetune("model=small", "peft=lora")
    module = instantiate(fold_peft(cfg).model)
    assert module.lora.r == 4 and module.lora.lora_alpha == 32 and module.lora.target_modules == {"q_proj", "v_proj"}
    cfg = _compose(*tiny, "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}")
    module = instantiate(fold_peft(cfg).model)
    assert module.lora.r == 4 and module.lora.target_modules == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="peft and model.lora both give the model adapters"):
        fold_peft(both)
    with pytest.raises(ValueError, match=r"peft: the model \(lightning_hybrid.models.GPTLightningModule\) takes no"):
        fold_peft(gpt)
