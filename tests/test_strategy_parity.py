"""Every DP x TP x ZeRO layout reproduces the one-device run: losses, gradient norms, validation metrics
(a torchmetrics metric included) and final weights, over 10 AdamW steps in fp32 with clipping active.

The one-device reference runs in the test process; each world size is one group of spawned ranks that
runs several layouts one after another on the same process group.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.tensor_parallel import gather_full_state_dict
from tests.helpers import Recorder, run_distributed

STEPS = 10
GLOBAL_BATCH = 8
CLIP = 0.5
RTOL = 1e-5
PARAM_ATOL = 1e-5


def _config(**overrides) -> GPTConfig:
    base = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu", dropout=0.0)
    base.update(overrides)
    return GPTConfig(**base)


class OneDeviceInDistributedOrder(ByteCorpusDataModule):
    """Lightning shuffles the training data of every distributed run with ``DistributedSampler(seed=0)``
    (whatever the DataLoader says). The one-device reference reads the samples in that same order."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def fit_and_record(strategy, devices: int, config: GPTConfig, dp: int = 1, **trainer_kwargs) -> dict:
    """Train STEPS steps on the stdlib byte corpus; return what the parity checks compare (same on all ranks)."""
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=config, lr=5e-4, weight_decay=0.1)
    data_class = OneDeviceInDistributedOrder if strategy == "auto" else ByteCorpusDataModule
    data = data_class(max_bytes=80_000, block_size=config.block_size, batch_size=GLOBAL_BATCH // dp)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        limit_val_batches=2,
        val_check_interval=STEPS,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(module, data)
    full = gather_full_state_dict(module)
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "val_loss": trainer.callback_metrics["val_loss"].item(),
        "val_acc": trainer.callback_metrics["val_acc"].item(),
        "state": {k: v.cpu() for k, v in full.items()},
    }


def _fit_layouts(layouts: dict[str, dict], config: GPTConfig) -> dict[str, dict]:
    world = int(__import__("os").environ["WORLD_SIZE"])
    results = {}
    for name, kwargs in layouts.items():
        strategy = HybridStrategy(**kwargs)
        dp = world // (kwargs.get("tp", 1) * kwargs.get("pp", 1))
        results[name] = fit_and_record(strategy, world, config, dp=dp)
    return results


def assert_matches(name: str, got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == STEPS, name
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0, msg=f"{name}: losses")
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0, msg=f"{name}: grad norms"
    )
    torch.testing.assert_close(got["val_loss"], ref["val_loss"], rtol=RTOL, atol=0, msg=f"{name}: val_loss")
    assert got["val_acc"] == pytest.approx(ref["val_acc"], rel=RTOL), f"{name}: val_acc"
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=PARAM_ATOL, msg=f"{name}: parameter {key}")


@pytest.fixture(scope="module")
def reference():
    ref = fit_and_record("auto", 1, _config())
    assert min(ref["grad_norms"]) > CLIP, "clipping must be active for the norm check to mean anything"
    return ref


@pytest.fixture(scope="module")
def reference_mha():
    return fit_and_record("auto", 1, _config(n_kv_head=4, mlp="gelu"))


WORLD2 = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "dp2-zero1": dict(dp=2, zero_stage=1),
    "dp2-zero2": dict(dp=2, zero_stage=2),
    "dp2-zero3": dict(dp=2, zero_stage=3),
}
WORLD4 = {
    "tp4": dict(tp=4),
    "dp2xtp2": dict(dp=2, tp=2),
    "dp2xtp2-zero1": dict(dp=2, tp=2, zero_stage=1),
    "dp2xtp2-zero2": dict(dp=2, tp=2, zero_stage=2),
    "dp2xtp2-zero3": dict(dp=2, tp=2, zero_stage=3),
}


def test_world2_layouts_match_one_device(reference):
    results = run_distributed(_fit_layouts, 2, WORLD2, _config())
    for name in WORLD2:
        assert_matches(name, results[0][name], reference)
        assert_matches(f"{name} (rank 1)", results[1][name], reference)


def test_world4_layouts_match_one_device(reference_mha):
    results = run_distributed(_fit_layouts, 4, WORLD4, _config(n_kv_head=4, mlp="gelu"))
    for rank_result in results:
        for name in WORLD4:
            assert_matches(name, rank_result[name], reference_mha)
