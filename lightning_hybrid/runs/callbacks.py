"""Lightning callbacks of the recipes, each usable with any Trainer:

* `ReplicaThroughputMonitor` -- Lightning's ``ThroughputMonitor`` counting model replicas, so that its rates
  and MFU are right under TP and PP;
* `ParallelModelSummary` / `ParallelRichModelSummary` -- Lightning's model summary reporting the whole
  model's parameters (not rank 0's shard) and each rank's share; `model_summary_callback` picks the one
  Lightning would pick;
* `ValidationPrinter` -- one line per validation on rank 0;
* `TrainLossHistory` -- the module's ``train_loss`` at every optimizer step;
* `DataReport` -- what the data module read, left out and trains on, printed before the first step;
* `StepProgressBar` -- Lightning's rich progress bar without its ``Epoch 0/-2`` under ``max_steps``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, ThroughputMonitor
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import NOT_APPLICABLE, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_hybrid.core.batch import TokenBatch
from lightning_hybrid.core.devices import local_tensor
from lightning_hybrid.core.dims import layout_size
from lightning_hybrid.data.corpus import statistics_line
from lightning_hybrid.parallel.tensor_parallel.layers import tp_shard_specs, unsplit_shape
from lightning_hybrid.strategy import HybridStrategy

log = logging.getLogger(__name__)

__all__ = [
    "DataReport",
    "ParallelModelSummary",
    "ParallelRichModelSummary",
    "ReplicaThroughputMonitor",
    "StepProgressBar",
    "TrainLossHistory",
    "ValidationPrinter",
    "batch_samples",
    "batch_tokens",
    "model_summary_callback",
    "progress_bar_callback",
]


# ---------------------------------------------------------------------------------------------- throughput
def _first_tensor(batch: Any) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, TokenBatch):  # context parallelism's share of a batch
        return batch.input_ids
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return _first_tensor(value)
        except TypeError:
            continue
    raise TypeError(f"no tensor in the batch ({type(batch).__name__})")


def batch_samples(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor (``(x, y)``, ``{"input_ids": ...}``, a tensor, ...)."""
    return _first_tensor(batch).size(0)


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch that are not padding: the ones of its ``attention_mask`` where a dict batch has one (the
    padding of a `TokenBatch`), else the element count of its first tensor when it holds token ids (an integer
    tensor of shape ``(B, T)`` or more), else its samples."""
    mask = batch.padding if isinstance(batch, TokenBatch) else batch.get("attention_mask") \
        if isinstance(batch, dict) else None
    if isinstance(mask, Tensor):
        return int(mask.sum())
    first = _first_tensor(batch)
    return first.numel() if first.dim() >= 2 and not first.is_floating_point() else first.size(0)


class ReplicaThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` with one model replica as its unit.

    Lightning's monitor takes every rank for a device that processes samples of its own and multiplies its
    rates by the world size. Under TP and PP the ``world / dp`` ranks of one model replica process the same
    samples (and under CP each holds ``1 / cp`` of every sequence), so here the per-"device" rates
    (``train|device/...``) are one replica's -- samples, tokens
    (``items``) and FLOPs per second -- the global ones are those times the number of replicas (the
    strategy's ``distributed_sampler_kwargs["num_replicas"]``: ``dp``), and ``device/mfu`` divides a replica's
    FLOP/s by the peak of all its devices. Where a replica is one rank (DDP, one device) this is Lightning's
    monitor unchanged.

    FLOPs come from the LightningModule's ``flops_per_batch`` (training FLOPs of one batch on the whole model;
    `GPTLightningModule` sets it); MFU needs a device whose peak Lightning knows (CUDA). A module without one gets
    the rates without FLOPs and MFU (and no warning of Lightning's that it defines no FLOPs). ``training_rates``
    holds rank 0's training rates over the last ``window_size`` batches once training ends -- over all of them in a
    run of fewer (a short run, the rest of a resumed one) -- (``{}`` before, on other ranks, or when fewer than two
    batches ran). Tokens are those that are not padding (`batch_tokens`).
    """

    def __init__(self, window_size: int = 100) -> None:
        super().__init__(batch_size_fn=batch_samples, length_fn=batch_tokens, window_size=window_size)
        self.training_rates: dict[str, float] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = int(sampler.get("num_replicas", trainer.world_size))
        ranks_per_replica = trainer.world_size // replicas
        cp = layout_size(trainer.strategy, "cp")
        if cp > 1:  # each rank holds 1/cp of every sequence: a replica's batch has cp times its tokens
            self.length_fn = lambda batch: batch_tokens(batch) * cp
        for throughput in self._throughputs.values():  # built by Lightning with world_size = all ranks
            throughput.world_size = replicas
            if throughput.available_flops:
                throughput.available_flops *= ranks_per_replica

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        # A run of fewer batches than the window (a short run, or the rest of a resumed one) would end without
        # rates: its window is the batches it will train.
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        if trainer.max_steps > 0 and 2 <= remaining < self.kwargs.get("window_size", 100):
            old = self._throughputs[RunningStage.TRAINING]
            self._throughputs[RunningStage.TRAINING] = Throughput(
                available_flops=old.available_flops, world_size=old.world_size,
                **{**self.kwargs, "window_size": remaining})
        super().on_train_start(trainer, *args)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        # Decided at the first training batch (a module may set flops_per_batch in on_train_batch_start), as
        # Lightning does -- but without its warning, on every run, that the module has none: then no FLOPs part.
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:  # Lightning's monitor counts on rank 0 only
            self.training_rates = self._throughputs[RunningStage.TRAINING].compute()


# ---------------------------------------------------------------------------------------------- model summary
def _local_numel(p: Tensor) -> int:
    return local_tensor(p).numel()


class ShardedSummary(Summary):
    """Lightning's model summary of a module that ranks hold in pieces: the ``Params`` column and the totals
    count the whole model (TP shards unsplit, every pipeline stage), a ``Params per Device`` column (the name
    Lightning's DeepSpeed summary uses, which its rich table knows) shows this rank's share. Counting is collective
    over the pipeline group (every rank builds the summary)."""

    def __init__(self, model: LightningModule, max_depth: int, strategy: HybridStrategy) -> None:
        super().__init__(model, max_depth)
        specs = tp_shard_specs(model)
        rows = self.layer_names
        whole = torch.zeros(len(rows) + 2, dtype=torch.float64, device="cpu")  # rows..., total, trainable
        self.local_rows = [0] * len(rows)
        for name, p in model.named_parameters():
            full = math.prod(unsplit_shape(name, p, specs))
            for i, row in enumerate(rows):
                if name.startswith(row + "."):
                    whole[i] += full
                    self.local_rows[i] += _local_numel(p)
            whole[-2] += full
            whole[-1] += full if p.requires_grad else 0
        self.local_total = sum(_local_numel(p) for p in model.parameters())
        if dist.is_initialized():  # pipeline stages hold disjoint parameters; TP and DP ranks count the same
            whole = whole.to(strategy.root_device)
            dist.all_reduce(whole, group=strategy.pp_group)
            shares = [torch.zeros((), dtype=torch.float64, device=strategy.root_device)
                      for _ in range(dist.get_world_size())]
            dist.all_gather(shares, torch.tensor(float(self.local_total), dtype=torch.float64,
                                                 device=strategy.root_device))
            self.rank_totals = [int(s.item()) for s in shares]
        else:
            self.rank_totals = [self.local_total]
        self.whole_rows = [int(v) for v in whole[:-2].tolist()]
        self.whole_total, self.whole_trainable = int(whole[-2].item()), int(whole[-1].item())

    @property
    def param_nums(self) -> list[int]:
        return self.whole_rows

    @property
    def total_parameters(self) -> int:
        return self.whole_total

    @property
    def trainable_parameters(self) -> int:
        return self.whole_trainable

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        per_rank = [get_human_readable_count(n) for n in self.local_rows]
        per_rank += [NOT_APPLICABLE] * (len(arrays[0][1]) - len(per_rank))  # an "other params" row
        index = next(i for i, (title, _) in enumerate(arrays) if title == "Params") + 1
        return [*arrays[:index], ("Params per Device", per_rank), *arrays[index:]]

    def rank_share_line(self) -> str:
        """``Params per device: 428 K - 431 K of 1.7 M (8 devices)``."""
        def count(n: int) -> str:
            return get_human_readable_count(n).strip()

        low, high = count(min(self.rank_totals)), count(max(self.rank_totals))
        share = low if low == high else f"{low} - {high}"
        return f"Params per device: {share} of {count(self.whole_total)} ({len(self.rank_totals)} devices)"


class _WholeModelSummary:
    """Mixin for Lightning's model summary callbacks: under `HybridStrategy`, summarise with `ShardedSummary`
    and add the per-rank share after the table."""

    _max_depth: int
    _sharded: Optional[ShardedSummary] = None

    def _summary(self, trainer: Trainer, pl_module: LightningModule) -> Summary:
        if not isinstance(trainer.strategy, HybridStrategy):
            return super()._summary(trainer, pl_module)  # type: ignore[misc]
        self._sharded = ShardedSummary(pl_module, self._max_depth, trainer.strategy)
        return self._sharded

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        if self._sharded is not None:
            rank_zero_info(self._sharded.rank_share_line())


class ParallelModelSummary(_WholeModelSummary, ModelSummary):
    """Lightning's ``ModelSummary`` counting the whole model under `HybridStrategy` (see `ShardedSummary`)."""


class ParallelRichModelSummary(_WholeModelSummary, RichModelSummary):
    """Lightning's ``RichModelSummary`` counting the whole model under `HybridStrategy`."""


def model_summary_callback(max_depth: int = 1) -> ModelSummary:
    """The parallel counterpart of the summary callback Lightning would add itself (rich when installed)."""
    return ParallelRichModelSummary(max_depth) if _RICH_AVAILABLE else ParallelModelSummary(max_depth)


# ---------------------------------------------------------------------------------------------- progress
class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, its epoch shown as ``Epoch 3`` in a run that ``max_steps`` bounds: Lightning
    sets ``max_epochs=-1`` there and its bar shows ``Epoch 3/-2`` (``max_epochs - 1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if (self.trainer.max_epochs or 0) < 0:
            description = description.replace(f"/{self.trainer.max_epochs - 1}", "", 1)
        return description


def progress_bar_callback() -> Optional[Callback]:
    """`StepProgressBar` where Lightning would show its rich bar; ``None`` (Lightning's own, which shows no
    number of epochs) otherwise."""
    return StepProgressBar() if _RICH_AVAILABLE else None


class DataReport(Callback):
    """Before training, the data module's ``statistics()`` -- what it read, left out (why) and cut, the rows and
    tokens it trains on (`lightning_hybrid.data.corpus.statistics_line`) -- as one ``data: ...`` line on rank 0 (logged
    like `ValidationPrinter`'s), kept in ``statistics`` (``metrics.json``'s ``data``). Nothing for a data module
    without ``statistics``."""

    def __init__(self) -> None:
        self.statistics: Optional[dict] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        report = getattr(trainer.datamodule, "statistics", None)
        if stage != "fit" or not callable(report):
            return
        self.statistics = report()
        if trainer.is_global_zero:
            log.info(statistics_line(self.statistics))


class ValidationPrinter(Callback):
    """One line per validation on rank 0, ``step N: val_loss=... val_acc=...`` (every ``val*`` metric), so a
    run shows its validation loss falling whatever its progress bar does. Logged at INFO to this module's logger
    (``lightning_hybrid.runs.callbacks``): the recipes show it on stdout and in the run's log file (`recipe.run_log`);
    under a Trainer of your own, ``logging.basicConfig(level=logging.INFO)`` shows it."""

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        values = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val")}
        if values:
            log.info(f"step {trainer.global_step}: " + " ".join(f"{k}={v:.4f}" for k, v in values.items()))


class TrainLossHistory(Callback):
    """The value the module logs as ``metric`` (``train_loss``) at every optimizer step, on rank 0: ``steps`` (the
    global step each value ends) and ``values`` -- what a logger keeps only every ``log_every_n_steps``. Under
    gradient accumulation a step's value is the one logged by the batch that ends it. Saved in checkpoints: a
    resumed run's history starts at step 1."""

    def __init__(self, metric: str = "train_loss") -> None:
        self.metric = metric
        self.steps: list[int] = []
        self.values: list[float] = []
        self._last_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run counts from its checkpoint's step

    def state_dict(self) -> dict:
        """The history so far, in every checkpoint: a run resumed from one -- after a kill too, before any file was
        written -- has the steps before it."""
        return {"steps": list(self.steps), "values": list(self.values)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps, self.values = list(state_dict.get("steps", [])), list(state_dict.get("values", []))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        stepped, self._last_step = trainer.global_step != self._last_step, trainer.global_step
        value = trainer.callback_metrics.get(self.metric)
        if stepped and value is not None and trainer.is_global_zero:
            self.steps.append(trainer.global_step)
            self.values.append(float(value))
