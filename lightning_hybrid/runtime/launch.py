"""The process environment of one run that a recipe starts from inside a Hydra app.

Lightning's subprocess launcher starts ranks 1..N-1 as new processes and leaves ``LOCAL_RANK``,
``MASTER_PORT``, ... in the environment of rank 0; under a multirun, rank 0 is the Hydra process itself, and
the next job would take those variables for processes started by someone else and start no ranks. So each
run goes through `fresh_launch_environment` (its launch variables restored and its process group destroyed
afterwards; under a multirun, its ranks started for this job only), and once the fit has returned rank 0
takes the ranks it started from Lightning's observer and waits for them (`take_over_launched_ranks`,
`wait_for_launched_ranks`), so that nothing outlives a job and no rank's teardown kills the next jobs.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from lightning_hybrid.runtime.multirun_patch import multirun_child_commands

__all__ = ["LAUNCH_ENV", "fresh_launch_environment", "take_over_launched_ranks", "wait_for_launched_ranks"]

#: Variables Lightning's launcher (and ``seed_everything``) set in rank 0's environment.
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED")


@contextmanager
def fresh_launch_environment() -> Iterator[None]:
    """One run = one process group: `LAUNCH_ENV` as it was and no process group after the block; inside a
    Hydra multirun, the launched ranks run this job only (`multirun_child_commands`)."""
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    with ExitStack() as stack:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            stack.enter_context(multirun_child_commands())
        try:
            yield
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def take_over_launched_ranks(trainer) -> list[subprocess.Popen]:
    """On rank 0, once a fit has returned: the rank processes Lightning's launcher started, taken from its
    observer (emptying the launcher's list). While training, that observer rightly kills every process --
    rank 0 included -- when a rank dies; once the run is done, a rank that fails while its interpreter shuts down
    (a user's exit handler, say; gloo's exit race is `lightning_hybrid.runtime.clean_exit`'s) must not kill rank 0,
    which under a multirun is the Hydra process running the next jobs. Empty elsewhere and when the processes
    were started externally (torchrun, SLURM)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    procs = getattr(launcher, "procs", None)
    if not procs:
        return []
    taken = list(procs)
    procs.clear()
    return taken


def wait_for_launched_ranks(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    """Wait for the rank processes ``procs`` (`take_over_launched_ranks`), killing any that hang; a rank that
    ended with an error after the run had finished is reported."""
    for rank, proc in enumerate(procs, start=1):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # a rank that does not exit must not outlive the job
            proc.kill()
            warnings.warn(f"rank {rank} (pid {proc.pid}) had not exited {timeout_s:.0f} s after the run; killed it.",
                          stacklevel=2)
            continue
        if code != 0:
            warnings.warn(f"rank {rank} (pid {proc.pid}) exited with code {code} after the run had finished"
                          " (its results were complete); see its output above.", stacklevel=2)
