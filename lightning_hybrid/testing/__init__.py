"""Run a function on N real processes with a process group, the way torchrun starts them.

`run_distributed` is the one multi-process launcher that the tests and the benchmarks share: it starts N
ranks (forked from a fork server that has the heavy imports done) with torchrun's environment variables
(``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``, ...), runs ``fn`` on each, and returns the results by rank. A failure
on any rank stops the others and raises its traceback, so nothing waits on a collective that a failed rank will
never join.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WORKER_TIMEOUT_S", "preload", "run_distributed"]

WORKER_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the fork server imports once, so that every rank it forks starts with them imported (importing
#: Lightning costs several seconds a process; eight ranks on two cores, half a minute a launch). transformers'
#: model machinery (0.6 s a rank) where it is installed: the fork server passes over a module it cannot import.
PRELOAD = ("torch", "torch.distributed", "lightning", "lightning_hybrid", "transformers.modeling_utils")


def preload(*modules: str) -> None:
    """Add ``modules`` to what the fork server imports (a test suite's own helpers, which every rank imports when
    it unpickles its function). Takes effect only before the session's first `run_distributed`, which starts the
    server; a module whose import raises ``ImportError`` there is passed over (and imported by the rank that needs
    it), any other exception stops the server (and every run with it). Importing them must run no torch op: a
    forked rank must not inherit a thread pool."""
    _extra_preload.extend(m for m in modules if m not in _extra_preload)


_extra_preload: list[str] = []


def _context():
    """Ranks are forked from one server process per session that imported `PRELOAD` (and `preload`'s modules)
    and never ran an op (so no thread pool is forked); each rank is a fresh process as with spawn, without paying
    the imports again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_extra_preload])
    return ctx


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, env: dict, one_rank_per_node: bool = False
) -> None:
    # The fork server's environment is that of its start: this call's environment is handed over explicitly.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    if one_rank_per_node:  # rank r is the only process of "node" r: local rank 0, so every rank takes device 0
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank), GROUP_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        # By value (plain pickle): tensors sent through shared memory would die with this process.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except SystemExit:  # left the error to rank 0 (`lightning_hybrid.runtime.rank_zero.raise_from_rank_zero`)
        queue.put((rank, "quiet", traceback.format_exc()))
    except BaseException:  # report every failure to the parent, which stops the other ranks
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, one_rank_per_node: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new rank processes (torchrun-style env); return results by rank.

    If a rank fails, the others are killed and the first traceback is raised: no test hangs on a
    collective that a failed rank will never join.

    ``one_rank_per_node``: each rank is the one process of a "node" of its own (``LOCAL_RANK=0``,
    ``LOCAL_WORLD_SIZE=1``, ``GROUP_RANK=NODE_RANK=RANK``), as torchrun sets it for ``--nnodes N
    --nproc-per-node 1``: with ``Trainer(devices=1, num_nodes=world_size)`` every rank takes device 0, so several
    ranks share one GPU (over gloo: NCCL refuses two ranks on one device).
    """
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # before the fork server starts: it imports torch
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, one_rank_per_node), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        quiet: dict[int, str] = {}  # ranks that left their error to rank 0
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while len(results) + len(quiet) < world_size:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} gave no result") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if status == "quiet":  # rank 0 says why
                quiet[rank] = value
                if len(results) + len(quiet) == world_size:
                    raise RuntimeError(f"rank {rank} exited quietly, and no rank said why:\n{value}")
                continue
            results[rank] = pickle.loads(value)
        if quiet:
            rank, value = next(iter(quiet.items()))
            raise RuntimeError(f"rank {rank} exited quietly, and no rank said why:\n{value}")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
