"""Structured configs for the Hydra recipes (``configs/``) and the one function the recipes call.

The YAML tree under ``configs/`` is typed by the dataclasses below, registered in Hydra's ``ConfigStore`` as
``pretrain_schema`` (first entry of ``configs/pretrain.yaml``'s defaults list). A typo'd field -- in a YAML
file of a group or on the command line (``parallel.tpp=2``) -- therefore fails at composition, before
anything runs.

Devices: a layout names ``dp``, ``tp``, ``pp`` explicitly (``dp >= 1``) and ``trainer.devices`` defaults to
``null``, meaning ``dp * tp * pp / num_nodes`` (computed here, in :func:`build_trainer_kwargs`). Setting
``trainer.devices`` explicitly is allowed; then ``dp * tp * pp`` must equal ``devices * num_nodes`` (or
``parallel.dp=-1`` infers dp from it), and a mismatch is a ``ValueError`` raised before any process starts.

:func:`run_pretrain` builds ``GPTLightningModule``, ``ByteCorpusDataModule``, ``HybridStrategy`` and a
``Trainer`` from a composed config, fits, writes ``metrics.json`` into the Hydra output dir and returns the
metrics (on every rank; only rank 0 writes and prints).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import sys
import time
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_hybrid.models.gpt import GPTConfig

__all__ = [
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "PretrainConfig",
    "TrainerConfig",
    "build_trainer_kwargs",
    "register_configs",
    "run_pretrain",
]


# ---------------------------------------------------------------------------------------------- schemas
def _schema_of(config_class: type, name: str) -> type:
    """A plain dataclass with ``config_class``'s fields and defaults, without its ``__post_init__`` (which
    would fill derived values such as ``n_kv_head`` at schema time, before the overrides are applied)."""
    hints = typing.get_type_hints(config_class)
    return make_dataclass(name, [(f.name, hints[f.name], field(default=f.default)) for f in fields(config_class)])


#: Fields of :class:`lightning_hybrid.models.GPTConfig` (one definition: the model's own).
ModelConfig = _schema_of(GPTConfig, "ModelConfig")


@dataclass
class DataConfig:
    """Arguments of :class:`lightning_hybrid.data.ByteCorpusDataModule` (``paths: null`` = stdlib corpus)."""

    paths: Optional[List[str]] = MISSING  # configs/data/stdlib.yaml: null; configs/data/text.yaml: ??? (required)
    block_size: int = 64
    batch_size: int = 8
    val_fraction: float = 0.05
    max_bytes: int = 2_000_000
    num_workers: int = 0
    shuffle: bool = False


@dataclass
class ParallelConfig:
    """Arguments of :class:`lightning_hybrid.HybridStrategy`; ``name`` labels the layout in sweep summaries."""

    name: str = "single"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    tp_plan: Any = "auto"  # "auto" or {glob pattern: colwise | rowwise | replicate}
    micro_batches: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split_points: Optional[List[int]] = None
    activation_checkpointing: Any = False  # true, false, or a glob pattern over module names


@dataclass
class TrainerConfig:
    """The ``lightning.Trainer`` arguments the recipe exposes (``devices: null`` = dp*tp*pp / num_nodes)."""

    accelerator: str = "cpu"
    devices: Optional[int] = None
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 100
    val_check_interval: int = 100
    limit_val_batches: Any = 4  # int (batches) or float (fraction)
    log_every_n_steps: int = 10
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    model_init_seed: int = 0
    max_steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0


def register_configs() -> None:
    """Register the schema (idempotent; done on import of this module)."""
    ConfigStore.instance().store(name="pretrain_schema", node=PretrainConfig)


register_configs()


# ---------------------------------------------------------------------------------------------- building
def _validate(cfg: DictConfig) -> None:
    """Checks that must fail with one clear message before any process is launched."""
    if OmegaConf.is_missing(cfg.data, "paths"):
        raise ValueError("data.paths is required for data=text: pass data.paths=[FILE_OR_DIR,...]")
    for p in cfg.data.paths or []:
        if not Path(p).exists():
            raise FileNotFoundError(f"data.paths: {p!r} does not exist")


def world_layout(cfg: DictConfig) -> Dict[str, int]:
    """``{"devices", "num_nodes", "dp", "tp", "pp"}`` resolved from ``parallel`` and ``trainer``."""
    from lightning_hybrid.mesh import ParallelDims

    par, tr = cfg.parallel, cfg.trainer
    num_nodes = int(tr.num_nodes)
    if tr.devices is None:
        if par.dp < 1:
            raise ValueError(
                f"parallel.dp={par.dp}: with trainer.devices=null the layout must name dp >= 1"
                " (devices = dp*tp*pp); or set trainer.devices to infer dp=-1 from it."
            )
        world = par.dp * par.tp * par.pp
        if world % num_nodes != 0:
            raise ValueError(f"dp*tp*pp = {world} is not divisible by trainer.num_nodes={num_nodes}.")
        devices = world // num_nodes
    else:
        devices = int(tr.devices)
    # Same check (and message) as the strategy's, but now, before processes are launched.
    dims = ParallelDims.resolve(int(par.dp), int(par.tp), int(par.pp), world_size=devices * num_nodes)
    return {"devices": devices, "num_nodes": num_nodes, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp}


def layout_label(cfg: DictConfig, layout: Dict[str, int]) -> str:
    parts = [f"dp{layout['dp']}", f"tp{layout['tp']}"]
    if layout["pp"] > 1:
        parts.append(f"pp{layout['pp']}")
    if cfg.parallel.zero_stage:
        parts.append(f"zero{cfg.parallel.zero_stage}")
    return "x".join(parts)


def build_trainer_kwargs(cfg: DictConfig) -> Dict[str, Any]:
    tr = cfg.trainer
    return dict(
        accelerator=tr.accelerator,
        num_nodes=tr.num_nodes,
        precision=tr.precision,
        max_steps=tr.max_steps,
        val_check_interval=tr.val_check_interval,
        check_val_every_n_epoch=None,  # val_check_interval counts steps across epochs
        limit_val_batches=tr.limit_val_batches,
        log_every_n_steps=tr.log_every_n_steps,
        gradient_clip_val=tr.gradient_clip_val,
        accumulate_grad_batches=tr.accumulate_grad_batches,
        enable_progress_bar=tr.enable_progress_bar,
    )


# ---------------------------------------------------------------------------------------------- measuring
def _throughput_callback(tokens_per_step: int):
    import lightning as L

    class Throughput(L.Callback):
        """Time of the training batches (forward, backward, optimizer) after the first (warm-up) one."""

        def __init__(self) -> None:
            self.steps = 0
            self.seconds = 0.0
            self.all_steps = 0
            self.all_seconds = 0.0
            self._t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            dt = time.perf_counter() - self._t0
            self.all_steps += 1
            self.all_seconds += dt
            if self.all_steps > 1:
                self.steps += 1
                self.seconds += dt

        def tokens_per_s(self) -> float:
            steps, seconds = (self.steps, self.seconds) if self.steps else (self.all_steps, self.all_seconds)
            return tokens_per_step * steps / seconds if seconds > 0 else float("nan")

    return Throughput()


def _loggers(out_dir: Path) -> list:
    """A CSV logger always; TensorBoard too when it is installed."""
    import importlib.util

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = [CSVLogger(save_dir=str(out_dir), name="csv", version="")]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(save_dir=str(out_dir), name="tensorboard", version=""))
    return loggers


def _validation_printer():
    import lightning as L

    class PrintValidation(L.Callback):
        """One line per validation on rank 0, so a run shows its validation loss falling."""

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            val = trainer.callback_metrics.get("val_loss")
            if trainer.is_global_zero and val is not None and not trainer.sanity_checking:
                print(f"step {trainer.global_step}: val_loss={float(val):.4f}", flush=True)

    return PrintValidation()


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux (bytes on macOS). It is the process's peak since it started: under a
    # multirun, rank 0 is the Hydra process itself, so later jobs report at least the earlier jobs' peak.
    per_mib = 1024 * 1024 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib


def _gather_to_all(value: Any) -> List[Any]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


# ---------------------------------------------------------------------------------------------- hydra + launcher
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED")


def _multirun_child_cmd(local_rank: int):
    """Command for rank ``local_rank`` of ONE multirun job: that job's overrides in RUN mode, in its dir.

    Lightning's ``_hydra_subprocess_cmd`` re-runs ``sys.argv``; under ``-m`` that is the whole sweep
    (``-m parallel=dp,tp``), so every child rank would start a sweep of its own. Here the child gets only
    this job's overrides (``hydra.overrides.task``) and this job's output dir.
    """
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


@contextlib.contextmanager
def _fresh_launch_environment() -> Iterator[None]:
    """One job = one process group: launcher env vars restored and the process group destroyed afterwards.

    Lightning's launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/... in ``os.environ``; a second job in the
    same (multirun) process would then believe its processes were created externally and start no ranks.
    """
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    patched = None
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        import lightning.pytorch.strategies.launchers.subprocess_script as launcher_mod

        patched = (launcher_mod, launcher_mod._hydra_subprocess_cmd)
        launcher_mod._hydra_subprocess_cmd = _multirun_child_cmd
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if patched is not None:
            patched[0]._hydra_subprocess_cmd = patched[1]
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _output_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()


def _job_overrides() -> str:
    return " ".join(shlex.quote(o) for o in HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""


# ---------------------------------------------------------------------------------------------- the recipe
def run_pretrain(cfg: DictConfig) -> Dict[str, Any]:
    """Pretrain the reference GPT as ``cfg`` says; returns the metrics also written to ``metrics.json``.

    Raises ``ValueError`` / ``FileNotFoundError`` for a bad config (layout not fitting the world size, missing
    data path, ...) before any process is launched where possible.
    """
    _validate(cfg)
    layout = world_layout(cfg)
    out_dir = _output_dir()

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.data import ByteCorpusDataModule
    from lightning_hybrid.models import GPTLightningModule

    par = cfg.parallel
    tp_plan = OmegaConf.to_container(par.tp_plan) if OmegaConf.is_config(par.tp_plan) else par.tp_plan
    strategy = HybridStrategy(
        dp=int(par.dp),
        tp=int(par.tp),
        pp=int(par.pp),
        zero_stage=int(par.zero_stage),
        tp_plan=tp_plan,
        micro_batches=par.micro_batches,
        schedule=par.schedule,
        virtual_stages=int(par.virtual_stages),
        split_points=list(par.split_points) if par.split_points is not None else None,
        activation_checkpointing=par.activation_checkpointing,
    )
    model = GPTLightningModule(
        config=dict(OmegaConf.to_container(cfg.model, resolve=True)),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        init_seed=cfg.model_init_seed,
    )
    d = cfg.data
    data = ByteCorpusDataModule(
        paths=list(d.paths) if d.paths is not None else None,
        block_size=d.block_size,
        batch_size=d.batch_size,
        val_fraction=d.val_fraction,
        max_bytes=d.max_bytes,
        num_workers=d.num_workers,
        shuffle=d.shuffle,
        seed=cfg.seed,
    )
    tokens_per_step = d.batch_size * d.block_size * layout["dp"] * cfg.trainer.accumulate_grad_batches
    throughput = _throughput_callback(tokens_per_step)

    with _fresh_launch_environment():
        L.seed_everything(cfg.seed, verbose=False)
        trainer = L.Trainer(
            devices=layout["devices"],
            strategy=strategy,
            logger=_loggers(out_dir),
            callbacks=[
                ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), save_last=True),
                throughput,
                _validation_printer(),
            ],
            **build_trainer_kwargs(cfg),
        )
        trainer.fit(model, datamodule=data)
        val = trainer.callback_metrics.get("val_loss")
        peak_rss = _gather_to_all(_peak_rss_mib())
        peak_cuda = None
        import torch

        if trainer.strategy.root_device.type == "cuda":
            peak_cuda = _gather_to_all(torch.cuda.max_memory_allocated(trainer.strategy.root_device) / 2**20)
        metrics: Dict[str, Any] = {
            "layout": layout_label(cfg, layout),
            "name": str(par.name),
            "overrides": _job_overrides(),
            **layout,
            "world_size": layout["devices"] * layout["num_nodes"],
            "zero_stage": int(par.zero_stage),
            "steps": int(trainer.global_step),
            "val_loss": float(val) if val is not None else None,
            "tokens_per_s": throughput.tokens_per_s(),
            "peak_rss_mib_per_rank": [round(x, 1) for x in peak_rss],
            "peak_rss_mib_max": round(max(peak_rss), 1),
        }
        if peak_cuda is not None:
            metrics["peak_cuda_mib_per_rank"] = [round(x, 1) for x in peak_cuda]
        if trainer.is_global_zero:
            (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
            val_s = f"{metrics['val_loss']:.4f}" if metrics["val_loss"] is not None else "n/a"
            mem = "/".join(f"{x:.0f}" for x in metrics["peak_rss_mib_per_rank"])
            print(
                f"[{metrics['layout']}] final val_loss={val_s} tokens/s={metrics['tokens_per_s']:.0f}"
                f" peak_rss_mib/rank={mem} -> {out_dir / 'metrics.json'}",
                flush=True,
            )
        launcher = getattr(trainer.strategy, "launcher", None)
        procs = list(getattr(launcher, "procs", []))
    # Rank 0 waits (after the process group is gone) for the ranks it launched: nothing outlives the job.
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except Exception:  # pragma: no cover
            proc.kill()
    return metrics
