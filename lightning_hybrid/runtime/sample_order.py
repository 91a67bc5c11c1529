"""One device's sample order for the data-parallel ranks of a run.

Lightning's sampler injection (``Trainer(use_distributed_sampler=True)``, the default) shuffles the training loader
of every distributed run whatever the loader says: a ``DataLoader(shuffle=False)`` and a sampler of the user's own
(a curriculum, an order by length) become ``DistributedSampler(shuffle=True)`` (Lightning issues #10170 and
#21447, open). One device keeps the loader's order, so such a run would train another model with no error. While
a strategy fits, `SampleOrder` takes the injection over: Lightning's is off for the run (its flag is set back at
the end), and `SampleOrder.process` gives each data-parallel rank its share of the loader's own order:

* a ``SequentialSampler`` (``shuffle=False``) or a sampler of the user's own: the rank takes every ``replicas``-th
  index of that order, from its ``rank`` on (``DistributedSampler(shuffle=False)``, a custom sampler through
  Lightning's ``DistributedSamplerWrapper``). A step's ranks then hold exactly the samples one device's batch of
  ``replicas x batch_size`` holds (the global batch); with ``replicas == 1`` the loader stays as it is. The last
  batch of an epoch is one device's too when the loader drops it (``drop_last``: the sampler drops the indices
  that do not fill a share) or when the sampler's length is a multiple of ``replicas``; otherwise the ranks could
  not share it as one device reads it (Lightning would repeat samples into it), and training is refused;
* a ``RandomSampler`` (``shuffle=True``): as Lightning does, ``DistributedSampler(shuffle=True)`` reshuffled by
  Lightning's epoch -- a random order like one device's, not one device's -- seeded by the loader's own generator's
  seed where it has one (``DataLoader(generator=...)``: another seed, another order, as on one device; Lightning
  would ignore it), else by ``PL_GLOBAL_SEED``;
* anything else -- a loader that already has a ``DistributedSampler``, an iterable dataset, not a ``DataLoader`` --
  is left as it is, as Lightning leaves it.

Validation and test loaders (read in order, as Lightning reads them: ``shuffle`` only for a ``RandomSampler``) get
the same samplers, without the refusal. ``trainer.validate``, ``test`` and ``predict`` keep Lightning's injection,
which keeps their order already.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SampleOrder:
    """The sampler injection of one run of ``trainer``: `taken` while fitting with Lightning's own injection on.
    `close` gives Lightning its flag back."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self._trainer = trainer
        self.taken = trainer.state.fn == "fit" and bool(trainer._accelerator_connector.use_distributed_sampler)
        if self.taken:
            trainer._accelerator_connector.use_distributed_sampler = False

    def close(self) -> None:
        if self.taken:
            self._trainer._accelerator_connector.use_distributed_sampler = True
            self.taken = False

    def process(self, dataloader: object, replicas: int, rank: int) -> object:
        """``dataloader`` with this rank's share of its own order (Lightning's rebuild of the loader with a new
        sampler, ``_update_dataloader``, as its injection does); as it is when the injection is not taken."""
        if not self.taken:
            return dataloader
        return in_loader_order(dataloader, replicas, rank, training=self._trainer.training)


def in_loader_order(dataloader: object, replicas: int, rank: int, training: bool) -> object:
    """``dataloader`` rebuilt with rank ``rank`` of ``replicas``'s share of its order (see the module's text);
    ``training``: refuse a last batch the ranks cannot share as one device reads it."""
    from lightning.fabric.utilities.data import has_iterable_dataset
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.utilities.data import _update_dataloader

    if (not isinstance(dataloader, DataLoader) or has_iterable_dataset(dataloader)
            or isinstance(dataloader.sampler, DistributedSampler)):
        return dataloader
    original = dataloader.sampler
    if replicas == 1 and not isinstance(original, RandomSampler):  # one reader: its order is one device's
        return dataloader
    shared: dict[str, Any] = {"num_replicas": replicas, "rank": rank}
    sampler: Sampler
    if isinstance(original, RandomSampler):
        generator = original.generator
        seed = generator.initial_seed() % 2**62 if generator is not None else int(os.getenv("PL_GLOBAL_SEED", 0))
        sampler = DistributedSampler(dataloader.dataset, shuffle=True, seed=seed, **shared)
    else:
        drop_last = bool(dataloader.drop_last) if training else False
        if training:
            _check_last_batch(dataloader, len(original), replicas)  # type: ignore[arg-type]
        if isinstance(original, SequentialSampler):
            sampler = DistributedSampler(dataloader.dataset, shuffle=False, drop_last=drop_last, **shared)
        else:
            sampler = DistributedSamplerWrapper(original, shuffle=False, drop_last=drop_last, **shared)
    return _update_dataloader(dataloader, sampler)


def _check_last_batch(dataloader: DataLoader, length: int, replicas: int) -> None:
    if dataloader.drop_last or length % replicas == 0:
        return
    from lightning_hybrid.runtime.rank_zero import raise_from_rank_zero

    global_batch = replicas * (dataloader.batch_size or 1)
    raise_from_rank_zero(ValueError(
        f"The training loader's {length} samples (in their order: {type(dataloader.sampler).__name__}) do not "
        f"split over the {replicas} data-parallel ranks: one device reads the last {length % global_batch} "
        f"of them as one batch (of the global batch of {global_batch} = {replicas} ranks x batch_size "
        f"{dataloader.batch_size}), which the ranks cannot share alike (Lightning would repeat samples into it). "
        f"Pass drop_last=True to the DataLoader, give it a multiple of {replicas} samples, or split the data "
        "yourself: Trainer(use_distributed_sampler=False) and a loader split by trainer.strategy.dp_rank / dp_size."))
