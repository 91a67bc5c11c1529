"""The recipes' callbacks, on a one-process fit: Lightning's ThroughputMonitor counting model replicas (samples,
tokens and the model's FLOPs), and the batch helpers it uses. Under dp x tp x pp the replica counting and the
whole-model summary are checked end to end in tests/recipes/test_recipes.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule
from lightning_hybrid.runs.callbacks import ReplicaThroughputMonitor, batch_samples, batch_tokens
from tests.helpers import QUIET_TRAINER


@pytest.mark.parametrize(
    ("batch", "samples", "tokens"),
    [
        ((torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)), 4, 32),
        ({"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16)}, 2, 32),
        ([[torch.zeros(3, 5)], torch.zeros(3)], 3, 3),  # float features: a sample is the unit
        (torch.zeros(6, dtype=torch.long), 6, 6),
    ],
)
def test_batch_samples_and_tokens(batch, samples, tokens):
    assert (batch_samples(batch), batch_tokens(batch)) == (samples, tokens)


def test_throughput_monitor_reports_tokens_and_model_flops():
    module = GPTLightningModule(n_layer=1, n_embd=32, block_size=16)
    monitor = ReplicaThroughputMonitor(window_size=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, callbacks=[monitor],
                        **QUIET_TRAINER)
    trainer.fit(module, ByteCorpusDataModule(max_bytes=20_000, block_size=16, batch_size=2))
    rates = monitor.training_rates
    assert rates["device/items_per_sec"] == pytest.approx(16 * rates["device/samples_per_sec"])  # 16 tokens a sample
    assert rates["device/flops_per_sec"] == pytest.approx(
        module.model.flops_per_token(16) * rates["device/items_per_sec"])
    assert "items_per_sec" not in rates and "device/mfu" not in rates  # one replica; no known peak FLOP/s on CPU
