"""`StepHooks`: what a dimension does during a step, registered on `lightning_hybrid.parallelize.Parallelized`.

A dimension that must act while the model trains -- split a batch, check something after the first step, let go
of a batch's state after backward -- returns one of these from its ``apply_*`` step; `parallelize` collects them
in ``Parallelized.hooks`` and the strategy calls every registered hook at the same points of Lightning's loop,
naming none. Each method's default does nothing.
"""

from __future__ import annotations

from typing import Any


class StepHooks:
    """The points of a step at which a dimension may act. Errors about the user's data are ``ValueError`` or
    ``TypeError``: the strategy reports them once, from rank 0 (`lightning_hybrid.runtime.rank_zero`)."""

    def on_batch(self, batch: Any, stage: str) -> Any:
        """The batch this rank runs, from the one it read (on its device): ``stage`` is Lightning's
        (``"train"``, ``"validate"``, ``"test"``, ``"predict"``, ``"sanity_check"``)."""
        return batch

    def after_training_step(self) -> None:
        """After each training step's forward (and, under a pipeline schedule, its backward). Collective: every
        rank calls it alike."""

    def after_backward(self) -> None:
        """After each training batch's backward."""
