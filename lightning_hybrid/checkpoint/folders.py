"""A checkpoint folder: its files, its atomic commit, and the checks a load runs first.

``meta.pt`` (`META_FILE`) and one ``part-<n>`` folder of DCP shards per part (`_part_dir`); a save writes into a
hidden ``.<name>.partial-<token>`` folder (`PARTIAL_MARK`) that `commit` renames into place. `read_meta` and
`verify_files` (the size and CRC-32 of every file, `_digests`) turn a missing, unfinished, truncated or corrupted
checkpoint into a `CheckpointError` naming it; `remove` deletes a checkpoint.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

META_FILE = "meta.pt"
PARTIAL_MARK = ".partial-"


class CheckpointError(ValueError):
    """A path that is not a whole lightning_hybrid checkpoint, or one of another model."""


def _part_dir(path: Path, part: int) -> Path:
    return path / f"part-{part:04d}"


def commit(partial: Path, path: Path, token: str) -> None:
    """Make the fully written ``partial`` folder the checkpoint ``path`` (replacing an older one)."""
    old = path.parent / f".{path.name}.old-{token}"
    if path.exists():
        path.rename(old)
    partial.rename(path)  # the moment the new checkpoint becomes whole
    if old.exists():
        remove(old)


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def read_meta(path: str | Path, collective: bool = False) -> dict[str, Any]:
    """``meta.pt`` of a whole checkpoint; ``CheckpointError`` naming the path for anything else (``collective``:
    every rank of the process group reads it alike, and rank 0 alone raises, the others exiting quietly)."""
    path = Path(path)
    _raise = _raise_from_rank_zero if collective else _raise_here
    if PARTIAL_MARK in path.name:
        _raise(CheckpointError(f"{path} is a checkpoint whose save did not finish; it cannot be loaded."))
    if not (path.is_dir() and (path / META_FILE).is_file()):
        _raise(CheckpointError(
            f"{path} is not a lightning_hybrid checkpoint: expected a folder written by HybridStrategy"
            f" holding {META_FILE} and DCP shards."
        ))
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or overwritten: unpickling fails in many ways
        _raise(CheckpointError(f"{path / META_FILE} cannot be read ({type(e).__name__}: {e}): the checkpoint is"
                               " damaged; load an earlier one."))
    if not isinstance(meta, dict) or "lightning_hybrid" not in meta:
        _raise(CheckpointError(f"{path / META_FILE} was not written by lightning_hybrid."))
    return meta


# A file's checksum is read in pieces of this size.
_READ_BYTES = 16 * 2**20


def _shard_files(folder: Path) -> list[str]:
    """The checkpoint's files but ``meta.pt``, relative to ``folder``, sorted."""
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() and f.name != META_FILE)


def _digest(file: Path) -> tuple[int, int]:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            crc = zlib.crc32(chunk, crc)
    return file.stat().st_size, crc


def _digests(folder: Path, files: list[str], collective: bool = True) -> dict[str, tuple[int, int]]:
    """``{file: (bytes, CRC-32)}``, each rank reading its share of ``files`` (``collective``, over every rank of
    the process group), or this process all of them."""
    if not (collective and dist.is_available() and dist.is_initialized()):
        return {f: _digest(folder / f) for f in files}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f: _digest(folder / f) for i, f in enumerate(files) if i % world == rank}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {f: d for part in everyone for f, d in part.items()}


def verify_files(path: str | Path, meta: dict[str, Any], collective: bool = False) -> None:
    """``CheckpointError`` naming the first file of the checkpoint at ``path`` that is missing, or whose size or
    CRC-32 is not what the save recorded (checkpoints of before the record: nothing to check). ``collective``:
    over every rank of the process group, each reading its share, rank 0 alone raising; else this process alone."""
    path = Path(path)
    _raise = _raise_from_rank_zero if collective else _raise_here
    recorded = meta["lightning_hybrid"].get("files")
    if recorded is None:
        return
    error = None
    for name, (size, _) in recorded.items():  # cheap, and the same on every rank: before any collective
        file = path / name
        if not file.is_file():
            error = f"{file} is missing: the checkpoint {path} is damaged; load an earlier one."
        elif file.stat().st_size != size:
            error = (f"{file} holds {file.stat().st_size} bytes, its save wrote {size}: the file is truncated or"
                     f" damaged; load an earlier checkpoint than {path}.")
        if error:
            _raise(CheckpointError(error))
    found = _digests(path, sorted(recorded), collective)
    for name, digest in found.items():
        if tuple(digest) != tuple(recorded[name]):
            _raise(CheckpointError(f"{path / name} does not hold what its save wrote (CRC-32 {digest[1]:#010x},"
                                   f" recorded {recorded[name][1]:#010x}): the file is damaged; load an earlier"
                                   f" checkpoint than {path}."))


def _raise_from_rank_zero(error: BaseException) -> None:
    from lightning_hybrid.runtime.rank_zero import raise_from_rank_zero

    raise_from_rank_zero(error)


def _raise_here(error: BaseException) -> None:
    raise error
