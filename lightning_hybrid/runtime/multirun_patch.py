"""The one patch of Lightning this package makes: under a Hydra multirun, the ranks Lightning starts for a job
run that job, not the whole sweep.

Lightning's ``_SubprocessScriptLauncher`` starts ranks 1..N-1 of a Hydra app with the command returned by
``lightning.pytorch.strategies.launchers.subprocess_script._hydra_subprocess_cmd(local_rank)`` -- which re-runs
``sys.argv``. Under ``-m`` that is the sweep itself (``-m parallel=dp,tp``), so each rank would start a sweep of
its own. `multirun_child_commands` replaces that module function, for the duration of one job, by
`multirun_child_command`: the job's own overrides in RUN mode, in the job's output folder.

Lightning internals relied on (``tests/strategy/test_multirun_patch.py`` fails if they change): the module attribute
``_hydra_subprocess_cmd``, its signature ``(local_rank) -> (command, cwd)``, and the launcher looking it up
in its module's globals each time it starts the ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch.strategies.launchers.subprocess_script as subprocess_script
from hydra.core.hydra_config import HydraConfig

__all__ = ["multirun_child_command", "multirun_child_commands"]


def multirun_child_command(local_rank: int) -> tuple[list[str], str]:
    """``(command, cwd)`` for rank ``local_rank`` of the current multirun job: this job's overrides
    (``hydra.overrides.task``) in RUN mode, writing into this job's output folder."""
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


@contextmanager
def multirun_child_commands() -> Iterator[None]:
    """Within the block, Lightning's subprocess launcher starts ranks with `multirun_child_command`."""
    original = subprocess_script._hydra_subprocess_cmd
    subprocess_script._hydra_subprocess_cmd = multirun_child_command
    try:
        yield
    finally:
        subprocess_script._hydra_subprocess_cmd = original
