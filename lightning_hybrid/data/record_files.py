"""Records in the files users keep them in, each with where it was read -- for the pretraining corpus
(`lightning_hybrid.data.prepare`) and the fine-tuning records (`lightning_hybrid.data.chat_formats`) alike:

* ``.jsonl`` / ``.jsonl.gz``: one JSON value per line (blank lines skipped), located as ``file:line``, streamed;
* ``.json`` / ``.json.gz``: a JSON array (``file:row N``, ``N`` from 0; parsed whole, as JSON must be), or JSON
  lines as in ``.jsonl``;
* Hugging Face ``datasets`` files, read with the ``datasets`` library (optional: the ``data`` extra; offline:
  ``HF_DATASETS_OFFLINE=1`` unless set): ``.parquet`` (streamed), ``.arrow`` (a ``Dataset``'s Arrow file) and a
  folder written by ``Dataset.save_to_disk`` (memory-mapped), located as ``file:row N``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterator, Tuple, Union

__all__ = ["DATASET_SUFFIXES", "FILE_SUFFIXES", "INSTALL", "JSON_SUFFIXES", "TOKENIZER_FILES", "DataError",
           "check_datasets", "has_tokenizer", "is_saved_dataset", "looks_binary", "needs_datasets", "read_items"]

PathLike = Union[str, os.PathLike]


class DataError(ValueError):
    """Data that cannot train as given -- a malformed record, a split too small for one batch, token ids outside the
    model's vocabulary: the message names the file (and line) or value and what would be valid. A recipe prints it
    as one ``error: ...`` line and exits with code 2 (`lightning_hybrid.runs.recipe.exit_on_config_error`). Also
    ``lightning_hybrid.data.corpus.DataError``."""


_BINARY_SNIFF_BYTES = 1024
#: The files by which a folder holds a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def looks_binary(path: PathLike) -> bool:
    """True if the file has a NUL byte in its first 1 KiB."""
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_SNIFF_BYTES)


def has_tokenizer(folder: PathLike) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer (one of `TOKENIZER_FILES`)."""
    return Path(folder).is_dir() and any((Path(folder) / name).exists() for name in TOKENIZER_FILES)

JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
DATASET_SUFFIXES = (".parquet", ".arrow")
#: The files read, by how their name ends (and ``save_to_disk`` folders).
FILE_SUFFIXES = JSON_SUFFIXES + DATASET_SUFFIXES
INSTALL = "pip install 'lightning-hybrid[data]' (or pip install datasets)"
#: The files by which a folder is one ``Dataset.save_to_disk`` wrote (a ``Dataset``; a ``DatasetDict``).
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


def is_saved_dataset(path: PathLike) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) wrote."""
    return Path(path).is_dir() and any((Path(path) / name).is_file() for name in SAVED_DATASET_FILES)


def needs_datasets(path: PathLike) -> bool:
    """Whether ``path`` is read with the ``datasets`` library."""
    return is_saved_dataset(path) or str(path).endswith(DATASET_SUFFIXES)


def check_datasets(path: PathLike) -> None:
    """`DataError` where ``path`` needs the ``datasets`` library and it is not installed: at configuration time."""
    if needs_datasets(path) and importlib.util.find_spec("datasets") is None:
        raise DataError(f"{str(path)!r} is read with the datasets library, which is not installed: {INSTALL}")


def _import_datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading .parquet, .arrow or save_to_disk folders needs the datasets library: {INSTALL}"
                        ) from None
    return datasets


def _json_items(path: Path) -> Iterator[Tuple[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            head = f.read(4096).lstrip()[:1]
            f.seek(0)
            if head == "[" and path.name.endswith((".json", ".json.gz")):
                try:
                    items = json.load(f)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: not a valid JSON array ({e.msg} at line {e.lineno} column {e.colno});"
                                    " a .json file holds one JSON array of records, or one record per line") from None
                yield from ((f"{path}:row {n}", item) for n, item in enumerate(items))
                return
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield f"{path}:{number}", json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f"{path}:{number}", DataError(f"not valid JSON ({e.msg} at column {e.colno})")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{number + 1}: not UTF-8 text ({e.reason}): save the file as UTF-8") from None


def _dataset_rows(path: Path) -> Iterator[Tuple[str, Any]]:
    datasets = _import_datasets()
    try:
        if path.is_dir():
            dataset = datasets.load_from_disk(str(path))
        elif path.name.endswith(".parquet"):
            dataset = datasets.Dataset.from_parquet(str(path), streaming=True)  # read as it is: no cache written
        else:
            dataset = datasets.Dataset.from_file(str(path))
    except (OSError, ValueError) as e:  # pyarrow's errors are OSError / ValueError subclasses
        raise DataError(f"{path}: datasets cannot read it ({type(e).__name__}: {e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict with splits {list(dataset)}: give one split's folder, e.g."
                        f" {str(path / next(iter(dataset)))!r}")
    yield from ((f"{path}:row {n}", row) for n, row in enumerate(dataset))


def read_items(path: PathLike) -> Iterator[Tuple[str, Any]]:
    """``(where, value)`` of each record of the file or ``save_to_disk`` folder ``path``, in order: for a line that
    is not JSON the value is a `DataError` saying so (the caller decides: skip, collect, stop). A file that cannot
    be read at all is a `DataError`."""
    path = Path(path)
    return _dataset_rows(path) if needs_datasets(path) else _json_items(path)
