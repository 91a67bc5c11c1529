"""The data-parallel ranks' samplers (`lightning_hybrid.runtime.sample_order`), on loaders alone: each step's
ranks hold one device's global batch in the loader's order, or training is refused. The runs that train on them
(a user's ``shuffle=False`` loader and a sampler of its own, against one device) are in test_user_code.py and
every parity test, whose one-device references read the same plain loaders."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from lightning_hybrid.runtime.sample_order import SampleOrder, in_loader_order
from tests.user_code import ByLastToken, Pairs, token_rows


def _steps(loaders: list[DataLoader]) -> list[list[int]]:
    """Each step's samples over the ranks (by their first token), sorted."""
    return [sorted(t for batch in step for t in batch[0][:, 0].tolist()) for step in zip(*loaders)]


def _one_device(loader: DataLoader) -> list[list[int]]:
    return [sorted(batch[0][:, 0].tolist()) for batch in loader]


@pytest.mark.parametrize("rows, drop_last", [(64, True), (60, False), (62, True), (63, True)])
@pytest.mark.parametrize("own_order", [False, True])
def test_the_ranks_of_a_step_hold_one_devices_batch(rows, drop_last, own_order):
    data = token_rows(rows)
    data[:, 0] = torch.arange(rows)  # a row's first token names it
    sampler = ByLastToken(data) if own_order else None

    def loader(batch_size: int) -> DataLoader:
        return DataLoader(Pairs(data), batch_size=batch_size, sampler=sampler, drop_last=drop_last)

    for dp in (2, 4):
        ranks = [in_loader_order(loader(3), dp, rank, training=True) for rank in range(dp)]
        assert all(isinstance(r.sampler, DistributedSampler) and r.sampler.rank == i for i, r in enumerate(ranks))
        assert _steps(ranks) == _one_device(loader(3 * dp)), (dp, rows, drop_last)
    alone = loader(3)
    assert in_loader_order(alone, 1, 0, training=True) is alone  # one reader: the loader as it is


def test_a_last_batch_the_ranks_cannot_share_is_refused_in_training_only():
    data = Pairs(token_rows(63))
    loader = DataLoader(data, batch_size=4)
    with pytest.raises(ValueError, match=r"The training loader's 63 samples \(in their order: SequentialSampler\) "
                                         r"do not split over the 2 data-parallel ranks: one device reads the last 7"):
        in_loader_order(loader, 2, 0, training=True)
    assert in_loader_order(loader, 1, 0, training=True) is loader  # one rank reads it all
    evaluation = in_loader_order(loader, 2, 1, training=False)  # as Lightning: the last sample repeated
    assert list(evaluation.sampler) == list(range(1, 63, 2)) + [0]


def test_a_shuffled_loader_gets_lightnings_seeded_sampler_seeded_by_its_generator(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    loader = DataLoader(Pairs(token_rows(20)), batch_size=2, shuffle=True)
    assert isinstance(loader.sampler, RandomSampler)
    sampler = in_loader_order(loader, 2, 1, training=True).sampler
    assert type(sampler) is DistributedSampler and sampler.shuffle and sampler.seed == 7
    assert sampler.num_replicas == 2 and sampler.rank == 1
    # A generator of the loader's own: its seed, so that another seed is another order (as on one device).
    orders = [list(in_loader_order(DataLoader(Pairs(token_rows(20)), batch_size=2, shuffle=True,
                                              generator=torch.Generator().manual_seed(seed)), 2, 0, True).sampler)
              for seed in (3, 4, 3)]
    assert orders[0] == orders[2] != orders[1]


def test_what_lightning_leaves_is_left():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    own = DataLoader(Pairs(token_rows(8)), sampler=DistributedSampler(Pairs(token_rows(8)), num_replicas=1, rank=0))
    for loader in (DataLoader(Stream()), own, [1, 2]):
        assert in_loader_order(loader, 2, 0, training=True) is loader
    # Batches of a sampler of the user's own that Lightning could not rebuild: as they are on one reader...
    buckets = DataLoader(Pairs(token_rows(8)), batch_sampler=[[0, 1], [4, 5], [2, 3]])
    assert in_loader_order(buckets, 1, 0, training=True) is buckets
    with pytest.raises(TypeError, match="can't inject a \\(distributed\\) sampler into your batch sampler"):
        in_loader_order(buckets, 2, 0, training=True)  # ... Lightning's error over several


def test_the_injection_is_taken_while_fitting_and_given_back():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    loader = DataLoader(Pairs(token_rows(8)), batch_size=2)
    trainer.state.fn = "validate"
    order = SampleOrder(trainer)
    assert not order.taken and order.process(loader, 2, 0) is loader
    trainer.state.fn = "fit"
    order = SampleOrder(trainer)
    assert order.taken and trainer._accelerator_connector.use_distributed_sampler is False
    assert order.process(loader, 2, 0).sampler.num_replicas == 2
    order.close()
    assert trainer._accelerator_connector.use_distributed_sampler is True and order.process(loader, 2, 0) is loader
    own = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    use_distributed_sampler=False)
    own.state.fn = "fit"
    assert not SampleOrder(own).taken  # the user splits the data: nothing is injected
