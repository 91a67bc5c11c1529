"""Tests of the byte-level corpus and its LightningDataModule."""

from pathlib import Path

import pytest
import torch

from lightning_hybrid.data.corpus import (
    ByteBlockDataset,
    ByteCorpusDataModule,
    collect_text_files,
    default_corpus_files,
    read_corpus,
)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_default_corpus_deterministic():
    a = ByteCorpusDataModule(max_bytes=30_000)
    b = ByteCorpusDataModule(max_bytes=30_000)
    assert a.corpus_bytes() == b.corpus_bytes()
    assert len(a.corpus_bytes()) == 30_000


def test_default_corpus_files_exclude_third_party():
    files = default_corpus_files()
    assert files, "the standard library has Python sources"
    assert all(f.suffix == ".py" for f in files)
    for f in files:
        assert "site-packages" not in f.parts and "dist-packages" not in f.parts


def test_default_corpus_files_on_fake_stdlib(tmp_path):
    _write(tmp_path / "b.py", b"b")
    _write(tmp_path / "a" / "z.py", b"z")
    _write(tmp_path / "a.py", b"a")
    _write(tmp_path / "notes.txt", b"not python")
    _write(tmp_path / "site-packages" / "lightning" / "x.py", b"third party")
    _write(tmp_path / "deep" / "dist-packages" / "y.py", b"third party")
    rel = [f.relative_to(tmp_path).as_posix() for f in default_corpus_files(tmp_path)]
    assert rel == ["a.py", "a/z.py", "b.py"]


def test_collect_text_files(tmp_path):
    _write(tmp_path / "b.txt", b"hello")
    _write(tmp_path / "a" / "c.md", b"world")
    _write(tmp_path / ".hidden", b"secret")
    _write(tmp_path / ".git" / "config", b"secret")
    _write(tmp_path / "img.bin", b"\x89PNG\0\0\0")
    _write(tmp_path / "site-packages" / "m.py", b"m")
    rel = [f.relative_to(tmp_path).as_posix() for f in collect_text_files(tmp_path)]
    assert rel == ["a/c.md", "b.txt", "site-packages/m.py"]
    rel = [
        f.relative_to(tmp_path).as_posix()
        for f in collect_text_files(tmp_path, exclude_dirs=["site-packages"])
    ]
    assert rel == ["a/c.md", "b.txt"]


def test_held_out_split_is_disjoint_tail():
    dm = ByteCorpusDataModule(max_bytes=20_000, block_size=16, val_fraction=0.1)
    dm.setup("fit")
    corpus = dm.corpus_bytes()
    train, val = dm.train_dataset.tokens, dm.val_dataset.tokens
    assert len(train) + len(val) == len(corpus) == 20_000
    assert len(val) == 2_000
    assert bytes(train.tolist()) == corpus[:18_000]
    assert bytes(val.tolist()) == corpus[18_000:]
    # Second setup is a no-op.
    ds = dm.train_dataset
    dm.setup("validate")
    assert dm.train_dataset is ds


def test_dataset_windows_shift_by_one():
    tokens = torch.arange(23, dtype=torch.uint8)
    ds = ByteBlockDataset(tokens, block_size=5)
    assert len(ds) == 4  # (23 - 1) // 5
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.long
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    assert torch.equal(ds[-1][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[4]
    assert len(ByteBlockDataset(torch.arange(21), 5)) == 4
    assert len(ByteBlockDataset(torch.arange(20), 5)) == 3


def test_dataloaders(tmp_path):
    _write(tmp_path / "t.txt", bytes(range(256)) * 8)
    dm = ByteCorpusDataModule(tmp_path / "t.txt", block_size=8, batch_size=4, val_fraction=0.25)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.val_dataloader()) == len(dm.val_dataset) // 4
    xt, _ = next(iter(dm.test_dataloader()))
    xv, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(xt, xv)


def test_shuffle_is_seeded(tmp_path):
    _write(tmp_path / "t.txt", bytes(range(1, 256)) * 8)  # no NUL: not "binary"

    def first_batch(seed):
        dm = ByteCorpusDataModule(tmp_path, block_size=8, batch_size=4, shuffle=True, seed=seed)
        dm.setup()
        return next(iter(dm.train_dataloader()))[0]

    assert torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(1), first_batch(2))


def test_user_file_and_folder_paths(tmp_path):
    f1 = _write(tmp_path / "one.txt", b"A" * 300)
    _write(tmp_path / "dir" / "b.txt", b"B" * 200)
    _write(tmp_path / "dir" / "a.txt", b"C" * 100)
    dm = ByteCorpusDataModule([str(f1), tmp_path / "dir"], block_size=8, val_fraction=0.1)
    assert dm.corpus_bytes() == b"A" * 300 + b"\n" + b"C" * 100 + b"\n" + b"B" * 200
    dm1 = ByteCorpusDataModule(f1, block_size=8, max_bytes=100, val_fraction=0.5)
    assert dm1.corpus_bytes() == b"A" * 100


def test_missing_path_error_names_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"paths: '.*nope.txt' does not exist"):
        ByteCorpusDataModule([missing])  # at construction: before a recipe starts any process
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_corpus([missing])


def test_empty_and_too_small_corpus(tmp_path):
    _write(tmp_path / "empty" / "e.txt", b"")
    with pytest.raises(ValueError, match="empty"):
        ByteCorpusDataModule(tmp_path / "empty").setup()
    _write(tmp_path / "small.txt", b"x" * 100)
    with pytest.raises(ValueError, match="too small"):
        ByteCorpusDataModule(tmp_path / "small.txt", block_size=64).setup()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loader_skips_in_the_order_of_the_epoch_it_resumes(workers):
    """Lightning calls ``iter()`` before it tells the sampler the epoch, and counts the batches it restored against
    ``len``: the skip happens at the first batch, in that epoch's order, and the length is the whole epoch's."""
    from torch.utils.data import DistributedSampler

    from lightning_hybrid.data.corpus import ResumableDataLoader

    data = torch.arange(40).view(20, 2)

    def loader(skip: int) -> ResumableDataLoader:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return ResumableDataLoader(data, batch_size=2, sampler=sampler, skip_batches=skip, num_workers=workers)

    def epoch(load: ResumableDataLoader, number: int) -> list:
        batches = iter(load)  # as Lightning does: iter() first, the epoch after
        load.sampler.set_epoch(number)
        return [b.tolist() for b in batches]

    whole = epoch(loader(0), 1)
    resumed = loader(3)
    assert len(resumed) == 10 and epoch(resumed, 1) == whole[3:]
    assert epoch(resumed, 2) == epoch(loader(0), 2)  # later epochs whole
    assert epoch(loader(10), 1) == whole  # saved on the epoch's last batch: the next epoch, whole
