"""The text of a corpus: its files -- a folder's text files, in a deterministic order, or by default the Python
standard library's ``*.py`` sources (third-party packages excluded) -- and their bytes joined into one corpus
(`read_corpus`), for the data modules of `lightning_hybrid.data.corpus`. Standard library only."""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from lightning_hybrid.data.record_files import looks_binary

__all__ = ["EXCLUDED_DIRS", "collect_text_files", "corpus_files", "default_corpus_files", "read_corpus"]

PathLike = Union[str, os.PathLike]

#: directory names never descended into by :func:`default_corpus_files`.
EXCLUDED_DIRS: Tuple[str, ...] = ("site-packages", "dist-packages")

_SEPARATOR = b"\n"


def collect_text_files(
    root: PathLike,
    suffixes: Optional[Sequence[str]] = None,
    exclude_dirs: Iterable[str] = (),
    skip_hidden: bool = True,
    skip_binary: bool = True,
) -> List[Path]:
    """List the regular files under ``root``, recursively, in a deterministic order.

    Args:
        root: directory to walk (symlinked directories are not followed).
        suffixes: if given, keep only files whose name ends with one of them (e.g. ``(".py",)``).
        exclude_dirs: directory names that are pruned wherever they occur.
        skip_hidden: skip files and directories whose name starts with ``"."``.
        skip_binary: skip files that look binary (see :func:`looks_binary`).

    Returns:
        The files, sorted by their path relative to ``root`` in posix form.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"path does not exist: {str(root)!r}")
    if not root.is_dir():
        raise NotADirectoryError(f"not a directory: {str(root)!r}")
    excluded = set(exclude_dirs)
    found: List[Tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend into excluded directories.
        dirnames[:] = [
            d for d in dirnames if d not in excluded and not (skip_hidden and d.startswith("."))
        ]
        for name in filenames:
            if skip_hidden and name.startswith("."):
                continue
            if suffixes is not None and not name.endswith(tuple(suffixes)):
                continue
            path = Path(dirpath) / name
            if not path.is_file():
                continue
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    files = [path for _, path in found]
    if skip_binary:
        files = [path for path in files if not looks_binary(path)]
    return files


def default_corpus_files(stdlib: Optional[PathLike] = None) -> List[Path]:
    """The ``*.py`` files of the standard library, without third-party packages.

    Args:
        stdlib: root to walk; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        Files sorted by relative posix path; anything under a ``site-packages`` or
        ``dist-packages`` directory is excluded.
    """
    root = Path(stdlib) if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    return list(_stdlib_files(root))


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    """The standard library's sources do not change while a process runs: listed once per process (the walk and
    its ~1,800 paths took 0.3 s, paid again by every rank of every run)."""
    return tuple(collect_text_files(
        root, suffixes=(".py",), exclude_dirs=EXCLUDED_DIRS, skip_hidden=True, skip_binary=False
    ))


def _concat(files: Iterable[Path], max_bytes: Optional[int]) -> bytes:
    """Concatenate file contents with ``b"\\n"`` separators, truncated to ``max_bytes``."""
    parts: List[bytes] = []
    total = 0
    for path in files:
        if parts:
            parts.append(_SEPARATOR)
            total += len(_SEPARATOR)
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(parts)
    return corpus[:max_bytes] if max_bytes is not None else corpus


def read_corpus(
    paths: Union[None, PathLike, Sequence[PathLike]] = None,
    max_bytes: Optional[int] = 2_000_000,
) -> bytes:
    """Read a text corpus as raw bytes.

    Args:
        paths: ``None`` for the standard-library corpus (:func:`default_corpus_files`);
            otherwise a path or a list of paths. Files are read as they are;
            directories are read recursively via :func:`collect_text_files`
            (hidden and binary-looking files skipped).
        max_bytes: truncate the corpus to this many bytes (``None``: no limit).

    Returns:
        The contents joined with ``b"\\n"``, at most ``max_bytes`` long.

    Raises:
        FileNotFoundError: a given path does not exist (the message names it).
        ValueError: the corpus is empty.
    """
    files = corpus_files(paths)
    corpus = _concat(files, max_bytes)
    if not corpus:
        raise ValueError(f"empty corpus (paths={paths!r}, {len(files)} files)")
    return corpus


def corpus_files(paths: Union[None, PathLike, Sequence[PathLike]] = None) -> List[Path]:
    """The files of a corpus (see `read_corpus`), in the order they are read."""
    if paths is None:
        return default_corpus_files()
    files: List[Path] = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"corpus path does not exist: {str(p)!r}")
        files.extend(collect_text_files(path) if path.is_dir() else [path])
    return files
