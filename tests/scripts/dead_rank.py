"""Run as a script: data-parallel training in which one rank dies (SIGKILLs itself) before its third batch. The
job must end promptly -- the next collective of the others fails: gloo sees the connection closed -- and each
surviving rank prints one line naming the collective, where it was called, and the rank that died.

    python tests/scripts/dead_rank.py [--devices 2] [--dead-rank 1]
"""

import argparse
import os
import signal
import time
from datetime import timedelta

import lightning as L

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule


class Dies(L.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == self.rank and batch_idx == 2:
            os.write(2, f"rank {self.rank}: SIGKILL at {time.time():.3f}\n".encode())  # the test's clock
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dead-rank", type=int, default=1)
    args = parser.parse_args()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=10, callbacks=[Dies(args.dead_rank)],
                        strategy=HybridStrategy(dp=args.devices, timeout=timedelta(seconds=60)), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                        enable_model_summary=False)
    trainer.fit(GPTLightningModule(n_layer=1, n_embd=32), ByteCorpusDataModule(max_bytes=30_000, block_size=32,
                                                                             batch_size=4))
