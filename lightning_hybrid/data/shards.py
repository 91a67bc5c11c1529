"""Pretraining from prepared token shards: corpora of any size, streamed from disk, split by the data-parallel rank.

A prepared folder (written by ``python -m lightning_hybrid.data.prepare``, `lightning_hybrid.data.prepare`) holds, per
split (``train``, ``val``), shard files of raw little-endian token ids -- ``train-00000.bin``, ... -- the format of
nanoGPT, litgpt's and Megatron's ``.bin``: ``numpy.memmap(path, dtype=numpy.uint16)`` reads one -- and
``index.json``: the token dtype (``uint16`` up to 65,536 ids, else ``uint32``), the end-of-text id written after
every document, the tokenizer and its vocabulary, each shard's tokens and documents, and what the preparation read
and left out. A split is one token sequence: its shards in order.

`ShardsDataModule` trains on non-overlapping windows of it: window ``i`` is ``x = tokens[i*T : i*T + T]`` and
``y = tokens[i*T + 1 : i*T + T + 1]``. A window is read with one ``pread`` per shard it touches, nothing is mapped
or cached: a rank's memory does not grow with the corpus, nor over a run. The order is a seeded pseudo-random
permutation computed index by index (`IndexPermutation`), never materialised, and the windows are dealt to the
data-parallel ranks only (`ShardSampler`: the ranks of one model replica -- TP, PP and CP peers -- read the same
batch). Resuming mid-epoch continues at the next batch of the same order (`lightning_hybrid.data.corpus.DataPosition`).

With ``within_documents=True`` the batches are dicts with ``position_ids`` restarting after every end-of-text
token (Megatron's ``reset_position_ids``): the models then attend within each document, and the end-of-text token's
own target -- the next document's first token -- takes no loss (``labels`` -100), as in packed fine-tuning data
(`lightning_hybrid.core.batch`).

Shape legend: ``T`` = ``block_size``, ``B`` = ``batch_size``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_hybrid.core.batch import IGNORE_INDEX
from lightning_hybrid.data.corpus import DataError, DataPosition, ResumableDataLoader
from lightning_hybrid.data.prepare import FORMAT, INDEX_FILE, token_dtype
from lightning_hybrid.runtime.rank_zero import raise_from_rank_zero

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "IndexPermutation",
    "ShardSampler",
    "ShardsDataModule",
    "TokenSplit",
    "TokenWindows",
    "read_index",
    "token_dtype",
]

PathLike = Union[str, os.PathLike]

#: The token dtypes of shard files, by name: ``(torch dtype, bytes per token)``.
DTYPES: Dict[str, Tuple[torch.dtype, int]] = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4)}


def read_index(folder: PathLike) -> Dict[str, Any]:
    """The ``index.json`` of a prepared folder; `DataError` naming the folder where it is not one (no index, an
    unfinished preparation, another format) or a shard is missing or of the wrong size."""
    folder = Path(folder)
    path = folder / INDEX_FILE
    if not folder.is_dir():
        raise DataError(f"data.path={str(folder)!r} is not a folder: give the folder `python -m"
                        " lightning_hybrid.data.prepare SOURCES --out FOLDER` wrote")
    if not path.is_file():
        raise DataError(f"data.path={str(folder)!r} has no {INDEX_FILE}: not a prepared folder, or its preparation did"
                        " not finish (prepare writes the index last); run `python -m lightning_hybrid.data.prepare"
                        f" SOURCES --out {folder}`")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg})") from None
    if index.get("format") != FORMAT or index.get("dtype") not in DTYPES:
        raise DataError(f"{path}: not an index of {FORMAT} (format={index.get('format')!r},"
                        f" dtype={index.get('dtype')!r}; valid dtypes {list(DTYPES)})")
    width = DTYPES[index["dtype"]][1]
    for entry in index["splits"].values():
        for shard in entry["shards"]:
            file = folder / shard["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != shard["tokens"] * width:
                found = "missing" if size is None else f"{size} bytes"
                raise DataError(f"{file}: {found}, but {INDEX_FILE} says {shard['tokens']} tokens of {index['dtype']}"
                                f" ({shard['tokens'] * width} bytes): the folder was changed after its preparation;"
                                " prepare it again")
    return index


class TokenSplit:
    """One split of a prepared folder as a single token sequence (its shards in order), read with ``os.pread``.

    Files are opened at the first read in each process (a DataLoader worker opens its own) and nothing is cached:
    `read` costs one system call per shard it touches, and memory stays that of the tokens read.
    """

    def __init__(self, folder: PathLike, split: str, index: Optional[Dict[str, Any]] = None) -> None:
        self.folder = Path(folder)
        index = read_index(folder) if index is None else index
        if split not in index["splits"]:
            raise DataError(f"{self.folder}: no split {split!r} (it has {sorted(index['splits'])})")
        self.dtype, self.width = DTYPES[index["dtype"]]
        shards = index["splits"][split]["shards"]
        self.files = [self.folder / shard["file"] for shard in shards]
        self.starts = [0]
        for shard in shards:
            self.starts.append(self.starts[-1] + int(shard["tokens"]))
        self._fds: Dict[int, int] = {}
        self._pid: Optional[int] = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> Dict[str, Any]:  # a worker process opens its own files
        return {**self.__dict__, "_fds": {}, "_pid": None}

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                os.close(fd)

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # opened in another process (a fork): not ours to use
            self._fds, self._pid = {}, os.getpid()
        if shard not in self._fds:
            self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        return self._fds[shard]

    def read(self, start: int, stop: int) -> Tensor:
        """Tokens ``[start, stop)`` as an int64 tensor ``(stop - start,)`` on the CPU."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside [0, {len(self)})")
        parts: List[bytes] = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            end = min(stop, self.starts[shard + 1])
            offset, count = (start - self.starts[shard]) * self.width, (end - start) * self.width
            data = os.pread(self._fd(shard), count, offset)
            if len(data) != count:
                raise DataError(f"{self.files[shard]}: read {len(data)} of {count} bytes at {offset}: the shard is"
                                " shorter than its index says; prepare the folder again")
            parts.append(data)
            start, shard = end, shard + 1
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if not data:
            return torch.empty(0, dtype=torch.int64, device="cpu")
        return torch.frombuffer(bytearray(data), dtype=self.dtype).to(torch.int64)


class TokenWindows(Dataset):
    """Non-overlapping next-token windows of a `TokenSplit`: item ``i`` is ``(x, y)``, ``LongTensor (T,)`` each,
    ``x = tokens[i*T : i*T + T]``, ``y`` the same shifted by one; ``len = (len(tokens) - 1) // T``.

    With ``eot_id`` (within documents) an item is a dict of ``input_ids``, ``labels`` and ``position_ids``, the
    positions restarting after each end-of-text token and the end-of-text token's label -100.
    """

    def __init__(self, tokens: TokenSplit, block_size: int, eot_id: Optional[int] = None) -> None:
        self.tokens, self.block_size, self.eot_id = tokens, block_size, eot_id

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> Union[Tuple[Tensor, Tensor], Dict[str, Tensor]]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.block_size
        window = self.tokens.read(start, start + self.block_size + 1)  # (T + 1,)
        x, y = window[:-1], window[1:]
        if self.eot_id is None:
            return x, y
        return {"input_ids": x, "labels": y.masked_fill(x == self.eot_id, IGNORE_INDEX),
                "position_ids": document_positions(x, self.eot_id)}


def document_positions(x: Tensor, eot_id: int) -> Tensor:
    """Each token's position in its document, ``(T,)``: 0 at the window's first token and after every ``eot_id``
    (which ends its document), +1 otherwise."""
    index = torch.arange(len(x), device=x.device)
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[0] = True
    starts[1:] = x[:-1] == eot_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(0).values  # each token's document start
    return index - first


# ---------------------------------------------------------------------------------------------- order
class IndexPermutation:
    """A pseudo-random permutation of ``range(n)`` computed one index at a time, in O(1) memory: a 4-round Feistel
    network over the smallest even power of two >= ``n``, its round keys from ``seed``, walking the cycle until the
    value falls in ``range(n)`` (at most 4 rounds on average). ``perm(i)`` for ``i`` in ``range(n)`` takes each
    value of ``range(n)`` once; ``torch.randperm`` would hold ``n`` indices (and the sampler's list of them
    several times more), which a corpus of a billion windows cannot afford on every rank."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"n must be positive, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        digest = hashlib.blake2b(str(seed).encode(), digest_size=8 * self.ROUNDS).digest()
        self.keys = [int.from_bytes(digest[8 * r: 8 * r + 8], "little") for r in range(self.ROUNDS)]

    def _round(self, value: int, key: int) -> int:
        z = (value + key) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finaliser: every input bit moves every output bit
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) & self.mask

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside range({self.n})")
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ self._round(right, key)
            x = (left << self.half) | right
            if x < self.n:
                return x


class ShardSampler(DistributedSampler):
    """The windows of one data-parallel rank: ``torch``'s ``DistributedSampler`` (same split: the first
    ``num_replicas * (n // num_replicas)`` entries of the epoch's order, rank ``r`` taking every ``num_replicas``-th
    from ``r``; the rest left out, ``drop_last``), its order an `IndexPermutation` of ``seed + epoch`` made index by
    index instead of a list of ``n``. A ``DistributedSampler``, so Lightning keeps it (it would otherwise replace
    the loader's sampler with one over the world's ranks) and calls ``set_epoch`` on it every epoch.

    ``num_replicas`` and ``rank`` are the data-parallel size and rank (``strategy.distributed_sampler_kwargs``),
    not the world's: the ranks of one model replica read the same windows.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        if len(dataset) < num_replicas:
            raise DataError(f"{len(dataset)} windows cannot give each of {num_replicas} data-parallel ranks one")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        order = IndexPermutation(n, self.seed + self.epoch) if self.shuffle else (lambda i: i)
        for k in range(self.rank, self.num_samples * self.num_replicas, self.num_replicas):
            yield order(k)


# ---------------------------------------------------------------------------------------------- data module
class ShardsDataModule(DataPosition, L.LightningDataModule):
    """Pretraining on a prepared folder (see the module docstring): windows of ``block_size`` tokens, each
    data-parallel rank its own, streamed from disk; exact mid-epoch resume.

    Args:
        path: the folder ``python -m lightning_hybrid.data.prepare ... --out FOLDER`` wrote.
        block_size: sequence length ``T`` of each sample.
        batch_size: per-process batch size ``B`` (each data-parallel rank's).
        shuffle: a new seeded order of the training windows every epoch; ``False``: in order.
        seed: seed of the order (epoch ``e`` uses ``seed + e``).
        within_documents: dict batches with ``position_ids`` restarting at every document (attention within
            documents); ``False``: ``(x, y)`` pairs, attention across the window as in nanoGPT.
        num_workers: DataLoader workers.

    Attributes after construction: ``vocab_size`` (the tokenizer's), ``max_token_id``, ``eot_id``, ``index`` (the
    folder's ``index.json``). The validation (and test) split is the folder's ``val`` split, in order.
    """

    def __init__(
        self,
        path: PathLike,
        block_size: int = 1024,
        batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        within_documents: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size <= 0 or batch_size <= 0:
            raise ValueError(f"block_size and batch_size must be positive, got {block_size}, {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.path = Path(path)
        self.index = read_index(self.path)  # here, before any process starts: one error, not one per rank
        self.block_size, self.batch_size = block_size, batch_size
        self.shuffle, self.seed, self.within_documents = shuffle, seed, within_documents
        self.num_workers = num_workers
        self.vocab_size = int(self.index["vocab_size"])
        self.max_token_id = int(self.index["max_token_id"])
        self.eot_id = int(self.index["eot_id"])
        self.train_dataset: Optional[TokenWindows] = None
        self.val_dataset: Optional[TokenWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the splits (once); `DataError` where the training split has no full batch for a rank."""
        if self.train_dataset is not None:
            return
        eot = self.eot_id if self.within_documents else None
        self.train_dataset = TokenWindows(TokenSplit(self.path, "train", self.index), self.block_size, eot)
        self.val_dataset = TokenWindows(TokenSplit(self.path, "val", self.index), self.block_size, eot)
        replicas, _ = self._data_parallel()
        need = self.batch_size * replicas
        if len(self.train_dataset) < need:  # every rank finds it alike: one message, rank 0's
            raise_from_rank_zero(DataError(
                f"{self.path}: the train split has {len(self.train_dataset.tokens)} tokens, {len(self.train_dataset)}"
                f" windows of block_size={self.block_size}; one batch of {self.batch_size} on each of {replicas}"
                f" data-parallel ranks needs {need}: a smaller block_size or batch_size, or a larger corpus"))
        if len(self.val_dataset) < need:
            rank_zero_warn(f"{self.path}: the val split has {len(self.val_dataset)} windows of"
                           f" block_size={self.block_size}, fewer than one batch on each of {replicas} data-parallel"
                           " ranks: no validation (prepare with a larger --val-fraction to have one)")

    def statistics(self) -> Dict[str, Any]:
        """What the run trains on: the preparation's counts (documents, tokens, what it left out) and the windows."""
        self.setup()
        train, val = self.train_dataset, self.val_dataset
        assert train is not None and val is not None
        window = self.block_size + 1
        return {
            "source": str(self.path),
            "tokenizer": self.index.get("tokenizer") or "bytes",
            "documents": self.index["splits"]["train"]["documents"],
            "tokens": len(train.tokens),
            "rows": len(train),
            "tokens_unused": len(train.tokens) - (len(train) * self.block_size + 1 if len(train) else 0),
            "val_documents": self.index["splits"]["val"]["documents"],
            "val_rows": len(val),
            "dropped": self.index.get("dropped", {}),
            "window": window,
        }

    def _data_parallel(self) -> Tuple[int, int]:
        """``(size, rank)`` of the data-parallel group: the strategy's sampler arguments (1, 0 without one)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def _loader(self, dataset: Optional[TokenWindows], shuffle: bool, resumable: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        replicas, rank = self._data_parallel()
        if len(dataset) < self.batch_size * replicas:
            return DataLoader([])  # no full batch: no validation (said in setup)
        sampler = ShardSampler(dataset, replicas, rank, shuffle, self.seed)
        kwargs = dict(batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers)
        if not resumable:
            return DataLoader(dataset, **kwargs)
        return ResumableDataLoader(dataset, **kwargs, **self.resume_position())

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, self.shuffle, resumable=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, False, resumable=False)

    def test_dataloader(self) -> DataLoader:
        """The test split is the validation split."""
        return self.val_dataloader()
