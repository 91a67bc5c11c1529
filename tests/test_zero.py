"""Per-rank memory of parameters, gradients and optimizer state follows the ZeRO partitioning, measured from
real tensor storage after one AdamW step, on top of the 1/tp that tensor parallelism gives (dp2 x tp2)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.tensor_parallel import tp_sharded_parameter_names
from lightning_hybrid.zero import ZeroOptimizer
from tests.helpers import QUIET_TRAINER, run_distributed, storage_bytes

DP, TP = 2, 2
# (params, grads, optimizer state) in units of the TP-local model size; AdamW keeps two moments.
EXPECTED = {
    0: (1.0, 1.0, 2.0),
    1: (1.0, 1.0, 2.0 / DP),
    2: (1.0, 1.0 / DP, 2.0 / DP),
    3: (1.0 / DP, 1.0 / DP, 2.0 / DP),
}


class MeasureAfterFirstStep(L.Callback):
    def __init__(self) -> None:
        self.measured: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = list(pl_module.parameters())
        grads = [p.grad for p in params]
        states = []
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, ZeroOptimizer):
                grads += [g for g, _ in optimizer.grad_shards()]
            states += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
        sharded = tp_sharded_parameter_names(pl_module)
        # A ZeRO-3 DTensor's global shape is the TP-local one: numel() is the TP-local size in every stage.
        tp_local_bytes = sum(p.numel() * p.element_size() for p in params)
        self.measured = {
            "params": storage_bytes(params),
            "grads": storage_bytes(grads),
            "optim": storage_bytes(states),
            "tp_local_model": tp_local_bytes,
            "sharded_names": len(sharded),
        }


def _measure_all_stages() -> dict[int, dict]:
    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for stage in EXPECTED:
        L.seed_everything(0, verbose=False)
        config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, mlp="swiglu")
        module = GPTLightningModule(config=config)
        measure = MeasureAfterFirstStep()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=HybridStrategy(dp=DP, tp=TP, zero_stage=stage),
            max_steps=1,
            limit_val_batches=0,
            **QUIET_TRAINER,
            callbacks=[measure],
        )
        trainer.fit(module, ByteCorpusDataModule(max_bytes=40_000, block_size=32, batch_size=2))
        out[stage] = measure.measured
    return out


def test_zero_memory_follows_partitioning():
    results = run_distributed(_measure_all_stages, DP * TP)
    one_device = GPTLightningModule(config=GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, mlp="swiglu"))
    one_device.configure_model()
    full_bytes = sum(p.numel() * 4 for p in one_device.parameters())
    for rank, per_stage in enumerate(results):
        for stage, (params, grads, optim) in EXPECTED.items():
            m = per_stage[stage]
            unit = m["tp_local_model"]
            assert m["sharded_names"] > 0
            # TP alone: the local model is well below the full one (only norms/pos-emb/row biases replicate).
            assert unit < 0.6 * full_bytes, (rank, stage, unit, full_bytes)
            for what, expected in (("params", params), ("grads", grads), ("optim", optim)):
                assert m[what] == pytest.approx(expected * unit, rel=0.05), (rank, stage, what, m[what] / unit, expected)
