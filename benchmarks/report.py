"""Every benchmark figure comes from a file the benchmark writes itself: what it printed, under the command that
ran it and the date. Nothing is added to those files by hand; the docs quote them."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent


def header(title: str) -> str:
    """``# title`` and the line saying which command wrote the file, when, and where."""
    import torch

    command = shlex.join(["python", os.path.relpath(sys.argv[0], BENCHMARKS.parent), *sys.argv[1:]])
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"# {title}\n\nWritten by `{command}` on {when} ({platform.machine()}, {os.cpu_count()} CPUs,"
            f" torch {torch.__version__}). Rerun it to refresh this file; nothing here is edited by hand.\n\n")


@contextlib.contextmanager
def printed_to(path: Path, title: str) -> Iterator[None]:
    """What is printed inside goes to the console and, once the block has finished, to ``path`` under `header`."""
    captured = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            captured.write(text)
            return sys.__stdout__.write(text)

        def flush(self) -> None:
            sys.__stdout__.flush()

    with contextlib.redirect_stdout(Tee()):
        yield
    Path(path).write_text(header(title) + captured.getvalue())
    print(f"written to {os.path.relpath(path)}")


def write_report(path: Path, text: str) -> None:
    """Print a benchmark's report ``text`` and write it to ``path`` (the tail every report-writing script shares)."""
    print("\n" + text)
    Path(path).write_text(text)
    print(f"written to {path}")
