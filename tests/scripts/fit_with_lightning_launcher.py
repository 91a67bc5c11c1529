"""Run as a script: Lightning's own launcher starts the other ranks (`devices=N` re-runs this file).

    python tests/scripts/fit_with_lightning_launcher.py --devices 2 --tp 2

``--occupy-main-port``: the first process listens on a port itself and names it ``MASTER_PORT``, so that rank 0
cannot create its store there after starting the other ranks (which then connect to a port nobody serves).
``--pp``, ``--micro-batches``, ``--batch-size``: a pipeline layout and the per-rank batch; ``--hidden-batch-size``:
the data comes as a loader whose batch sampler gives that size (nothing says it before the ranks start).
``--busy-worker-at-exit``: after the fit, every rank leaves one of gloo's worker threads busy with a finished
collective (a callback on its future, computing for about a second) as the script ends: what a loaded machine does
to a worker that is descheduled before it has dropped its last work (`lightning_hybrid.runtime.clean_exit`).
"""

import argparse
import os
import socket

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTLightningModule


class Batches:
    """A loader's batches as a plain iterable: nothing says their size before they come."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--occupy-main-port", action="store_true")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--hidden-batch-size", action="store_true")
    parser.add_argument("--busy-worker-at-exit", action="store_true")
    args = parser.parse_args()
    if args.occupy_main_port and "LOCAL_RANK" not in os.environ:
        occupier = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        occupier.bind(("127.0.0.1", 0))
        occupier.listen()
        os.environ["MASTER_PORT"] = str(occupier.getsockname()[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=HybridStrategy(tp=args.tp, pp=args.pp, zero_stage=args.zero_stage, micro_batches=args.micro_batches),
        max_steps=3,
        limit_val_batches=1,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    data = ByteCorpusDataModule(max_bytes=30_000, block_size=32, batch_size=args.batch_size)
    model = GPTLightningModule(n_layer=1, n_embd=32, block_size=32)
    if args.hidden_batch_size:
        data.setup()
        loader = DataLoader(data.train_dataset, batch_size=args.batch_size, drop_last=True)
        trainer.fit(model, train_dataloaders=Batches(loader))
    else:
        trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"world={trainer.world_size} dp={trainer.strategy.parallel_dims.dp}"
              f" tp={trainer.strategy.parallel_dims.tp}"
              f" val_loss={trainer.callback_metrics['val_loss'].item():.4f}")
    if args.busy_worker_at_exit:
        def busy(future):  # runs in the gloo worker that completed the all-reduce; each op releases the GIL
            x = torch.randn(256, 256)
            for _ in range(2000):
                x = torch.tanh(x @ x)
            return future.value()

        done = dist.all_reduce(torch.ones(2**20), group=trainer.strategy.tp_group, async_op=True).get_future()
        done.then(busy)  # added while the all-reduce still runs: its worker thread runs it
        done.wait()  # returns once the value is there, before the worker runs the callbacks
