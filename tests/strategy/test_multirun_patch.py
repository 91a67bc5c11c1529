"""The one patch of Lightning (`lightning_hybrid.runtime.multirun_patch`): the Lightning internals it relies on, so that
a Lightning release that changes them fails here rather than in a sweep, and its scope. (What it does is
checked end to end by the multirun tests in tests/recipes/test_recipes.py.)"""

from __future__ import annotations

import inspect

import lightning.pytorch.strategies.launchers.subprocess_script as subprocess_script

from lightning_hybrid.runtime.multirun_patch import multirun_child_command, multirun_child_commands


def test_the_lightning_internals_it_relies_on():
    original = subprocess_script._hydra_subprocess_cmd
    assert (list(inspect.signature(original).parameters) == list(inspect.signature(multirun_child_command).parameters)
            == ["local_rank"])
    assert "return command, cwd" in inspect.getsource(original)
    launch = subprocess_script._SubprocessScriptLauncher._call_children_scripts
    # Called by name from the launcher module's globals each time ranks start, with the (command, cwd) result.
    assert "_hydra_subprocess_cmd" in launch.__code__.co_names
    assert "command, cwd = _hydra_subprocess_cmd(local_rank)" in inspect.getsource(launch)


def test_the_patch_lasts_for_the_block_only():
    original = subprocess_script._hydra_subprocess_cmd
    with multirun_child_commands():
        assert subprocess_script._hydra_subprocess_cmd is multirun_child_command
    assert subprocess_script._hydra_subprocess_cmd is original
