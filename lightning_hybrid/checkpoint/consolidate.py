"""Consolidation, on one process without a process group: the model's unsplit ``state_dict`` of a checkpoint
(`consolidated_state_dict`, part by part: `model_parts`), written to one file (`consolidate`), or the folder as one
Lightning checkpoint in memory (`lightning_checkpoint`, for ``LightningModule.load_from_checkpoint``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_hybrid.checkpoint.folders import read_meta, verify_files
from lightning_hybrid.checkpoint.load import _read_parts


def model_parts(checkpoint: str | Path, select: Callable[[str], bool] | None = None) -> Iterable[dict[str, Tensor]]:
    """The model's unsplit tensors (LightningModule keys) of a checkpoint, one part at a time (at most a bucket
    each, as saved); with ``select``, only those whose key it accepts are read. Runs on one process, no process
    group."""
    path = Path(checkpoint)
    meta = read_meta(path)
    verify_files(path, meta)
    keys = [f"model/{k}" for k in meta["lightning_hybrid"]["model_shapes"] if select is None or select(k)]
    for part in _read_parts(path, meta, keys, no_dist=True):
        yield {k[len("model/") :]: v for k, v in part.items()}


def consolidated_state_dict(checkpoint: str | Path) -> dict[str, Tensor]:
    """The model's unsplit ``state_dict`` (LightningModule keys) of a checkpoint. Runs on one process, no
    process group."""
    return {k: v for part in model_parts(checkpoint) for k, v in part.items()}


def consolidate(checkpoint: str | Path, out: str | Path) -> dict[str, Tensor]:
    """Write the model's unsplit ``state_dict`` of a checkpoint to the file ``out`` (one process)."""
    plain = consolidated_state_dict(checkpoint)
    torch.save(plain, out)
    return plain


def lightning_checkpoint(path: Any) -> Any:
    """What ``LightningModule.load_from_checkpoint`` reads: for a checkpoint folder written by `HybridStrategy`,
    one Lightning checkpoint in memory (hyper-parameters, Lightning's state and the consolidated weights);
    anything else (a file, a URL, a stream) as it is.

        MyModule.load_from_checkpoint(lightning_checkpoint("checkpoints/last.ckpt"))
    """
    if not (isinstance(path, (str, os.PathLike)) and Path(path).is_dir()):
        return path
    meta = read_meta(path)
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_hybrid"}
    checkpoint["state_dict"] = consolidated_state_dict(path)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return buffer
