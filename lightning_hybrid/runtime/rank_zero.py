"""Warnings of the libraries under a run (torch, Lightning, ...) shown once, by rank 0; errors every rank finds
alike raised by rank 0 alone (`raise_from_rank_zero`).

Library code runs the same way on every rank, so a warning it raises (a deprecation inside Lightning's data
loading, say) would be printed once per rank: eight copies under ``dp2 x tp2 x pp2``. During a run the other
ranks leave those to rank 0, as Lightning's own ``rank_zero_warn`` does for its messages. Only warnings
attributed to the libraries below are filtered, only on ranks other than 0, and only until the run ends:
warnings from the user's code still appear on every rank that raises them.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LIBRARIES", "BatchError", "library_warnings_from_rank_zero", "raise_from_rank_zero"]

#: Top-level packages whose warnings are shown by rank 0 only (`warnings` matches the module a warning is
#: attributed to, i.e. the caller at the warning's ``stacklevel``).
LIBRARIES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics",
             "transformers", "lightning_hybrid")


@contextmanager
def library_warnings_from_rank_zero(rank: int) -> Iterator[None]:
    """Within the block, on ``rank > 0``, ignore warnings attributed to `LIBRARIES` (the warnings filters of
    before the block are restored on exit: ``warnings.catch_warnings``). Rank 0 is left as it is."""
    if rank == 0:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="(" + "|".join(re.escape(name) for name in LIBRARIES) + r")(\.|$)")
        yield


class BatchError(ValueError):
    """A batch the layout cannot train (e.g. one that does not split into the pipeline's micro-batches), found
    alike on every rank once the data reaches them. The recipes print it as one ``error:`` line."""


def raise_from_rank_zero(error: BaseException) -> None:
    """Raise ``error`` on global rank 0; on the other ranks, which found the same error at the same point, exit
    quietly with code 1 (``SystemExit``: Lightning tears the run down as for any exception, without a traceback),
    so that the run prints one message instead of one traceback per rank. Only for errors every rank finds alike:
    an error one rank alone finds must be raised there (`raise` as usual)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        sys.stderr.flush()
        raise SystemExit(1) from error
    raise error
