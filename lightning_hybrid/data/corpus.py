"""Byte-level text data: one byte = one token (vocabulary of 256).

The default corpus is the Python standard library's own ``*.py`` sources, which
exist on every machine that runs this package, so examples and tests need no
download. Third-party code (``site-packages`` / ``dist-packages``) is excluded
because it differs between environments.

Shape legend: ``T`` = ``block_size``, ``B`` = ``batch_size``.
"""

from __future__ import annotations

import array
import itertools
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_hybrid.data.corpus_text import (
    EXCLUDED_DIRS,
    _concat,
    collect_text_files,
    corpus_files,
    default_corpus_files,
    read_corpus,
)
from lightning_hybrid.data.prepare import Piece, PieceTokenizer, text_pieces
from lightning_hybrid.data.record_files import TOKENIZER_FILES, DataError, has_tokenizer, looks_binary

__all__ = [
    "EXCLUDED_DIRS",
    "DataError",
    "ByteBlockDataset",
    "ByteCorpusDataModule",
    "DataPosition",
    "TokenCorpusDataModule",
    "collect_text_files",
    "default_corpus_files",
    "looks_binary",
    "corpus_files",
    "read_corpus",
    "statistics_line",
]

PathLike = Union[str, os.PathLike]


def statistics_line(statistics: dict) -> str:
    """A data module's ``statistics()`` as the one line a run prints before its first step: ``data: records=300
    dropped=2 (no assistant turn: 2) truncated=7 rows=120 tokens=51234 packing_efficiency=0.83 ...`` (numbers
    as they are, dicts of counts with their reasons, lists by their length)."""
    parts = []
    for key, value in statistics.items():
        if isinstance(value, dict):
            total = sum(v for v in value.values() if isinstance(v, (int, float)))
            reasons = ", ".join(f"{k}: {v}" for k, v in value.items())
            parts.append(f"{key}={total}" + (f" ({reasons})" if reasons else ""))
        elif isinstance(value, (list, tuple)):
            parts.append(f"{key}={len(value)}")
        elif isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        else:
            parts.append(f"{key}={value}")
    return "data: " + " ".join(parts)


class ByteBlockDataset(Dataset):
    """Non-overlapping next-token windows over a 1-D token tensor.

    Item ``i`` is ``(x, y)`` with ``x = tokens[i*T : i*T + T]`` and
    ``y = tokens[i*T + 1 : i*T + T + 1]``, both ``LongTensor (T,)``.
    ``len = (len(tokens) - 1) // T``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} windows")
        start = i * self.block_size
        x = self.tokens[start : start + self.block_size].long()  # (T,)
        y = self.tokens[start + 1 : start + self.block_size + 1].long()  # (T,)
        return x, y


class ResumableDataLoader(DataLoader):
    """A DataLoader whose first pass skips ``skip_batches`` batches: where a resumed run left off.

    ``skip_batches`` is an ``__init__`` argument so that it survives Lightning re-creating the loader with
    a distributed sampler. Its length stays the epoch's: Lightning restores the batches done and counts them
    against it. The skip happens at the first batch, not when Lightning calls ``iter()`` -- it tells the sampler
    the epoch after that -- and in the order of ``skip_epoch``, the sampler epoch those batches came from (a run
    that stopped at ``max_steps`` in the middle of an epoch is saved with that epoch marked done, and Lightning
    resumes it as the next one: its data goes on where it stopped). A checkpoint saved on an epoch's last batch
    (``skip_batches`` of a whole epoch) skips nothing: Lightning starts the next epoch. The skipped batches' indices
    are drawn from the batch sampler and dropped; their data is never read.
    """

    def __init__(self, *args, skip_batches: int = 0, skip_epoch: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches, self.skip_epoch = skip_batches, skip_epoch
        self._skipping_now = 0

    def __iter__(self):
        skip, self.skip_batches = self.skip_batches, 0
        if skip >= super().__len__():
            skip = 0
        epoch = self.skip_epoch if skip else None

        def make() -> Iterator:
            if epoch is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            if isinstance(getattr(self._iterator, "_index_sampler", None), _AfterFirst):
                self._iterator = None  # persistent workers' iterator of the resumed epoch: not for the next one
            self._skipping_now = skip  # read once, by the iterator's construction (`_index_sampler`)
            try:
                return super(ResumableDataLoader, self).__iter__()
            finally:
                self._skipping_now = 0

        return _at_first_next(make)

    @property
    def _index_sampler(self):
        """DataLoader's own, but for the iterator made at a resume: the same after its first ``skip`` batches."""
        sampler = super()._index_sampler
        return _AfterFirst(sampler, self._skipping_now) if self._skipping_now else sampler


class _AfterFirst:
    """The items of ``sampler`` after its first ``skip`` (indices or batches of indices)."""

    def __init__(self, sampler: Iterable, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


def _at_first_next(make: Callable[[], Iterator]) -> Iterator:
    """The items of ``make()``, called at the first ``next``."""
    yield from make()


class DataPosition:
    """The data position of a LightningDataModule's training loader, in checkpoints (``state_dict`` /
    ``load_state_dict``), and the loader that resumes from it (`resumable_loader`, or `resume_position` for a
    `ResumableDataLoader` of one's own): `ByteCorpusDataModule`, `lightning_hybrid.data.sft.SFTDataModule` and
    `lightning_hybrid.data.shards.ShardsDataModule` share it.

    A checkpoint records how many batches of the current epoch were trained on, and a run resumed from it starts
    that epoch's loader after them (same sampler order: same seed and epoch; the epoch those batches came from is
    the one last started, also where the run stopped at max_steps and Lightning marked it done).
    """

    def state_dict(self) -> dict:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        loop = trainer.fit_loop
        return {"epoch": loop.epoch_progress.current.completed,
                "sampler_epoch": max(loop.epoch_progress.current.started - 1, 0),
                "batches": loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_batches = int(state_dict.get("batches", 0))
        self._resume_epoch = state_dict.get("sampler_epoch")

    def resume_position(self) -> dict:
        """``skip_batches`` and ``skip_epoch`` of a `ResumableDataLoader`: after the batches a loaded data position
        says were done -- once: later loaders start at 0."""
        skip, self._resume_batches = getattr(self, "_resume_batches", 0), 0
        epoch, self._resume_epoch = getattr(self, "_resume_epoch", None), None
        return {"skip_batches": skip, "skip_epoch": epoch}

    def resumable_loader(self, dataset: Dataset, batch_size: int, shuffle: bool, seed: int,
                         num_workers: int) -> "ResumableDataLoader":
        """The training loader (``drop_last``; a seeded CPU generator for the sampler: batches are made on the
        CPU), after the batches a loaded data position says were done (`resume_position`)."""
        return ResumableDataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True, num_workers=num_workers,
            generator=torch.Generator(device="cpu").manual_seed(seed), **self.resume_position(),
        )


class ByteCorpusDataModule(DataPosition, L.LightningDataModule):
    """Byte-level language-modelling data (vocabulary 256) with a held-out tail.

    Args:
        paths: ``None`` for the standard-library corpus, or a path / list of paths
            (files or directories); see :func:`read_corpus`.
        block_size: sequence length ``T`` of each sample.
        batch_size: per-process batch size ``B``.
        val_fraction: the last ``val_fraction`` of the bytes is the validation
            (and test) split; the rest is training data.
        max_bytes: read at most this many bytes of the corpus (said in a warning where it cuts the corpus);
            ``None``: all of it, held in memory on every rank -- for a corpus larger than memory, prepare token shards
            (`lightning_hybrid.data.prepare`, `lightning_hybrid.data.shards.ShardsDataModule`).
        num_workers: DataLoader workers.
        shuffle: shuffle the training set (with a generator seeded by ``seed``).
        seed: seed of the shuffling generator.

    Batches are ``(x, y)`` pairs of ``LongTensor (B, T)`` with ``y`` = ``x`` shifted by one. After setup,
    `statistics` says what was read and what the splits hold. No ``DistributedSampler`` is created here: the
    strategy injects one over the data-parallel ranks, in the loader's order (`lightning_hybrid.runtime.sample_order`;
    under ``shuffle`` a ``DistributedSampler`` shuffle seeded by ``seed``).
    """

    vocab_size = 256

    def __init__(
        self,
        paths: Union[None, PathLike, Sequence[PathLike]] = None,
        block_size: int = 64,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = 2_000_000,
        num_workers: int = 0,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if block_size <= 0 or batch_size <= 0:
            raise ValueError(f"block_size and batch_size must be positive, got {block_size}, {batch_size}")
        # Checked here, not only when `setup` reads the corpus: a recipe builds the data module before it starts
        # any process, so a wrong path is one error instead of one per rank.
        for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths or []:
            if not Path(p).exists():
                raise FileNotFoundError(f"paths: {str(p)!r} does not exist")
        self.paths = paths
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self._corpus: Optional[bytes] = None
        self._statistics: Optional[dict] = None
        self.train_dataset: Optional[ByteBlockDataset] = None
        self.val_dataset: Optional[ByteBlockDataset] = None

    def prepare_data(self) -> None:
        """Nothing to download: the corpus is read from local files in :meth:`setup`."""

    def setup(self, stage: Optional[str] = None) -> None:
        """Read the corpus and build the train / validation datasets (once)."""
        if self.train_dataset is not None:
            return
        files = corpus_files(self.paths)
        tokens = self.read_tokens(files)  # (N,)
        n = len(tokens)
        n_val = int(n * self.val_fraction)
        n_train = n - n_val
        need = self.block_size + 1
        if n_train < need or n_val < need:
            raise ValueError(
                f"corpus of {n} bytes is too small: train split has {n_train} bytes and "
                f"validation split {n_val} bytes (val_fraction={self.val_fraction}); each "
                f"needs at least block_size + 1 = {need} bytes"
            )
        self.train_dataset = ByteBlockDataset(tokens[:n_train], self.block_size)
        self.val_dataset = ByteBlockDataset(tokens[n_train:], self.block_size)
        in_files = sum(path.stat().st_size for path in files)
        self._statistics = {"source": "the standard library's sources" if self.paths is None else str(self.paths),
                            "tokenizer": self.tokenizer_name(), "files": len(files), "bytes_in_files": in_files,
                            "max_bytes": self.max_bytes, "tokens": n, "rows": len(self.train_dataset),
                            "val_rows": len(self.val_dataset)}
        if self.max_bytes is not None and in_files > self.max_bytes:
            rank_zero_warn(f"data: read the first {self.max_bytes} bytes of the corpus's {in_files}"
                           f" (data.max_bytes={self.max_bytes}; data.max_bytes=null reads all of it)")

    def tokenizer_name(self) -> str:
        """What turns the text into tokens, for `statistics`: here bytes."""
        return "bytes"

    def statistics(self) -> dict:
        """What was read and what the splits hold (after :meth:`setup`): ``files``, ``bytes_in_files`` (all of
        them), ``max_bytes`` (the most read), ``tokens``, ``rows`` and ``val_rows`` (windows of ``block_size``)."""
        if self._statistics is None:
            raise RuntimeError("call setup() before statistics()")
        return dict(self._statistics)

    def read_tokens(self, files: Sequence[Path]) -> torch.Tensor:
        """The corpus as a 1-D token tensor: here its bytes (the files joined by a newline, at most
        ``max_bytes``)."""
        self._corpus = _concat(files, self.max_bytes)
        if not self._corpus:
            raise ValueError(f"empty corpus (paths={self.paths!r}, {len(files)} files)")
        return torch.frombuffer(bytearray(self._corpus), dtype=torch.uint8)

    def corpus_bytes(self) -> bytes:
        """The corpus's text as read, at most ``max_bytes`` (the files joined by a newline)."""
        if self._corpus is None:
            self._corpus = read_corpus(self.paths, self.max_bytes)
        return self._corpus

    def _require(self, dataset: Optional[ByteBlockDataset]) -> ByteBlockDataset:
        if dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        return dataset

    def train_dataloader(self) -> DataLoader:
        return self.resumable_loader(self._require(self.train_dataset), self.batch_size, self.shuffle, self.seed,
                                     self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._require(self.val_dataset),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def test_dataloader(self) -> DataLoader:
        """The test split is the validation split."""
        return self.val_dataloader()


class TokenCorpusDataModule(ByteCorpusDataModule):
    """`ByteCorpusDataModule` tokenised with a Hugging Face tokenizer: that of ``tokenizer`` (a local folder, e.g.
    the pretrained model's, or ``None``) when the folder holds one, else bytes (vocabulary 256; said in a warning).
    Same arguments otherwise. Each file is read as UTF-8 (undecodable bytes replaced) in pieces of about 1 MiB cut at
    line ends, tokenised without special tokens and followed by the tokenizer's ``eos_token`` (when it has one):
    the tokens are held as 32-bit integers, on every rank alike -- for a corpus of more than a few hundred MB,
    prepare token shards once (`lightning_hybrid.data.prepare`, ``data=shards``).
    """

    def __init__(
        self,
        tokenizer: Optional[PathLike] = None,
        paths: Union[None, PathLike, Sequence[PathLike]] = None,
        block_size: int = 64,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = 2_000_000,
        num_workers: int = 0,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(paths, block_size, batch_size, val_fraction, max_bytes, num_workers, shuffle, seed)
        if tokenizer is not None and not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer: {str(tokenizer)!r} is not a folder (a Hugging Face model folder,"
                                    " or null for bytes)")
        self.tokenizer_path = tokenizer
        self.tokenizer = None
        if tokenizer is not None and has_tokenizer(tokenizer):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        elif tokenizer is not None:
            rank_zero_warn(f"tokenizer: {str(tokenizer)!r} has none of the tokenizer files {list(TOKENIZER_FILES)}:"
                           " the data is bytes (vocabulary 256)")
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else ByteCorpusDataModule.vocab_size

    def tokenizer_name(self) -> str:
        if self.tokenizer is not None:
            return str(self.tokenizer_path)
        return "bytes" if self.tokenizer_path is None else f"bytes (no tokenizer files in {self.tokenizer_path})"

    def read_tokens(self, files: Sequence[Path]) -> torch.Tensor:
        if self.tokenizer is None:
            return super().read_tokens(files)

        eot = self.tokenizer.eos_token_id
        tokenize = PieceTokenizer(self.tokenizer, eot, "uint32")
        tokens, left = array.array("I"), self.max_bytes
        for path in files:
            pieces = []
            for data, ends in text_pieces(path, 1 << 20):
                if left is not None and len(data) >= left:
                    data, ends, left = data[:left], True, 0
                elif left is not None:
                    left -= len(data)
                pieces.append(Piece(data.decode("utf-8", errors="replace"), ends, val=False))
                if left == 0:
                    break
            for data, *_ in tokenize(pieces)[0]:
                tokens.frombytes(data)
            if left == 0:
                break
        if not tokens:
            raise ValueError(f"empty corpus (paths={self.paths!r}, {len(files)} files)")
        return torch.frombuffer(tokens, dtype=torch.int32).clone()  # its own memory, not the array's


