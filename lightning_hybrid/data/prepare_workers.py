"""The tokenising side of `lightning_hybrid.data.prepare`: the `Piece` s a corpus is read in, `PieceTokenizer`,
which turns them into token bytes, and the worker processes that run it (their tokenizer: the fast tokenizer's own
backend where it gives the same ids, so a worker needs neither ``transformers`` nor torch). Standard library only at
import: the workers import this module."""

from __future__ import annotations

import array
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

__all__ = ["Piece", "PieceTokenizer"]


@dataclass
class Piece:
    """Text of one document (all of it, or a piece cut at a line end), whether it ends the document, its split."""

    text: Union[str, bytes]
    ends: bool
    val: bool


class PieceTokenizer:
    """Pieces to token bytes of ``dtype`` (``"uint16"``, ``"uint32"``), the end-of-text id after a document's last
    piece (none where ``eot_id`` is ``None``), in a worker process or in this one; ``tokenizer`` ``None``: bytes."""

    def __init__(self, tokenizer: Any, eot_id: Optional[int], dtype: str) -> None:
        self.tokenizer, self.eot_id, self.typecode = tokenizer, eot_id, "H" if dtype == "uint16" else "I"

    def __call__(self, pieces: List[Piece]) -> Tuple[List[Tuple[bytes, int, bool, bool]], int, int]:
        """``([(token bytes, tokens, ends document, val)], max id, NUL bytes removed)``."""
        removed = 0
        if self.tokenizer is None:
            texts = [p.text for p in pieces]
            removed = sum(t.count(b"\0") for t in texts)
            ids_of = [list(t.replace(b"\0", b"")) if removed else list(t) for t in texts]
        else:
            ids_of = self.tokenizer([p.text for p in pieces], add_special_tokens=False, split_special_tokens=True,
                                    verbose=False)["input_ids"]
        out, top = [], 0
        for piece, ids in zip(pieces, ids_of):
            if piece.ends and self.eot_id is not None:
                ids = [*ids, self.eot_id]
            top = max(top, max(ids, default=0))
            out.append((array.array(self.typecode, ids).tobytes(), len(ids), piece.ends, piece.val))
        return out, top, removed


def _load_tokenizer(folder: Optional[str]) -> Any:
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class _Backend:
    """A fast tokenizer's own ``tokenizers.Tokenizer`` (what ``transformers`` runs: its ``backend_tokenizer``), called
    as `PieceTokenizer` calls a ``transformers`` tokenizer: a worker process needs neither ``transformers`` nor
    ``torch`` (a few tens of MiB, not some hundreds)."""

    def __init__(self, serialized: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(serialized)
        self.tokenizer.encode_special_tokens = True  # special-token strings read as text: split_special_tokens

    def __call__(self, texts: List[str], **_: Any) -> Dict[str, List[List[int]]]:
        return {"input_ids": [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]}


#: Text the choice of the workers' tokenizer is checked on, beside the corpus's first piece.
_PROBE = ["Hello world!  Two  spaces,\ttabs\n\nand lines.\n", "ünïcödé 中文 😀 1234567 x=y+1;", "  leading", "end "]


def _worker_spec(tokenizer: Any, folder: Optional[str], sample: str) -> Tuple[str, Optional[str]]:
    """What the worker processes tokenise with: ``("bytes", None)``; ``("backend", json)`` -- the fast tokenizer's
    backend, where it gives ``tokenizer``'s ids on ``sample`` and `_PROBE` (with its special tokens' strings); else
    ``("folder", folder)``: ``transformers`` loads it in each worker."""
    if tokenizer is None:
        return ("bytes", None)
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        serialized = backend.to_str()
        texts = [*_PROBE, " ".join(getattr(tokenizer, "all_special_tokens", [])) + " x", sample]
        expected = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if _Backend(serialized)(texts)["input_ids"] == expected:
            return ("backend", serialized)
    return ("folder", folder)


_WORKER: Optional[PieceTokenizer] = None


def _start_worker(spec: Tuple[str, Optional[str]], eot_id: int, dtype: str) -> None:
    global _WORKER  # one tokenizer per worker process, made once (the pool's initializer protocol)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    kind, value = spec
    tokenizer = None if kind == "bytes" else _Backend(value) if kind == "backend" else _load_tokenizer(value)
    _WORKER = PieceTokenizer(tokenizer, eot_id, dtype)


def _work(pieces: List[Piece]) -> Any:
    assert _WORKER is not None
    return _WORKER(pieces)


class _Done:
    """A task tokenised in this process, with the ``result`` of a pool's ``Future``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def _tasks(pieces: Iterator[Piece], task_bytes: int) -> Iterator[List[Piece]]:
    task, size = [], 0
    for piece in pieces:
        task.append(piece)
        size += len(piece.text)
        if size >= task_bytes:
            yield task
            task, size = [], 0
    if task:
        yield task
