"""Prepare a corpus of any size for pretraining: tokenise it in several processes into the token shards of
`lightning_hybrid.data.shards` (``data=shards data.path=FOLDER`` in the recipes)::

    python -m lightning_hybrid.data.prepare /data/text /data/web.jsonl.gz /data/wiki.parquet --out /data/tokens \\
        --tokenizer /models/my-llama        # the model folder's tokenizer; without it: bytes (vocabulary 256)

Sources, each a file or a folder (walked recursively, hidden files skipped, in sorted order):

* text files -- any file that is not one of the kinds below and has no NUL byte in its first KiB (those are
  binary: skipped and counted): one file is one document, read in pieces of about ``chunk_bytes`` cut at line
  ends (never held whole);
* ``.jsonl``, ``.jsonl.gz``, ``.json`` (an array, or one object per line), ``.json.gz``: one record per line or
  item, its ``text_key`` field (a string) the document;
* Hugging Face ``datasets`` files -- ``.parquet``, ``.arrow`` and folders written by ``save_to_disk`` -- read
  with the ``datasets`` library (``pip install 'lightning-hybrid[data]'``), streamed, never downloaded.

Every document is followed by the end-of-text token (the tokenizer's ``eos_token``; 0, the NUL byte, for bytes,
whose NUL bytes inside documents are removed and counted). Text is tokenised without special tokens and with
special-token strings read as text (``split_special_tokens``), so an end-of-text id never occurs inside a
document. Every ``1 / val_fraction``-th document goes to the ``val`` split, the rest to ``train``.

The output does not depend on the number of workers: the pieces are tokenised in order-preserving tasks of about
``task_bytes`` each, at most two per worker in flight, so memory stays that of the workers' tokenizers whatever the
corpus's size. ``index.json`` is written last. A malformed record (not JSON, no ``text_key`` string) stops the
preparation with one error naming it -- the rest of the input is still read, to name all of them -- unless
``skip_malformed``, which leaves them out, lists them in ``malformed.txt`` and counts them in the index.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from lightning_hybrid.data.prepare_workers import (
    Piece,
    PieceTokenizer,
    _Done,
    _load_tokenizer,
    _start_worker,
    _tasks,
    _work,
    _worker_spec,
)
from lightning_hybrid.data.record_files import (
    FILE_SUFFIXES,
    DataError,
    check_datasets,
    has_tokenizer,
    is_saved_dataset,
    looks_binary,
    read_items,
)

__all__ = ["FORMAT", "INDEX_FILE", "Piece", "PieceTokenizer", "Preparation", "main", "prepare", "text_pieces",
           "token_dtype"]

PathLike = Union[str, os.PathLike]

#: ``index.json``'s ``format`` field: what `lightning_hybrid.data.shards.read_index` accepts.
FORMAT = "lightning-hybrid-token-shards"
#: The file that makes a folder a prepared one; written last, so a folder without it is an unfinished preparation.
INDEX_FILE = "index.json"
MALFORMED_FILE = "malformed.txt"
_NAMED = 5  # malformed records named in the error (all of them are in malformed.txt)


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` where every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass
class Preparation:
    """What a preparation read, wrote and left out (``index.json``'s counts; `prepare` returns it)."""

    files: int = 0
    records: int = 0
    bytes: int = 0
    documents: Counter = field(default_factory=Counter)  # split -> documents
    tokens: Counter = field(default_factory=Counter)  # split -> tokens
    dropped: Counter = field(default_factory=Counter)  # reason -> documents or files
    malformed: List[str] = field(default_factory=list)  # "file:line: why"
    max_token_id: int = 0
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- reading
def _source_files(sources: Sequence[PathLike]) -> List[Path]:
    """Files and saved-dataset folders of ``sources``, in the given order, folders walked in sorted order."""
    out: List[Path] = []
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise DataError(f"source {str(source)!r} does not exist (give text/JSONL/parquet/arrow files or folders)")
        if path.is_file() or is_saved_dataset(path):
            out.append(path)
            continue
        found = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if is_saved_dataset(Path(dirpath)) and Path(dirpath) != path:
                found.append(Path(dirpath))
                dirnames[:] = []
                continue
            found += [Path(dirpath) / n for n in filenames if not n.startswith(".")]
        out += sorted(found, key=lambda p: p.relative_to(path).as_posix())
    for path in out:
        check_datasets(path)
    return out


def _kind(path: Path) -> str:
    return "records" if is_saved_dataset(path) or path.name.endswith(FILE_SUFFIXES) else "text"


def text_pieces(path: Path, chunk_bytes: int) -> Iterator[Tuple[bytes, bool]]:
    """The file's bytes in pieces of about ``chunk_bytes`` cut after a line end, the last one flagged."""
    with open(path, "rb") as f:
        rest = b""
        while chunk := f.read(chunk_bytes):
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: a piece is whole lines
                rest = data
                continue
            yield data[:cut], False
            rest = data[cut:]
        yield rest, True


def _record_text(record: Any, text_key: str) -> str:
    """The document of a record; ``ValueError`` saying why it is malformed."""
    if isinstance(record, DataError):
        raise ValueError(str(record))
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object with a {text_key!r} string")
    if text_key not in record:
        raise ValueError(f"no {text_key!r} field (its fields: {sorted(record)[:10]}); choose one with --text-key")
    if not isinstance(record[text_key], str):
        raise ValueError(f"{text_key!r} is a {type(record[text_key]).__name__}, not a string")
    return record[text_key]


class _Reader:
    """The documents of the sources as `Piece` s, in order, counting what is read and left out in ``stats``."""

    def __init__(self, files: List[Path], text_key: str, val_fraction: float, chunk_bytes: int, binary: bool,
                 stats: Preparation) -> None:
        self.files, self.text_key, self.val_fraction = files, text_key, val_fraction
        self.chunk_bytes, self.binary, self.stats = chunk_bytes, binary, stats
        self.index = 0  # documents so far, the val split's clock

    def _is_val(self) -> bool:
        k, f = self.index, self.val_fraction
        return int((k + 1) * f) > int(k * f)

    def __iter__(self) -> Iterator[Piece]:
        for path in self.files:
            kind = _kind(path)
            if kind == "text" and looks_binary(path):
                self.stats.dropped["binary file"] += 1
                continue
            self.stats.files += 1
            if kind == "text":
                yield from self._text_document(path)
                continue
            for where, record in read_items(path):
                self.stats.records += 1
                try:
                    text = _record_text(record, self.text_key)
                except ValueError as e:
                    self.stats.malformed.append(f"{where}: {e}")
                    continue
                if not text.strip():
                    self.stats.dropped["empty document"] += 1
                    continue
                self.stats.bytes += len(text.encode("utf-8"))
                yield Piece(text.encode("utf-8") if self.binary else text, True, self._is_val())
                self.index += 1

    def _text_document(self, path: Path) -> Iterator[Piece]:
        held: Optional[List[Tuple[bytes, bool]]] = []  # the leading pieces that are only white space
        val = self._is_val()
        for data, ends in text_pieces(path, self.chunk_bytes):
            if held is not None:
                held.append((data, ends))
                if not data.strip() and not ends:
                    continue
                if not any(piece.strip() for piece, _ in held):  # the whole file: empty, or only white space
                    self.stats.dropped["empty document"] += 1
                    return
                pieces, held = held, None
            else:
                pieces = [(data, ends)]
            for piece, last in pieces:
                self.stats.bytes += len(piece)
                yield Piece(piece if self.binary else piece.decode("utf-8", errors="replace"), last, val)
        self.index += 1


# ---------------------------------------------------------------------------------------------- writing
class _ShardWriter:
    """One split's shard files, a new one begun at the first document end past ``shard_tokens``."""

    def __init__(self, folder: Path, split: str, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.shards: List[Dict[str, Any]] = []
        self.file: Optional[io.BufferedWriter] = None

    def write(self, data: bytes, tokens: int, ends: bool) -> None:
        if self.file is None:
            name = f"{self.split}-{len(self.shards):05d}.bin"
            self.file = open(self.folder / name, "wb")
            self.shards.append({"file": name, "tokens": 0, "documents": 0})
        self.file.write(data)
        shard = self.shards[-1]
        shard["tokens"] += tokens
        shard["documents"] += int(ends)
        if ends and shard["tokens"] >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def entry(self) -> Dict[str, Any]:
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards)}


def _prepare_out(out: Path, overwrite: bool) -> None:
    """``out`` made, new or empty; a previous preparation in it removed with ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a folder")
    entries = list(out.iterdir()) if out.is_dir() else []
    if entries:
        ours = all(p.is_file() and (p.suffix == ".bin" or p.name in (INDEX_FILE, INDEX_FILE + ".tmp", MALFORMED_FILE))
                   for p in entries)
        if not (ours and overwrite):
            hint = "pass --overwrite to replace the preparation in it" if ours else "choose a new or empty folder"
            raise DataError(f"--out {out}: not empty ({hint})")
        for p in entries:
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def prepare(
    sources: Sequence[PathLike],
    out: PathLike,
    tokenizer: Optional[PathLike] = None,
    *,
    text_key: str = "text",
    val_fraction: float = 0.005,
    workers: int = 0,
    shard_tokens: int = 2**28,
    skip_malformed: bool = False,
    eot_id: Optional[int] = None,
    overwrite: bool = False,
    chunk_bytes: int = 4 << 20,
    task_bytes: int = 1 << 20,
    progress: bool = False,
) -> Preparation:
    """Tokenise ``sources`` into ``out`` (see the module docstring); returns what was read, written and left out.

    ``tokenizer``: a folder holding a Hugging Face tokenizer (a model folder); ``None``: bytes. ``workers``: worker
    processes (0: this one). ``eot_id``: the end-of-text id where the tokenizer has no ``eos_token``. Raises
    `DataError` for a source, tokenizer or output folder that cannot be used, and for malformed records unless
    ``skip_malformed``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction}: valid values are in [0, 1)")
    if workers < 0 or shard_tokens < 1:
        raise DataError(f"workers={workers}, shard_tokens={shard_tokens}: workers >= 0 and shard_tokens >= 1")
    out = Path(out)
    files = _source_files(sources)
    if tokenizer is not None and not has_tokenizer(tokenizer):
        raise DataError(f"--tokenizer {tokenizer}: no tokenizer files in it (tokenizer.json, tokenizer_config.json,"
                        " tokenizer.model, vocab.json): give a model folder with its tokenizer, or leave --tokenizer"
                        " out for bytes")
    folder = str(tokenizer) if tokenizer is not None else None
    loaded = _load_tokenizer(folder)
    vocab_size = len(loaded) if loaded is not None else 256
    if eot_id is None:
        eot_id = loaded.eos_token_id if loaded is not None else 0
    if eot_id is None or not 0 <= eot_id < vocab_size:
        raise DataError(f"end-of-text id {eot_id!r}: the tokenizer of {tokenizer} has no eos_token; pass --eot-id with"
                        f" an id in [0, {vocab_size})")
    dtype = token_dtype(vocab_size)
    _prepare_out(out, overwrite)

    stats = Preparation()
    reader = _Reader(files, text_key, val_fraction, chunk_bytes, loaded is None, stats)
    writers = {"train": _ShardWriter(out, "train", shard_tokens), "val": _ShardWriter(out, "val", shard_tokens)}
    local = PieceTokenizer(loaded, eot_id, dtype)
    start = time.perf_counter()
    bar = _progress(files, progress)
    pieces = _until_malformed(iter(reader), stats, skip_malformed)
    first = next(pieces, None)
    if first is not None:
        pieces = itertools.chain([first], pieces)
    pool = None
    if workers:
        sample = first.text[:4096] if first is not None and isinstance(first.text, str) else ""
        # A process pool that fails as a whole (a worker that dies, or cannot load the tokenizer, breaks it) rather
        # than multiprocessing.Pool's, which starts a dead worker's successor and waits for its result forever.
        pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker,
                                   (_worker_spec(loaded, folder, sample), eot_id, dtype))
    try:
        pending: deque = deque()
        for task in _tasks(pieces, task_bytes):
            pending.append(pool.submit(_work, task) if pool else _Done(local(task)))
            while len(pending) > 2 * workers:  # bounded: the reader waits for the workers
                _write(pending.popleft().result(), writers, stats, bar)
        while pending:
            _write(pending.popleft().result(), writers, stats, bar)
    except BrokenProcessPool as e:
        raise DataError(f"a tokenising worker process died ({e}); run with --workers 0 to see its error") from None
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        for writer in writers.values():
            writer.close()
        if bar is not None:
            bar.close()
    stats.seconds = time.perf_counter() - start
    if stats.malformed:
        (out / MALFORMED_FILE).write_text("\n".join(stats.malformed) + "\n")
        if not skip_malformed:
            named = "; ".join(stats.malformed[:_NAMED])
            raise DataError(f"{len(stats.malformed)} malformed record(s): {named}"
                            f"{' ...' if len(stats.malformed) > _NAMED else ''} (all in {out / MALFORMED_FILE});"
                            " fix them, or pass --skip-malformed to leave them out")
        stats.dropped["malformed record"] = len(stats.malformed)
    if not stats.tokens["train"]:
        raise DataError(f"no training tokens from {[str(s) for s in sources]}: {stats.files} files,"
                        f" {stats.records} records read, left out {dict(stats.dropped)}")
    index = {
        "format": FORMAT, "version": 1, "dtype": dtype, "eot_id": eot_id, "vocab_size": vocab_size,
        "max_token_id": stats.max_token_id, "tokenizer": str(Path(tokenizer).resolve()) if tokenizer else None,
        "text_key": text_key, "val_fraction": val_fraction,
        "splits": {split: writer.entry() for split, writer in writers.items()},
        "read": {"files": stats.files, "records": stats.records, "bytes": stats.bytes},
        "dropped": dict(stats.dropped), "sources": [str(Path(s).resolve()) for s in sources],
    }
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(out / INDEX_FILE)
    return stats


def _until_malformed(pieces: Iterator[Piece], stats: Preparation, skip_malformed: bool) -> Iterator[Piece]:
    """The pieces until a malformed record, where those are not skipped -- then nothing more is tokenised, but the
    rest is still read, to name every malformed record."""
    for piece in pieces:
        if stats.malformed and not skip_malformed:
            for _ in pieces:
                pass
            return
        yield piece


def _write(result: Any, writers: Dict[str, _ShardWriter], stats: Preparation, bar: Any) -> None:
    pieces, top, removed = result
    stats.max_token_id = max(stats.max_token_id, top)
    if removed:
        stats.dropped["NUL byte (removed)"] += removed
    for data, tokens, ends, val in pieces:
        split = "val" if val else "train"
        writers[split].write(data, tokens, ends)
        stats.tokens[split] += tokens
        stats.documents[split] += int(ends)
    if bar is not None:
        bar.n = stats.bytes
        bar.refresh()


def _progress(files: List[Path], enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files if p.is_file() and _kind(p) == "text")
    unknown = any(_kind(p) != "text" for p in files)  # records' text is counted as read, not the files' size
    return tqdm(total=None if unknown else total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- command line
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_hybrid.data.prepare``: see the module docstring; one ``error: ...`` line and exit code 2
    for a data error."""
    parser = argparse.ArgumentParser(prog="python -m lightning_hybrid.data.prepare",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", help="text / JSONL / JSON / parquet / arrow files or folders")
    parser.add_argument("--out", required=True, help="the folder to write (empty or new)")
    parser.add_argument("--tokenizer", default=None, help="a folder with a Hugging Face tokenizer; default: bytes")
    parser.add_argument("--text-key", default="text", help="the field of a record that holds its text (text)")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="documents for the val split (0.005)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenising processes (CPUs)")
    parser.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard file (2**28)")
    parser.add_argument("--eot-id", type=int, default=None, help="end-of-text id (default: the eos_token's)")
    parser.add_argument("--skip-malformed", action="store_true", help="leave malformed records out (listed)")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous preparation in --out")
    args = parser.parse_args(argv)
    try:
        stats = prepare(args.sources, args.out, args.tokenizer, text_key=args.text_key, val_fraction=args.val_fraction,
                        workers=args.workers, shard_tokens=args.shard_tokens, skip_malformed=args.skip_malformed,
                        eot_id=args.eot_id, overwrite=args.overwrite, progress=True)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    index = json.loads((Path(args.out) / INDEX_FILE).read_text())
    rate = stats.bytes / 2**20 / max(stats.seconds, 1e-9)
    print(f"read {stats.files} files, {stats.records} records, {stats.bytes / 2**20:.1f} MiB in {stats.seconds:.1f} s"
          f" ({rate:.1f} MiB/s); left out {dict(stats.dropped) or 'nothing'}")
    for split in ("train", "val"):
        print(f"{split}: {stats.documents[split]} documents, {stats.tokens[split]} tokens in"
              f" {len(index['splits'][split]['shards'])} shard(s)")
    if stats.malformed:
        print(f"{len(stats.malformed)} malformed records left out: {Path(args.out) / MALFORMED_FILE}")
    print(f"train on it: data=shards data.path={Path(args.out).resolve()} model.vocab_size={index['vocab_size']}"
          " (the reference GPT's; a Hugging Face model has its own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
