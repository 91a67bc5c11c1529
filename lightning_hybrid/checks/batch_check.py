"""The ranks that must train on the same batch have it: a fingerprint of each batch compared within every group
of peers.

Only data-parallel ranks see different samples. The TP ranks of a data-parallel rank, its pipeline stages and its
CP ranks (which split each sequence after reading it whole) must all receive the same batch: a TP group on two
batches trains a model that no single device would, with exit code 0. Lightning's sampler is given the DP size
and rank (`MeshStrategy.distributed_sampler_kwargs`), but users bring their own loaders -- an
``IterableDataset`` split by ``torch.distributed``'s rank, as ``split_dataset_by_node`` and litdata split them, or
a ``DistributedSampler`` left at its defaults -- so `BatchCheck` verifies it: each rank reduces its batch to a
fingerprint on its device (three int64 numbers: the batch's structure and dtypes/shapes, and two position-weighted
sums of its bytes), the ranks all-gather ``(dp_rank, fingerprint)``, and every rank compares the fingerprints of
the ranks that share its data-parallel rank. A difference is one ``BatchError`` on every rank, before the batch is
trained on, naming the ranks and how they are peers. Checked: the first `FIRST` batches of every run, then every
``interval``-th (one all-gather of ``4 x world`` int64 numbers and one host sync per checked batch; the fingerprint
itself reads the batch once on its device).

The mirror mistake, a loader that does not split its data at all (an ``IterableDataset`` that reads the whole
stream on every rank), gives every data-parallel rank the same samples: each would be trained on ``dp`` times
where one device reads ``dp x batch_size`` others. The first training batch of every run is also compared across
the data-parallel ranks (under ``dp > 1`` alone, only it is checked; validation sets smaller than ``dp`` repeat
samples): two of them holding the same batch is a ``BatchError`` too.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten

__all__ = ["FIRST", "BatchCheck", "fingerprint"]

#: Batches checked at the start of every run, before the interval takes over.
FIRST = 3
_MODULI = (65521, 65519)  # two primes below 2**16: position weights that keep every int64 sum exact


def fingerprint(batch: Any, device: torch.device) -> Tensor:
    """``int64[3]`` on ``device``: the batch's structure (containers, keys, each tensor's dtype and shape, other
    leaves' values where they are plain Python values) and two sums of the bytes of its tensors weighted by their
    positions. Equal batches give equal fingerprints on any device; a batch that differs in any byte almost surely
    not. No host sync."""
    leaves, spec = tree_flatten(batch)
    described = [str(spec)]
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            described.append(f"{leaf.dtype}{tuple(leaf.shape)}")
            data = leaf.detach().contiguous().reshape(-1).view(torch.uint8).to(device=device, dtype=torch.int64)
            places = torch.arange(data.numel(), device=device, dtype=torch.int64)
            for j, modulus in enumerate(_MODULI):  # bytes < 2**8, weights < 2**16 + i: exact below 2**39 bytes
                sums[j] += (data * (places % modulus + 1 + i)).sum()
        elif leaf is None or isinstance(leaf, (bool, int, float, str, bytes)):
            described.append(repr(leaf))
        else:  # its repr may hold an address: its type is what ranks can compare
            described.append(type(leaf).__qualname__)
    structure = torch.tensor([zlib.crc32("|".join(described).encode())], dtype=torch.int64, device=device)
    return torch.cat([structure, sums])


class BatchCheck:
    """Compares the batches of the ranks that share a data-parallel rank (see the module doc). ``coordinates``:
    every global rank's ``(pp, dp, cp, tp)`` place in the mesh (to say how two ranks are peers); ``interval``: after
    the first `FIRST` batches, every ``interval``-th batch is checked. Collective over the world at the batches it
    checks, so every rank must call `check` for every batch alike."""

    def __init__(self, dp_rank: int, coordinates: list[tuple[int, int, int, int]], device: torch.device,
                 interval: int) -> None:
        self.dp_rank, self.coordinates, self.device, self.interval = dp_rank, coordinates, device, interval
        self.peers = any(c[0] or c[2] or c[3] for c in coordinates)  # ranks that share a batch (pp, cp, tp)
        self.seen = 0
        self.repeats_checked = False  # the first training batch compared across the data-parallel ranks

    def _periodic(self) -> bool:
        """Whether the next batch is one compared with its peers (none without peers)."""
        return self.peers and (self.seen < FIRST or (self.seen - FIRST + 1) % self.interval == 0)

    def check(self, batch: Any, what: str, training: bool = True) -> None:
        """Compare this batch (``what``: e.g. "training batch 3", for the message) with the peers' when it is
        due (and, the first training batch, across the data-parallel ranks); `lightning_hybrid.runtime.rank_zero.
        BatchError` on every rank where any two peers differ or two data-parallel ranks hold the same batch."""
        repeats = training and not self.repeats_checked  # the first training batch: across the DP ranks too
        due = repeats or self._periodic()
        self.repeats_checked = self.repeats_checked or training
        self.seen += 1
        if not due:
            return
        mine = torch.cat([torch.tensor([self.dp_rank], dtype=torch.int64, device=self.device),
                          fingerprint(batch, self.device)])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        rows = [tuple(int(v) for v in row.tolist()) for row in gathered]
        message = self._differences(rows, what) or (self._repeated(rows, what) if repeats else None)
        if message is not None:
            from lightning_hybrid.runtime.rank_zero import BatchError, raise_from_rank_zero

            raise_from_rank_zero(BatchError(message))

    def _differences(self, rows: list[tuple[int, ...]], what: str) -> str | None:
        by_dp: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_dp.setdefault(row[0], []).append(rank)
        for dp_rank, ranks in sorted(by_dp.items()):
            first = ranks[0]
            other = [r for r in ranks if rows[r][1:] != rows[first][1:]]
            if other:
                how = self._peers(first, other[0])
                return (
                    f"The ranks that must train on the same batch got different ones ({what}): ranks {ranks} all hold"
                    f" data-parallel rank {dp_rank}, and rank {other[0]}'s batch differs from rank {first}'s"
                    f" ({how}; ranks that differ: {other}). Only data-parallel ranks may see other samples: a loader"
                    " split by torch.distributed's rank and world size (split_dataset_by_node, litdata, a"
                    " DistributedSampler left at its defaults) gives each of those ranks other samples. Split by"
                    " trainer.strategy.dp_rank and trainer.strategy.dp_size instead (docs/data.md)."
                )
        return None

    def _repeated(self, rows: list[tuple[int, ...]], what: str) -> str | None:
        """Two data-parallel ranks holding the same batch (their peers agree: `_differences` first)."""
        holder: dict[tuple[int, ...], int] = {}
        for rank, row in enumerate(rows):
            first = holder.setdefault(row[1:], rank)
            if rows[first][0] != row[0]:
                size = len({r[0] for r in rows})
                return (
                    f"The data-parallel ranks got the same batch ({what}): rank {first} (data-parallel rank"
                    f" {rows[first][0]}) and rank {rank} (data-parallel rank {row[0]}) hold identical batches. With"
                    f" dp={size} one device's batch is the {size} ranks' batches together: the same samples on each"
                    f" would be trained on {size} times where one device reads {size} x batch_size others. A loader"
                    " that does not split its data (an IterableDataset that reads the whole stream on every rank, a"
                    " sampler of its own that ignores the rank) gives every rank the same samples. Split it by"
                    " trainer.strategy.dp_rank and trainer.strategy.dp_size (docs/data.md)."
                )
        return None

    def _peers(self, a: int, b: int) -> str:
        names = ("pipeline stage", "data-parallel", "context-parallel", "tensor-parallel")
        differ = [name for name, x, y in zip(names, self.coordinates[a], self.coordinates[b]) if x != y and name
                  != "data-parallel"]
        return f"they differ as {' and '.join(differ)} peers" if differ else "peers"
