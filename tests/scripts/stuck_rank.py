"""Run as a script: dp2 training in which rank 1 stops answering (sleeps) before its third batch; the process
group's timeout is 20 s (10 s once met a loaded machine where rank 1 took longer than that to join the rendezvous).
The job must end with rank 0's report naming the collective and rank 1.

    python tests/scripts/stuck_rank.py
"""

import time
from datetime import timedelta

import lightning as L

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule


class Stuck(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx == 2:
            time.sleep(600)


if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=10, callbacks=[Stuck()], logger=False,
                        strategy=HybridStrategy(dp=2, timeout=timedelta(seconds=20)), enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False)
    trainer.fit(GPTLightningModule(n_layer=1, n_embd=32), ByteCorpusDataModule(max_bytes=30_000, block_size=32,
                                                                             batch_size=4))
