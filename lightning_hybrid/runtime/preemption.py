"""Preemption: a SIGTERM on any rank stops every rank at the same step boundary, with ``last.ckpt`` saved.

Lightning's own SIGTERM handler broadcasts inside the signal handler, which pairs with whatever collective another
rank is in: a hang or worse. `Preemption` replaces it while a run lasts: the signal only marks this rank; after
every optimizer step the ranks agree (one one-element all-reduce) and, if any was signalled, all stop there --
Lightning's loop raises its ``SIGTERMException`` at the end of the batch on every rank -- and the strategy's
``on_exception`` saves ``last.ckpt`` in the ``ModelCheckpoint``'s folder first.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


class Preemption:
    """The SIGTERM protocol of one strategy (module doc)."""

    def __init__(self) -> None:
        self.signalled = False  # this rank received SIGTERM
        self.stopping = False  # every rank agreed to stop after this step

    def catch(self, scope: ExitStack, rank: int) -> None:
        """While ``scope`` lasts, SIGTERM only marks this rank (after Lightning's handlers are registered: they are,
        once the strategy is set up)."""
        self.signalled = self.stopping = False
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self.signalled = True
            os.write(2, f"[rank {rank}] SIGTERM: stopping after this step\n".encode())

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        scope.callback(signal.signal, signal.SIGTERM, previous)

    def agree(self, trainer: Any, device: torch.device) -> None:
        """After every optimizer step, a consistent point of every rank: if any rank received SIGTERM, all stop
        here. Collective (one one-element all-reduce)."""
        flag = torch.tensor([1 if self.signalled else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and not self.stopping:
            self.stopping = True
            # What Lightning's own handler sets (its loop reads it through `trainer.received_sigterm`, which has
            # no setter): the one private attribute of Lightning written in this package.
            trainer._signal_connector.received_sigterm = True

    def save_on_stop(self, exception: BaseException, trainer: Any, rank: int) -> None:
        """On the ``SIGTERMException`` of a stop every rank agreed on: ``last.ckpt`` saved in the
        ``ModelCheckpoint``'s folder (all ranks, at the same step boundary)."""
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        if isinstance(exception, SIGTERMException) and self.stopping and getattr(checkpoint, "dirpath", None):
            path = os.path.join(checkpoint.dirpath, checkpoint.CHECKPOINT_NAME_LAST + checkpoint.FILE_EXTENSION)
            trainer.save_checkpoint(path)
            os.write(2, f"[rank {rank}] SIGTERM: saved {path} at step {trainer.global_step}\n".encode())
