"""Run as a script: one run of `bench_long_run.py` (Lightning's own launcher starts the other ranks: ``devices``
re-runs this file). A small GPT under ``HybridStrategy`` for ``--steps`` steps, ``ModelCheckpoint`` every
``--every`` steps (and ``last.ckpt``) in ROOT; every rank appends what it sees to ``RECORD.rank<r>.jsonl``:

  {"step": n, "epoch": e, "batch_idx": i, "loss": "<repr of train_loss as float64>"}   rank 0, every step
  {"step": n, "rss": {...}}       every ``--rss-every`` steps, at the step's end (before its checkpoint is saved)
  {"step": n, "census": {...}}    at the steps ``--census``: Python objects by type, bytes of live tensors
  {"killed_at": n, "time": t}     rank ``--kill-rank``, before it SIGKILLs itself at the end of step ``--kill-at``
  {"done": n}                     the fit returned after n steps

    python benchmarks/long_run_job.py ROOT RECORD --steps 1000 --dp 2 --zero-stage 1 [--resume]
    python benchmarks/long_run_job.py ROOT RECORD --steps 1000 --kill-rank 1 --kill-at 537
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.models import GPTLightningModule  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> dict[str, int]:
    """glibc's heap: ``arena`` bytes obtained with brk/sbrk (main arena + others), ``hblkhd`` in mmap'ed blocks,
    ``uordblks`` in use, ``fordblks`` free inside the heap (fragmentation shows here). Empty if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {name: int(getattr(info, name)) for name in ("arena", "hblkhd", "uordblks", "fordblks")}


def resident() -> dict[str, int]:
    """This process's resident set in KiB (``VmRSS`` and its parts ``RssAnon``, ``RssFile``) and glibc's heap."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
    out = {k: int(v.split()[0]) for k, v in fields.items()}
    out.update({f"malloc_{k}": v // 1024 for k, v in _mallinfo().items()})
    return out


def census() -> dict:
    """Python objects by type (gc-tracked), and the bytes of the distinct storages of the live tensors among them."""
    objects = gc.get_objects()
    counts = collections.Counter(type(o).__qualname__ for o in objects)
    storages = {}
    for o in objects:
        if isinstance(o, torch.Tensor):
            try:
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            except (RuntimeError, NotImplementedError):
                pass
    return {"objects": len(objects), "tensor_bytes": sum(storages.values()), "by_type": dict(counts)}


class Recorder(L.Callback):
    """Appends this rank's losses, resident set and object census to its record file; kills its process where told."""

    def __init__(self, record: str, rss_every: int, census_at: set[int], kill_rank: int, kill_at: int) -> None:
        self.record, self.rss_every, self.census_at = record, rss_every, census_at
        self.kill_rank, self.kill_at = kill_rank, kill_at
        self._file = None

    def _write(self, **entry) -> None:
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def setup(self, trainer, pl_module, stage) -> None:
        self._file = open(f"{self.record}.rank{trainer.global_rank}.jsonl", "a")
        self._write(start=trainer.global_step, pid=os.getpid(), time=time.time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero:
            self._write(step=step, epoch=trainer.current_epoch, batch_idx=batch_idx,
                        loss=repr(float(trainer.callback_metrics["train_loss"])))
        if step % self.rss_every == 0:
            self._write(step=step, rss=resident())
        if step in self.census_at:
            self._write(step=step, census=census())
        if trainer.global_rank == self.kill_rank and step == self.kill_at:
            self._write(killed_at=step, time=time.time())
            os.kill(os.getpid(), signal.SIGKILL)  # hard: no handler, no cleanup, sockets closed by the kernel

    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(done=trainer.global_step, time=time.time())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="checkpoint folder")
    p.add_argument("record", help="record file prefix: RECORD.rank<r>.jsonl")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="ModelCheckpoint(every_n_train_steps=...)")
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--rss-every", type=int, default=10)
    p.add_argument("--census", type=int, nargs="*", default=[], help="steps at which to count objects")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank per step")
    p.add_argument("--max-bytes", type=int, default=110_000, help="corpus size (110,000: an epoch of 408 steps)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    recorder = Recorder(args.record, args.rss_every, set(args.census), args.kill_rank, args.kill_at)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.dp * args.tp * args.pp, max_steps=args.steps,
        strategy=HybridStrategy(dp=args.dp, tp=args.tp, pp=args.pp, zero_stage=args.zero_stage,
                                micro_batches=args.micro_batches),
        callbacks=[recorder, ModelCheckpoint(dirpath=args.root, every_n_train_steps=args.every, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    data = ByteCorpusDataModule(max_bytes=args.max_bytes, block_size=args.block_size, batch_size=args.batch,
                                shuffle=True)
    model = GPTLightningModule(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    trainer.fit(model, data, ckpt_path="last" if args.resume else None)


if __name__ == "__main__":
    main()
