"""The parity harness: train a LightningModule under HybridStrategy layouts and under one device, and compare
losses, global gradient norms, validation metrics (a torchmetrics metric included) and final weights.

The one-device reference runs in the test process; each world size is one group of spawned ranks that runs
several layouts one after another on the same process group.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data import ByteCorpusDataModule
from tests.helpers import QUIET_TRAINER, Recorder, run_distributed, storage_bytes

STEPS = 10
GLOBAL_BATCH = 8
CLIP = 0.5
BLOCK = 32
RTOL = 1e-5
PARAM_ATOL = 1e-5


class OneDeviceInDistributedOrder(ByteCorpusDataModule):
    """Lightning shuffles the training data of every distributed run with ``DistributedSampler(seed=0)``
    (whatever the DataLoader says). The one-device reference reads the samples in that same order."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def fit_and_record(strategy, devices: int, make_module, dp: int = 1, steps: int = STEPS, **trainer_kwargs) -> dict:
    """Train ``steps`` steps on the stdlib byte corpus; return what the parity checks compare (same on all ranks)."""
    L.seed_everything(0, verbose=False)
    module = make_module()
    data_class = OneDeviceInDistributedOrder if strategy == "auto" else ByteCorpusDataModule
    data = data_class(max_bytes=80_000, block_size=BLOCK, batch_size=GLOBAL_BATCH // dp)
    recorder = Recorder()
    graphs_before, breaks_before = _dynamo_counts()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=CLIP,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[recorder],
        **{"val_check_interval": steps * trainer_kwargs.get("accumulate_grad_batches", 1), **trainer_kwargs},
    )
    trainer.fit(module, data)
    hybrid = isinstance(trainer.strategy, HybridStrategy)
    full = trainer.strategy.full_state_dict() if hybrid else module.state_dict()
    report = trainer.strategy.tensor_parallel_report if hybrid else None
    graphs, breaks = _dynamo_counts()
    return {
        "compiled_graphs": graphs - graphs_before,  # torch.compile's graphs made in this run (0 in eager)
        "graph_breaks": breaks - breaks_before,
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "grad_reductions": getattr(trainer.strategy, "_test_reductions", None),
        "param_bytes": storage_bytes(module.parameters()),
        "val_loss": trainer.callback_metrics["val_loss"].item(),
        "val_acc": trainer.callback_metrics["val_acc"].item(),
        "state": {k: v.cpu() for k, v in full.items()},
        "tp_split": {name: variant.label for name, variant in report.chosen.items()} if report else {},
    }


def _dynamo_counts() -> tuple[int, int]:
    """How many graphs torch.compile has made in this process, and how many graph breaks it met."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class CountingHybridStrategy(HybridStrategy):
    """Counts DP gradient reductions (the real ones run unchanged)."""

    _test_reductions = 0

    def reduce_gradients(self) -> None:
        self._test_reductions += 1
        super().reduce_gradients()


def _fit_runs(runs: dict[str, tuple], steps: int) -> dict[str, dict]:
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for name, (kwargs, make_module, trainer_kwargs, *_) in runs.items():
        dp = kwargs.get("dp", world // (kwargs.get("tp", 1) * kwargs.get("pp", 1)))
        results[name] = fit_and_record(CountingHybridStrategy(**kwargs), world, make_module, dp=dp, steps=steps, **trainer_kwargs)
    return results


def assert_matches(name: str, got: dict, ref: dict, rtol: float = RTOL, param_atol: float = PARAM_ATOL) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0, name
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0, msg=f"{name}: losses")
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=rtol, atol=0, msg=f"{name}: grad norms"
    )
    torch.testing.assert_close(got["val_loss"], ref["val_loss"], rtol=rtol, atol=0, msg=f"{name}: val_loss")
    assert got["val_acc"] == pytest.approx(ref["val_acc"], rel=rtol), f"{name}: val_acc"
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=param_atol, msg=f"{name}: parameter {key}")


def check_world(world: int, runs: dict[str, tuple], steps: int = STEPS, references: dict | None = None) -> list[dict]:
    """``runs``: name -> (strategy kwargs, module factory, trainer kwargs[, (loss/norm rtol, parameter atol)]).
    ``references``: one-device results by run name, computed here for the runs it lacks (and added to it)."""
    references = {} if references is None else references
    for name, (_, make_module, trainer_kwargs, *_) in runs.items():
        if name not in references:
            references[name] = fit_and_record("auto", 1, make_module, steps=steps, **trainer_kwargs)
        assert min(references[name]["grad_norms"]) > CLIP, "clipping must be active for the norm check to mean anything"
    results = run_distributed(_fit_runs, world, runs, steps)
    for rank, per_run in enumerate(results):
        for name, (*_, tolerances) in ((n, (*r, (RTOL, PARAM_ATOL))[:4]) for n, r in runs.items()):
            assert_matches(f"{name} (rank {rank})", per_run[name], references[name], *tolerances)
            assert per_run[name]["grad_reductions"] == steps, f"{name}: one gradient reduction per optimizer step"
            if runs[name][0].get("compile"):  # the layers ran compiled, in whole graphs
                assert per_run[name]["compiled_graphs"] > 0 and per_run[name]["graph_breaks"] == 0, (name, per_run[name])
            else:
                assert per_run[name]["compiled_graphs"] == 0, name
    return results
