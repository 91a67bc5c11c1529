"""On a CUDA device (skipped without one): the reference GPT trains in bf16-mixed through `HybridStrategy`, and
the live-tensor peak of `PeakMemoryMonitor` agrees with ``torch.cuda.max_memory_allocated`` over the same steps
(the allocator rounds blocks up and keeps library workspaces, so it can only be higher)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data import ByteCorpusDataModule
from lightning_hybrid.memory import PeakMemoryMonitor
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from tests.helpers import QUIET_TRAINER

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_on_one_gpu_and_peak_memory_against_the_allocator():
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, mlp="swiglu"))
    memory = PeakMemoryMonitor(steps=3)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", strategy=HybridStrategy(), max_steps=5,
                        limit_val_batches=0, callbacks=[memory], **QUIET_TRAINER)
    trainer.fit(module, ByteCorpusDataModule(max_bytes=200_000, block_size=128, batch_size=4))
    params = sum(p.numel() for p in module.parameters())
    states = sum(memory.peak.breakdown[k] for k in ("parameters", "gradients", "optimizer_state"))
    # fp32 master weights and Adam's two moments, and the gradients as far as backward has made them at the peak.
    assert 12 * params * 0.95 <= states <= 16 * params * 1.1
    assert 0.5 * memory.peak.cuda_max_allocated <= memory.peak.total <= 1.02 * memory.peak.cuda_max_allocated
