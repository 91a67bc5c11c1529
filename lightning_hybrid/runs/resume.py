"""Resuming a recipe run in its own output folder: ``ckpt_path=last`` or ``ckpt_path=<checkpoint or run folder>``.

A recipe's Hydra run folder is chosen by `run_dir`, an OmegaConf resolver (``lightning_hybrid.run_dir``) that the
recipes' ``hydra.run.dir`` calls::

    hydra.run.dir: ${lightning_hybrid.run_dir:${ckpt_path},outputs,${hydra.job.name},outputs/${now:...}/...}

Without ``ckpt_path`` it is the new, time-stamped folder. With ``ckpt_path=last`` it is the run folder under
``outputs`` of the newest ``last.ckpt`` of the same recipe (its ``.hydra/hydra.yaml`` names the job); with a path,
the run folder that holds it (``<run>/checkpoints/<name>.ckpt``, or ``<run>`` itself). The resumed run writes into
that folder -- its checkpoints, ``metrics.json``, ``train_losses.json`` (from step 1: the history is in the
checkpoint), the job's log (appended) -- and its loggers into versions of their own
(``csv/resumed_<date>-<time>``), whose earlier files Lightning's CSV logger would otherwise delete. A multirun
resumes each job from ``last.ckpt`` in its own folder: point it at the sweep to resume with ``hydra.sweep.dir=...``.
`checkpoint_to_resume` finds the checkpoint in the run function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

__all__ = ["RESOLVER", "checkpoint_to_resume", "register_run_dir_resolver", "run_dir"]

#: The resolver's name in the recipes' YAML.
RESOLVER = "lightning_hybrid.run_dir"
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"


def _job_name(folder: Path) -> Optional[str]:
    try:
        return str(OmegaConf.load(folder / ".hydra" / "hydra.yaml").hydra.job.name)
    except Exception:  # noqa: BLE001 -- not a Hydra run folder, or an unreadable one: not a candidate
        return None


def _run_folder_of(path: Path) -> Optional[Path]:
    """The Hydra run folder holding ``path`` (a run folder, or a checkpoint in its ``checkpoints``), if any."""
    for folder in (path, path.parent.parent):
        if (folder / ".hydra").is_dir() and (folder / CHECKPOINTS).is_dir():
            return folder
    return None


def latest_run(root: Path, job_name: str) -> Optional[Path]:
    """The run folder under ``root`` of job ``job_name`` whose ``checkpoints/last.ckpt`` is the newest."""
    if not root.is_dir():
        return None
    found: List[tuple] = []
    for dirpath, dirnames, _ in os.walk(root):
        if CHECKPOINTS in dirnames and LAST in os.listdir(os.path.join(dirpath, CHECKPOINTS)):
            folder = Path(dirpath)
            if _job_name(folder) == job_name:
                found.append((os.path.getmtime(folder / CHECKPOINTS / LAST), str(folder)))
        dirnames[:] = [d for d in dirnames if d not in (CHECKPOINTS, ".hydra")]  # not into checkpoint folders
    return Path(max(found)[1]) if found else None


def run_dir(ckpt_path: Optional[str], root: str, job_name: str, new: str) -> str:
    """The Hydra run folder of a recipe run (see the module docstring): ``new`` unless ``ckpt_path`` resumes an
    earlier run, then that run's folder."""
    if ckpt_path in (None, "", "None", "null"):
        return new
    if ckpt_path == "last":
        found = latest_run(Path(root), job_name)
        return str(found) if found is not None else new  # none: the run function says so, by name
    found = _run_folder_of(Path(ckpt_path).resolve())
    return str(found) if found is not None else new


def register_run_dir_resolver() -> None:
    """Register `run_dir` as ``${lightning_hybrid.run_dir:...}`` (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_dir)


def checkpoint_to_resume(ckpt_path: Optional[str], out_dir: Path, job_name: str,
                         root: str = "outputs") -> Optional[str]:
    """The checkpoint ``Trainer.fit`` resumes from: ``None`` without ``ckpt_path``; for ``last``, ``last.ckpt`` in the
    run's folder (which `run_dir` made the earlier run's); for a run folder its ``last.ckpt``; else the path.
    ``ValueError`` naming what is missing."""
    if ckpt_path in (None, ""):
        return None
    if ckpt_path == "last":
        last = out_dir / CHECKPOINTS / LAST
        if not last.exists():
            raise ValueError(
                f"ckpt_path=last: no checkpoints/{LAST} in {out_dir}, nor in any earlier run of {job_name!r} under"
                f" {root}/ (for a multirun, name the sweep to resume: hydra.sweep.dir=...); start without ckpt_path,"
                " or give ckpt_path=<a checkpoint or a run folder>")
        return str(last)
    path = Path(ckpt_path)
    if path.is_dir() and (path / CHECKPOINTS / LAST).exists():
        return str(path / CHECKPOINTS / LAST)
    if not path.exists():
        raise ValueError(f"ckpt_path={ckpt_path!r} does not exist: give last, a checkpoint (a .ckpt file or folder) or"
                         " a run folder with checkpoints/last.ckpt")
    return str(path)
