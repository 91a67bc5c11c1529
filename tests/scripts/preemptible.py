"""Run as a script: dp2 ZeRO-1 training that prints every step's loss (slowed down, so that a test can send SIGTERM
in the middle), with ``last.ckpt`` saved in ROOT; the corpus is small (epochs of 29 steps), so that a resumed run
crosses into the next epoch.

    python tests/scripts/preemptible.py ROOT STEPS [resume]
"""

import sys
import time

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule


class Losses(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print(f"step {trainer.global_step} loss {trainer.callback_metrics['train_loss'].item()!r}", flush=True)
        time.sleep(0.2)

if __name__ == "__main__":
    root, steps, resume = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, strategy=HybridStrategy(dp=2, zero_stage=1),
                        callbacks=[Losses(), ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=100)],
                        logger=False, enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False)
    data = ByteCorpusDataModule(max_bytes=8_000, block_size=32, batch_size=4)
    trainer.fit(GPTLightningModule(n_layer=2, n_embd=64), data, ckpt_path="last" if resume else None)
    print("done", trainer.global_step, flush=True)
