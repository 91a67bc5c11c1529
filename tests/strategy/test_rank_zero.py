"""Library warnings from rank 0 only: what the other ranks drop during a run, and what they keep."""

from __future__ import annotations

import warnings

from lightning_hybrid.runtime.rank_zero import library_warnings_from_rank_zero

MODULES = ("lightning.pytorch.utilities._pytree", "torch.nn.modules", "torchvision.io", "my_project.model")


def _shown(rank: int) -> list[str]:
    """The warnings shown on ``rank`` from each of `MODULES` during a run, and from torch after it."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with library_warnings_from_rank_zero(rank):
            for module in MODULES:
                warnings.warn_explicit(module, UserWarning, "file.py", 1, module=module)
        warnings.warn_explicit("after the run", UserWarning, "file.py", 1, module="torch.nn.modules")
    return [str(w.message) for w in seen]


def test_other_ranks_leave_library_warnings_to_rank_zero():
    assert _shown(0) == [*MODULES, "after the run"]
    # torchvision is not torch; the user's own warnings appear on every rank; the filters are restored afterwards.
    assert _shown(1) == ["torchvision.io", "my_project.model", "after the run"]
