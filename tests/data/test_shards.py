"""Token shards (`lightning_hybrid.data.prepare`, `lightning_hybrid.data.shards`): what a preparation writes from text
folders, JSON lines (plain, gzip, arrays) and `datasets` files, with bytes and with a tokenizer; what it leaves out and
says;
the windows, document positions, the order and its split over data-parallel ranks, and the exact mid-epoch resume.
One process throughout: the recipe runs (dp2, resumed) are in tests/recipes/test_recipes.py."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_hybrid.data.corpus import DataError, ResumableDataLoader
from lightning_hybrid.data.prepare import prepare
from lightning_hybrid.data.shards import (
    IndexPermutation,
    ShardSampler,
    ShardsDataModule,
    TokenSplit,
    TokenWindows,
    document_positions,
    read_index,
)
from lightning_hybrid.optim import check_schedule, lr_factor

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["first document\nwith two lines\n", "second one", "a third, longer document " * 20, "fourth\n"]


def _tokens(folder: Path, split: str = "train") -> list:
    split_tokens = TokenSplit(folder, split)
    return split_tokens.read(0, len(split_tokens)).tolist()


def _text_folder(folder: Path, docs=DOCS) -> Path:
    folder.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(doc)
    return folder


def test_text_folder_in_bytes_each_document_ended_by_the_end_of_text_id(tmp_path):
    src = _text_folder(tmp_path / "src")
    (src / "empty.txt").write_text("  \n")
    (src / "image.png").write_bytes(b"\x89PNG\0\0\0binary")
    (src / ".hidden").write_text("not read")
    (src / "sub").mkdir()
    (src / "sub" / "nul.txt").write_bytes(b"x" * 2000 + b"\0tail")  # a NUL past the sniffed KiB: removed, counted
    stats = prepare([src], tmp_path / "out", val_fraction=0.0, chunk_bytes=16)  # pieces of ~16 bytes: many
    index = read_index(tmp_path / "out")
    expected = []
    for doc in [*DOCS, "x" * 2000 + "tail"]:
        expected += [*doc.encode(), 0]
    assert _tokens(tmp_path / "out") == expected
    assert index["eot_id"] == 0 and index["vocab_size"] == 256 and index["dtype"] == "uint16"
    assert index["splits"]["train"]["documents"] == 5 and index["splits"]["val"]["tokens"] == 0
    assert index["dropped"] == {"binary file": 1, "empty document": 1, "NUL byte (removed)": 1}
    assert stats.files == 6 and index["max_token_id"] == max(expected)


def test_records_from_json_lines_gzip_and_arrays_with_a_val_split_and_small_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"record {i} " * (i + 1) for i in range(12)]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n\n" for i, t in enumerate(texts[:4])))
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[4:8])
    (src / "c.json").write_text(json.dumps([{"text": t} for t in texts[8:]]))
    prepare([src], tmp_path / "out", val_fraction=0.25, shard_tokens=40)
    index = read_index(tmp_path / "out")
    train = [t for i, t in enumerate(texts) if (i + 1) % 4]  # every 4th document: val
    val = [t for i, t in enumerate(texts) if not (i + 1) % 4]
    assert _tokens(tmp_path / "out") == [x for t in train for x in [*t.encode(), 0]]
    assert _tokens(tmp_path / "out", "val") == [x for t in val for x in [*t.encode(), 0]]
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 2 and all(s["documents"] >= 1 for s in shards)  # cut at document ends past 40 tokens
    assert index["read"]["records"] == 12 and index["dropped"] == {}


def test_datasets_files_parquet_arrow_and_saved_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["alpha beta", "gamma", "delta epsilon zeta"], "n": [1, 2, 3]}
    ds = datasets.Dataset.from_dict(rows)
    src = tmp_path / "src"
    src.mkdir()
    ds.to_parquet(str(src / "a.parquet"))
    ds.save_to_disk(str(src / "saved"))
    arrow = next((src / "saved").glob("*.arrow"))
    (tmp_path / "arrow").mkdir()
    (tmp_path / "arrow" / "d.arrow").write_bytes(arrow.read_bytes())
    prepare([src / "a.parquet", src / "saved", tmp_path / "arrow"], tmp_path / "out", val_fraction=0.0)
    assert _tokens(tmp_path / "out") == [x for t in rows["text"] * 3 for x in [*t.encode(), 0]]
    dict_folder = tmp_path / "dd"
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(dict_folder))
    with pytest.raises(DataError, match="train"):  # a DatasetDict: which split, said by name
        prepare([dict_folder], tmp_path / "out2")


def test_malformed_records_stop_the_preparation_naming_them_or_are_skipped_and_listed(tmp_path):
    src = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": "good"}), "{not json", json.dumps({"body": "x"}), json.dumps({"text": 3}),
             json.dumps(["a"]), json.dumps({"text": "also good"})]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        prepare([src], tmp_path / "out", val_fraction=0.0)
    message = str(e.value)
    assert message.startswith("4 malformed record(s): ") and f"{src}:2:" in message and f"{src}:5:" in message
    assert "no 'text' field" in message and "--skip-malformed" in message
    assert not (tmp_path / "out" / "index.json").exists()  # no index: not a prepared folder
    with pytest.raises(DataError, match="has no index.json"):
        ShardsDataModule(tmp_path / "out")
    stats = prepare([src], tmp_path / "out", val_fraction=0.0, skip_malformed=True, overwrite=True)
    assert len(stats.malformed) == 4 and len((tmp_path / "out" / "malformed.txt").read_text().splitlines()) == 4
    assert read_index(tmp_path / "out")["dropped"] == {"malformed record": 4}
    assert _tokens(tmp_path / "out") == [*b"good", 0, *b"also good", 0]


def test_a_tokenizer_folder_tokenises_each_document_and_ends_it_with_its_eos(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tests.recipes.test_recipes import _pretrained_folder_with_tokenizer

    folder = _pretrained_folder_with_tokenizer(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "<|endoftext|>"  # a BPE trained here has no special tokens: add one, saved
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = [*DOCS, "text naming <|endoftext|> inside"]  # the eos string in a document stays text
    src = _text_folder(tmp_path / "src", docs)
    prepare([src], tmp_path / "out", folder, val_fraction=0.0)
    index = read_index(tmp_path / "out")
    eos = tokenizer.eos_token_id
    tokens = _tokens(tmp_path / "out")
    expected = [x for d in docs for x in [*tokenizer(d, add_special_tokens=False, split_special_tokens=True)
                                          ["input_ids"], eos]]
    assert tokens == expected and tokens.count(eos) == len(docs)  # the string inside a document is not the id
    assert index["eot_id"] == eos and index["vocab_size"] == len(tokenizer) and index["max_token_id"] == max(tokens)
    # Two tokenising processes write the same folder.
    prepare([src], tmp_path / "out2", folder, val_fraction=0.0, workers=2, task_bytes=8)
    assert _tokens(tmp_path / "out2") == tokens
    with pytest.raises(DataError, match="no tokenizer files"):
        prepare([src], tmp_path / "out3", tmp_path / "src")


def test_bad_sources_and_outputs_are_data_errors_naming_them(tmp_path):
    src = _text_folder(tmp_path / "src")
    with pytest.raises(DataError, match="source '/no/such' does not exist"):
        prepare(["/no/such"], tmp_path / "out")
    with pytest.raises(DataError, match=r"val_fraction=1.0: valid values are in \[0, 1\)"):
        prepare([src], tmp_path / "out", val_fraction=1.0)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="not empty .choose a new or empty folder"):
        prepare([src], tmp_path / "taken")
    prepare([src], tmp_path / "out")
    with pytest.raises(DataError, match="pass --overwrite"):
        prepare([src], tmp_path / "out")
    shard = tmp_path / "out" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="changed after its preparation"):
        read_index(tmp_path / "out")


def test_command_line_prints_what_it_did_and_one_error_line(tmp_path):
    src = _text_folder(tmp_path / "src")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = [sys.executable, "-m", "lightning_hybrid.data.prepare", str(src), "--workers", "0"]
    res = subprocess.run([*run, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"train on it: data=shards data.path={tmp_path / 'out'} model.vocab_size=256" in res.stdout
    assert "train: 4 documents" in res.stdout or "train: 3 documents" in res.stdout
    res = subprocess.run([*run, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --out "), res.stderr


# ---------------------------------------------------------------------------------------------- reading
def _prepared(tmp_path: Path, n_docs: int = 40, **kwargs) -> Path:
    src = _text_folder(tmp_path / "src", [f"doc {i}: " + "words and more words " * (i % 5 + 1)
                                          for i in range(n_docs)])
    prepare([src], tmp_path / "out", val_fraction=0.1, shard_tokens=300, **kwargs)
    return tmp_path / "out"


def test_windows_read_across_shards_and_positions_restart_within_documents(tmp_path):
    folder = _prepared(tmp_path)
    tokens = torch.tensor(_tokens(folder))
    split = TokenSplit(folder, "train")
    assert len(split.files) > 3
    windows = TokenWindows(split, 32)
    assert len(windows) == (len(tokens) - 1) // 32
    for i in range(len(windows)):
        x, y = windows[i]
        assert torch.equal(x, tokens[i * 32: i * 32 + 32]) and torch.equal(y, tokens[i * 32 + 1: i * 32 + 33])
    within = TokenWindows(split, 32, eot_id=0)
    i = next(i for i in range(len(within)) if (within[i]["input_ids"][:-1] == 0).any())  # a document ends inside
    item = within[i]
    x = item["input_ids"]
    start = int((x == 0).nonzero()[0]) + 1
    assert item["position_ids"][start] == 0 and item["position_ids"][0] == 0
    assert torch.equal(item["position_ids"][:start], torch.arange(start))
    assert (item["labels"][x == 0] == -100).all() and torch.equal(item["labels"][x != 0], windows[i][1][x != 0])
    assert document_positions(torch.tensor([5, 0, 0, 7, 8]), 0).tolist() == [0, 1, 0, 0, 1]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_index_permutation_takes_every_index_once(n):
    perm = IndexPermutation(n, seed=3)
    values = [perm(i) for i in range(n)]
    assert sorted(values) == list(range(n))
    if n >= 64:
        assert values != list(range(n)) and values != [IndexPermutation(n, seed=4)(i) for i in range(n)]


def test_sampler_deals_the_epoch_to_data_parallel_ranks_only(tmp_path):
    windows = TokenWindows(TokenSplit(_prepared(tmp_path), "train"), 16)
    n = len(windows)
    ranks = [list(ShardSampler(windows, 3, r, shuffle=True, seed=0)) for r in range(3)]
    dealt = sum(ranks, [])
    assert len(set(dealt)) == len(dealt) == 3 * (n // 3) and all(len(r) == n // 3 for r in ranks)
    sampler = ShardSampler(windows, 3, 0, shuffle=True, seed=0)
    sampler.set_epoch(1)
    assert list(sampler) != ranks[0]  # a new order each epoch
    assert list(ShardSampler(windows, 1, 0, shuffle=False, seed=0)) == list(range(n))
    with pytest.raises(DataError, match="cannot give each of"):
        ShardSampler(TokenWindows(TokenSplit(tmp_path / "out", "train"), 10**6), 2, 0, True, 0)


def test_data_module_statistics_vocabulary_and_a_corpus_too_small(tmp_path):
    folder = _prepared(tmp_path)
    data = ShardsDataModule(folder, block_size=16, batch_size=2)
    stats = data.statistics()
    assert data.vocab_size == 256 and data.eot_id == 0 and stats["tokens"] == len(TokenSplit(folder, "train"))
    assert stats["rows"] == len(data.train_dataset) and stats["documents"] + stats["val_documents"] == 40
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.int64
    with pytest.raises(DataError, match="a smaller block_size or batch_size, or a larger corpus"):
        ShardsDataModule(folder, block_size=4096, batch_size=8).setup()
    with pytest.raises(DataError, match="is not a folder"):
        ShardsDataModule(tmp_path / "missing")


def test_resumed_loader_continues_the_same_order_exactly(tmp_path):
    folder = _prepared(tmp_path)
    data = ShardsDataModule(folder, block_size=16, batch_size=2, within_documents=True)
    data.setup()
    full = [b["input_ids"] for b in data.train_dataloader()]
    resumed = ShardsDataModule(folder, block_size=16, batch_size=2, within_documents=True)
    resumed.setup()
    resumed.load_state_dict({"batches": 5, "sampler_epoch": 0})
    loader = resumed.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    rest = [b["input_ids"] for b in loader]
    assert len(rest) == len(full) - 5 and all(torch.equal(a, b) for a, b in zip(rest, full[5:]))
    assert len(list(resumed.train_dataloader())) == len(full)  # once: the next epoch's loader starts at 0


def test_learning_rate_schedules():
    assert [lr_factor(s, 2, "none", 0.1, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 2, "cosine", 0.1, 10) == 1.0 and lr_factor(10, 2, "cosine", 0.1, 10) == pytest.approx(0.1)
    assert lr_factor(6, 2, "cosine", 0.1, 10) == pytest.approx(0.55) and lr_factor(50, 2, "cosine", 0.1, 10) == 0.1
    assert lr_factor(6, 2, "linear", 0.0, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lr_decay='cos': valid values are"):
        check_schedule(0, "cos", 0.1, 0)
    with pytest.raises(ValueError, match="min_lr_ratio=2"):
        check_schedule(0, "cosine", 2, 0)


@pytest.mark.parametrize("workers", [0, 1])
def test_resumable_loader_skips_once_with_worker_processes_too(workers):
    """The resumed epoch starts after the skipped batches (their items never read); the next epoch is whole, with
    persistent workers too (whose iterator is reset, not rebuilt, between epochs)."""
    items = [torch.tensor([i]) for i in range(12)]
    loader = ResumableDataLoader(items, batch_size=2, num_workers=workers, persistent_workers=workers > 0,
                                 skip_batches=4, skip_epoch=0)
    first = [int(b[0]) for b in loader]
    second = [int(b[0]) for b in loader]
    assert first == [8, 10] and second == [0, 2, 4, 6, 8, 10], (first, second)
