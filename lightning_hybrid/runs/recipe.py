"""The run function every recipe calls: objects from the config, one Trainer, fit, metrics.

    check(cfg)                                   # everything a config can get wrong, before any process starts
    model    = instantiate(cfg.model)            # any LightningModule      (model._target_)
    data     = instantiate(cfg.data)             # any LightningDataModule  (data._target_)
    strategy = instantiate(cfg.parallel)         # HybridStrategy(**cfg.parallel)
    trainer  = instantiate(cfg.trainer, devices=dp*tp*pp/num_nodes, strategy=..., logger=..., callbacks=...)
    trainer.fit(model, datamodule=data)          # Lightning starts the other ranks; each runs this same function
    -> metrics.json and train_losses.json in the Hydra output folder (rank 0); the metrics returned on every rank

A recipe is a thin ``@hydra.main`` script over `run` with its own top-level config (``recipes/pretrain.py``
with ``configs/pretrain.yaml``); extra callbacks (an export at the end of fine-tuning, say) come from the
config's ``callbacks`` or the ``callbacks`` argument. A bad config raises `ConfigError` before Lightning starts
a process; `exit_on_config_error` prints it as one ``error: ...`` line and exits with code 2. What a run prints also
goes to the job's log file (``<output dir>/<job name>.log``), without Lightning's notices that no run can act on
(`run_log`, `without_library_notices`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_hybrid.checkpoint import CheckpointError
from lightning_hybrid.core.dims import ParallelDims, layout_size
from lightning_hybrid.data.corpus import DataError
from lightning_hybrid.planner.auto import choose_layout, predicted_metrics
from lightning_hybrid.runs.callbacks import (
    DataReport,
    ReplicaThroughputMonitor,
    TrainLossHistory,
    ValidationPrinter,
    model_summary_callback,
    progress_bar_callback,
)
from lightning_hybrid.runs.config import RecipeConfig, fold_peft, register_configs
from lightning_hybrid.runs.memory import PeakMemoryMonitor
from lightning_hybrid.runs.resume import checkpoint_to_resume, register_run_dir_resolver
from lightning_hybrid.runtime.launch import fresh_launch_environment, take_over_launched_ranks, wait_for_launched_ranks
from lightning_hybrid.runtime.rank_zero import BatchError

__all__ = ["ConfigError", "check", "check_arguments", "exit_on_config_error", "import_target", "layout_label", "run",
           "run_log", "without_library_notices", "world_layout"]

register_configs()
register_run_dir_resolver()  # before @hydra.main composes a recipe's hydra.run.dir

log = logging.getLogger(__name__)

#: Training steps whose peak memory `run` measures (the tracker costs Python time per op).
MEASURED_STEPS = 3

#: The config nodes `run` builds objects from (``callbacks.<name>`` too).
BUILT = ("model", "data", "parallel", "trainer")


class ConfigError(ValueError):
    """A recipe config that cannot run, found before any process starts; the message is one line's worth."""


# ---------------------------------------------------------------------------------------------- checking
def _targets(cfg: DictConfig) -> Dict[str, DictConfig]:
    nodes = {key: cfg[key] for key in BUILT}
    for group in ("callbacks", "loggers"):
        nodes.update({f"{group}.{name}": node for name, node in cfg.get(group, {}).items() if node is not None})
    return nodes


def check_keys(cfg: DictConfig) -> None:
    """``ConfigError`` for a key at the top of the recipe that it does not read -- ``+foo=1`` adds one that would
    be ignored -- naming it and the recipe's keys (the nodes below are checked by their schemas and targets)."""
    known = [f.name for f in dataclasses.fields(RecipeConfig)]
    unknown = [key for key in cfg if key not in known]
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a key of the recipe (it would be ignored); its keys are {known}")


def import_target(key: str, path: Any) -> Any:
    """The object a ``_target_`` names (``my_pkg.lm.MyLM``), walked as Python imports it: each part an attribute of
    the one before or, below a package, a module. A `ConfigError` says which part is missing -- ``no module named
    'my_pkg'``, ``my_pkg.lm has no attribute 'MyLM' (module found at .../lm.py)`` -- or which module raised while
    importing (its own missing dependency, say), kept apart from a module that is not there."""
    where = f"{key}._target_={path!r} cannot be imported"
    if not isinstance(path, str) or not all(part.isidentifier() for part in path.split(".")):
        raise ConfigError(f"{where}: not an import path (my_pkg.module.Class).")
    parts = path.split(".")
    obj: Any = None
    module: Optional[ModuleType] = None
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        if module is not None and hasattr(obj, part):
            obj = getattr(obj, part)
            module = obj if isinstance(obj, ModuleType) else module
        elif module is None or (obj is module and hasattr(module, "__path__")):  # the top, or below a package
            try:
                obj = module = importlib.import_module(name)
            except Exception as err:
                if not (isinstance(err, ModuleNotFoundError) and err.name == name):
                    raise ConfigError(f"{where}: importing {name} failed: {type(err).__name__}: {err}") from err
                hint = f"package found at {next(iter(module.__path__), '?')}" if module else "installed? on PYTHONPATH?"
                raise ConfigError(f"{where}: no module named {name!r} ({hint})") from err
        else:
            raise ConfigError(f"{where}: {'.'.join(parts[:i])} has no attribute {part!r}"
                              f" (module found at {module.__file__})")
    return obj


def check_arguments(key: str, node: DictConfig) -> None:
    """``ConfigError`` unless ``node``'s ``_target_`` imports and takes ``node``'s arguments.

    This is what keeps a typo'd argument of a model or data module that no structured config describes
    (``model=custom``) from reaching the processes: the names are bound against the target's signature. A
    target taking ``**kwargs`` accepts any name here and must check them in its ``__init__``, which `run` also
    calls before any process starts.
    """
    path = node.get("_target_")
    target = import_target(key, path)
    names = [k for k in node if not (k.startswith("_") and k.endswith("_"))]
    signature = inspect.signature(target)
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as err:
        accepted = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        hint = ""
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema) and getattr(schema, "_target_", path) != path:
            hint = f" (for a class of your own, start from an empty node: {key}=custom {key}._target_={path} ...)"
        raise ConfigError(f"{key}: {path} {err}; its arguments are {accepted}{hint}") from err


def world_layout(cfg: DictConfig) -> Dict[str, int]:
    """``{"devices", "num_nodes", "dp", "tp", "pp", "cp"}`` from ``parallel`` and ``trainer``:
    ``trainer.devices=null`` means ``dp * tp * pp * cp / num_nodes`` (``dp >= 1`` then); an explicit ``devices``
    must fit the layout."""
    par, tr = cfg.parallel, cfg.trainer
    num_nodes = int(tr.num_nodes)
    cp = int(par.get("cp", 1) or 1)
    if tr.devices is None:
        if par.dp < 1:
            raise ConfigError(
                f"parallel.dp={par.dp}: with trainer.devices=null the layout must name dp >= 1"
                " (devices = dp*tp*pp*cp); or set trainer.devices to infer dp=-1 from it."
            )
        world = par.dp * par.tp * par.pp * cp
        if world % num_nodes != 0:
            raise ConfigError(f"dp*tp*pp*cp = {world} is not divisible by trainer.num_nodes={num_nodes}.")
        devices = world // num_nodes
    else:
        devices = int(tr.devices)
    try:  # the strategy's own check (and message), but now, before processes are launched
        dims = ParallelDims.resolve(int(par.dp), int(par.tp), int(par.pp), world_size=devices * num_nodes, cp=cp)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return {"devices": devices, "num_nodes": num_nodes, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp}


def check(cfg: DictConfig) -> Dict[str, int]:
    """Every check that needs no object built: required values present, every ``_target_`` importable and
    taking its arguments, the layout fitting the world size. Returns `world_layout`; raises `ConfigError`."""
    check_keys(cfg)
    if int(cfg.get("checkpoint_every", 0)) < 0:
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every}: valid values are 0 (after validations only) or"
                          " a number of optimizer steps")
    for key in BUILT:
        missing = sorted(OmegaConf.missing_keys(cfg[key]))  # full keys: "data.paths"
        if missing:
            raise ConfigError(f"{missing[0]} is required: pass {missing[0]}=... on the command line.")
    for key, node in _targets(cfg).items():
        check_arguments(key, node)
    return world_layout(cfg)


def _build(key: str, node: DictConfig, **kwargs: Any) -> Any:
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:  # the constructor's own error (bad value), not Hydra's wrapping
        raise ConfigError(f"{key}: {err.__cause__ or err}") from err


# ---------------------------------------------------------------------------------------------- measuring
def layout_label(dims: ParallelDims, zero_stage: int, ep: int = 1) -> str:
    """``dp2xtp2xpp2`` (``pp`` and ``cp`` only when > 1, ``ep<k>`` and ``zero<k>`` only when > 1 and > 0)."""
    parts = [f"dp{dims.dp}", f"tp{dims.tp}"] + ([f"pp{dims.pp}"] if dims.pp > 1 else [])
    parts += [f"cp{dims.cp}"] if dims.cp > 1 else []
    return "x".join(parts + ([f"ep{ep}"] if ep > 1 else []) + ([f"zero{zero_stage}"] if zero_stage else []))


def peak_memory_per_rank(monitor: PeakMemoryMonitor) -> Dict[str, Any]:
    """The per-rank peak-memory figures of ``metrics.json`` (MiB): the peak of live tensor bytes during the
    measured training steps per rank; for the rank with the highest, its breakdown, the peak of each step and
    the live bytes by kind after the last; on CUDA the peak of allocated memory per rank."""
    ranks = monitor.per_rank or [monitor.peak]
    highest = max(ranks, key=lambda p: p.total)
    figures: Dict[str, Any] = {
        "peak_mib_per_rank": [p.mib()["total"] for p in ranks],
        "peak_mib_max": highest.mib()["total"],
        "peak_breakdown_mib": {k: v for k, v in highest.mib().items() if k not in ("total", "cuda_max_allocated")},
        "peak_mib_per_step": [round(b / 2**20, 3) for b in highest.step_peaks],
        "after_step_mib": {k: round(b / 2**20, 3) for k, b in highest.after_step.items()},
    }
    if highest.cuda_max_allocated is not None:
        figures["peak_cuda_mib_per_rank"] = [p.mib().get("cuda_max_allocated") for p in ranks]
    return figures


def _loggers(cfg: DictConfig, out_dir: Path, version: str) -> list:
    """A CSV logger always, TensorBoard too when it is installed (both in ``out_dir``, as ``version``), and those of
    the config's ``loggers`` (W&B, MLflow, ... by ``_target_``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = [CSVLogger(save_dir=str(out_dir), name="csv", version=version)]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(save_dir=str(out_dir), name="tensorboard", version=version))
    return loggers + [_build(f"loggers.{name}", node) for name, node in cfg.loggers.items() if node is not None]


def _check_vocabulary(model: Any, data: Any) -> None:
    """``ConfigError`` where the data holds token ids the model has no embedding for: the data module's
    ``max_token_id`` (the largest id in it, where it knows) or ``vocab_size`` (its tokenizer's) against the
    model's ``vocab_size`` -- found here rather than as an index error in the first step."""
    vocab = getattr(model, "vocab_size", None)
    top, tokenizer = getattr(data, "max_token_id", None), getattr(data, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    if isinstance(top, int) and top >= vocab or top is None and isinstance(tokenizer, int) and tokenizer > vocab:
        held = (f"token ids up to {top} (of a vocabulary of {tokenizer})" if top is not None
                else f"a vocabulary of {tokenizer} tokens")
        raise ConfigError(
            f"data: {held}, more than the model's vocabulary of {vocab} embeds: train a model of"
            f" that vocabulary (model.vocab_size={tokenizer} for the reference GPT), or tokenise with the model's own"
            " tokenizer (data.tokenizer=<the model folder>)")


def _hydra_run() -> Dict[str, Any]:
    """Output folder, this job's overrides and the chosen layout name (outside Hydra: cwd, none, none)."""
    if not HydraConfig.initialized():
        return {"out_dir": Path.cwd(), "overrides": "", "name": None, "job": "run"}
    hc = HydraConfig.get()
    return {
        "out_dir": Path(hc.runtime.output_dir),
        "overrides": " ".join(shlex.quote(o) for o in hc.overrides.task),
        "name": hc.runtime.choices.get("parallel"),
        "job": hc.job.name,
    }


# ---------------------------------------------------------------------------------------------- what a run prints
#: Lightning's loggers. Imported before logging is set up -- a recipe imports Lightning before Hydra's job logging
#: exists -- each gets a stderr handler of its own and stops propagating (``lightning/pytorch/__init__.py``), so
#: their lines never reach the root logger's handlers, the job's log file among them.
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")

#: The logger of the recipe's own lines (the planner's choice, ``step N: val_loss=...``, the final line).
RECIPE_LOGGER = "lightning_hybrid"


@contextmanager
def run_log() -> Iterator[None]:
    """Within the block, a run's log goes to the root logger's log files -- Hydra's job log, ``<output dir>/<job
    name>.log`` -- as well as to the console as before: Lightning's lines to stderr (its own handlers) and the
    recipe's (`RECIPE_LOGGER`, at INFO) to stdout, as ``print`` would show them. Loggers as they were after it."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    ours = logging.getLogger(RECIPE_LOGGER)
    saved = ours.level, ours.propagate
    added = [(ours, h) for h in (logging.StreamHandler(sys.stdout), *files)]
    lightning = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    added += [(logger, h) for logger in lightning if not logger.propagate for h in files]  # else root's get them
    ours.setLevel(logging.INFO)
    ours.propagate = False
    for logger, handler in added:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, handler in added:
            logger.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]


class _NoLightningTips(logging.Filter):
    """Leaves out Lightning's advertisements (``💡 Tip: For seamless cloud logging ... litlogger``), which every fit
    logs through ``rank_zero_info``; only a ``LitLogger`` among the trainer's loggers turns it off -- no Trainer
    argument or environment variable does."""

    logger = "lightning.pytorch.utilities.rank_zero"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip: ")


@contextmanager
def without_library_notices() -> Iterator[None]:
    """Within the block, none of the notices that libraries print on every run and that a run cannot act on:
    Lightning's tips, and its own use of a torch API that torch deprecates (``isinstance(treespec, LeafSpec)``,
    from ``lightning/pytorch/utilities/_pytree.py``). Each is matched by its exact message and origin; every other
    warning -- ours, the user's, the libraries' others -- is shown as before."""
    tips, no_tips = logging.getLogger(_NoLightningTips.logger), _NoLightningTips()
    tips.addFilter(no_tips)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
                                    category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree$")
            yield
    finally:
        tips.removeFilter(no_tips)


# ---------------------------------------------------------------------------------------------- the run
def run(cfg: DictConfig, callbacks: Sequence[L.Callback] = ()) -> Dict[str, Any]:
    """Fit ``cfg.model`` on ``cfg.data`` under ``cfg.parallel`` with ``cfg.trainer``; returns the metrics also
    written to ``metrics.json`` (every rank returns them; rank 0 writes and prints them, and every optimizer step's
    ``train_loss`` to ``train_losses.json``).

    ``callbacks`` are added to the config's own ``callbacks``. Raises `ConfigError` for a config that cannot run
    -- before any process is launched. What the run prints is also in the job's log file (`run_log`), without
    Lightning's notices (`without_library_notices`). ``SIGUSR1`` to a rank of the run prints every thread's
    Python stack to its stderr (`faulthandler`): what a hung rank is waiting in.
    """
    with run_log(), without_library_notices():
        return _fit(cfg, callbacks)


def _fit(cfg: DictConfig, callbacks: Sequence[L.Callback]) -> Dict[str, Any]:
    """`run` within its log and filters."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cfg = fold_peft(cfg)  # peft=lora: the model's lora argument
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.get("planner") is not None:  # parallel=auto: the planner's layout written into the config
        try:
            cfg, why = choose_layout(cfg)
        except ValueError as err:
            raise ConfigError(f"parallel=auto: {err}") from err
        if int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0:
            log.info(why)
    layout = check(cfg)
    hydra_run = _hydra_run()
    out_dir = hydra_run["out_dir"]
    try:
        resume = checkpoint_to_resume(cfg.ckpt_path, out_dir, hydra_run["job"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    steps = int(cfg.trainer.max_steps)
    throughput = ReplicaThroughputMonitor(window_size=100)  # fewer batches in a shorter run
    losses = TrainLossHistory()
    memory = PeakMemoryMonitor(steps=max(1, min(MEASURED_STEPS, steps)) if steps > 0 else MEASURED_STEPS)

    with fresh_launch_environment():
        L.seed_everything(cfg.seed, verbose=False)  # before anything is built: every rank builds the same model
        model = _build("model", cfg.model)
        data = _build("data", cfg.data)
        _check_vocabulary(model, data)
        strategy = _build("parallel", cfg.parallel)
        extra = [_build(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node is not None]
        report = DataReport()
        saving = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), save_last=True,
                                 every_n_train_steps=int(cfg.checkpoint_every) or None)
        own = [saving, throughput, memory, ValidationPrinter(), losses, report]
        if cfg.trainer.enable_model_summary is not False:
            own.append(model_summary_callback())  # in place of Lightning's, which would count rank 0's shard only
        if cfg.trainer.enable_progress_bar is not False and (bar := progress_bar_callback()) is not None:
            own.append(bar)
        segment = "" if resume is None else f"resumed_{time.strftime('%Y%m%d-%H%M%S')}"  # beside the earlier logs
        trainer = _build(
            "trainer", cfg.trainer, devices=layout["devices"], strategy=strategy,
            logger=_loggers(cfg, out_dir, segment), callbacks=[*own, *extra, *callbacks],
            enable_model_summary=False,  # no summary of Lightning's own
        )
        trainer.fit(model, datamodule=data, ckpt_path=resume)
        launched = take_over_launched_ranks(trainer)

        val = trainer.callback_metrics.get("val_loss")
        rates = throughput.training_rates
        dims = trainer.strategy.parallel_dims
        zero_stage = int(getattr(trainer.strategy, "zero_stage", 0))
        ep = layout_size(trainer.strategy, "ep")
        metrics: Dict[str, Any] = {
            "layout": layout_label(dims, zero_stage, ep),
            "name": hydra_run["name"],
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "overrides": hydra_run["overrides"],
            **layout,
            "world_size": dims.world_size,
            "zero_stage": zero_stage,
            "ep": ep,
            "steps": int(trainer.global_step),
            "val_loss": float(val) if val is not None else None,
            # Lightning's ThroughputMonitor counting model replicas: global = replica rate * dp (no global key at dp=1)
            "tokens_per_s": rates.get("items_per_sec", rates.get("device/items_per_sec")),
            "tokens_per_s_per_replica": rates.get("device/items_per_sec"),
            "mfu": rates.get("device/mfu"),
            **peak_memory_per_rank(memory),
            # the planner's prediction for this layout, beside the measurement
            **predicted_metrics(cfg, layout, model, batch_size=getattr(data, "batch_size", None)),
            "data": report.statistics,
            "resumed_from": resume,
        }
        if trainer.is_global_zero:
            (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
            # Every optimizer step's, from step 1: a resumed run's history comes back with its checkpoint.
            per_step = {"step": losses.steps, losses.metric: losses.values}
            (out_dir / "train_losses.json").write_text(json.dumps(per_step) + "\n")
            log.info(_final_line(metrics, out_dir / "metrics.json"))
    wait_for_launched_ranks(launched)
    return metrics


def _final_line(metrics: Dict[str, Any], path: Path) -> str:
    def fmt(value: Optional[float], spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    mem = "/".join(f"{x:.1f}" for x in metrics["peak_mib_per_rank"])
    mfu = f" mfu={metrics['mfu']:.3f}" if metrics["mfu"] is not None else ""
    return (f"[{metrics['layout']}] final val_loss={fmt(metrics['val_loss'], '.4f')}"
            f" tokens/s={fmt(metrics['tokens_per_s'], '.0f')}{mfu} peak_mib/rank={mem} -> {path}")


# ---------------------------------------------------------------------------------------------- recipes' main
def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    cause = err.__cause__
    if cause is not None and not isinstance(err, ConfigError):
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    return " ".join(lines[:20]) or type(err).__name__


def exit_on_config_error(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` printing a bad config as one ``error: ...`` line on stderr and exiting with code 2 -- also a batch
    the layout cannot train (`BatchError`, found before the ranks start or by rank 0 once they have) and a damaged
    or foreign checkpoint to resume from (`CheckpointError`), and data that cannot train (`DataError`).

    A recipe applies it twice: under ``@hydra.main``, to the task function, for the errors `run` finds (inside
    the job, where Hydra would add a line of its own), and around the Hydra app, for composition errors (a
    typo'd field, an unknown option)::

        @hydra.main(config_path="../configs", config_name="pretrain", version_base="1.3")
        @exit_on_config_error
        def main(cfg): run(cfg)

        if __name__ == "__main__":
            exit_on_config_error(main)()
    """

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # composition errors reach us, not Hydra's report
        try:
            return function(*args, **kwargs)
        except (ConfigError, HydraException, OmegaConfBaseException, BatchError, CheckpointError, DataError) as err:
            print(f"error: {_one_line(err)}", file=sys.stderr, flush=True)
            sys.exit(2)  # SystemExit passes through Hydra's job runner, which handles only `Exception`s

    return wrapped
