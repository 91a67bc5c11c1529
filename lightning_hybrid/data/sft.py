"""Fine-tuning data: chat records as dict batches, packed or padded, the loss on the assistant's tokens.

The records (OpenAI messages with tools and tool calls, ShareGPT conversations, instructions) and the files they come
in (``.jsonl``, ``.jsonl.gz``, ``.json``, and with ``datasets`` ``.parquet``, ``.arrow`` and ``save_to_disk``
folders) are read by `lightning_hybrid.data.chat_formats` into messages ``{"role": "system" | "user" | "assistant" |
"tool", ...}`` and the record's ``tools``.

Each conversation becomes one **document**: token ids and, per token, whether it is trained: the tokens of each
assistant message (its content and tool calls) and its end-of-turn marker; not the system, user and tool messages,
the headers or the generation prompt. With the tokenizer's chat template (``tokenizer.chat_template``; ``tools`` and
``tool_calls`` passed to it as given), one of three ways, the first that applies:

1. the template has ``{% generation %}`` blocks: transformers' ``apply_chat_template(...,
   return_assistant_tokens_mask=True)``, the tokens overlapping a block trained;
2. the template is **prefix-consistent** on the conversation: each rendering of a longer prefix
   (``apply_chat_template(messages[:i])``; before an assistant message with ``add_generation_prompt=True``, so the
   assistant header is prompt) starts with the rendering of the shorter one. The text between renderings is
   tokenised piece by piece (``add_special_tokens=False``), the pieces an assistant message adds trained: exactly
   the tokens a model generates after the prompt's own tokens;
3. otherwise (a template that rewrites earlier turns, e.g. Mistral v0.3's, which moves the system prompt and the
   tools into the last user turn) the whole conversation is rendered once and each assistant message's **span**
   located in it, in order. Its text is the end of the rendering of ``messages[:i + 1]`` (it the last message)
   after the most of the rendering of ``messages[:i]`` with the generation prompt, past what the two share from
   their start: content or tool calls, then the end-of-turn text. It is searched for at or after the previous span,
   preceded by the longest end of the text before it that is found there (`_anchor`). The rendering is tokenised
   once with the (fast) tokenizer's offsets; a token is trained iff it overlaps a span (a token across a span's
   edge is one the model generates). A span that cannot be located -- the template renders the message
   differently when others follow it, or adds no text for it -- is a `DataError` for that record, never a guessed
   mask.

Without a template (``tokenizer`` without one, or ``None``: bytes, one byte = one token, vocabulary 256) the
**plain format**: ``<|tools|>\\n{tools as JSON}\\n`` first when the record has tools, then per message::

    <|{role}|>\\n{content}\\n
    <|assistant|>\\n<tool_call>{"name": ..., "arguments": ...}</tool_call>\\n    (one line per tool call)

where every header and every non-assistant message is prompt, and an assistant's ``{content}\\n`` (when it has
content or no tool calls) and tool-call lines are trained, followed by the tokenizer's eos token (trained) when it
has one. No BOS token is added.

A document's labels are its ids shifted by one (``labels[t]`` = the token at ``t + 1``), ``-100`` where that target
is not trained (unless ``train_on_prompt``), at the document's last token and at padding: the batch format of
`lightning_hybrid.core.batch` (dicts of ``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, all ``(B, T)``
int64, positions restarting at 0 at every document).

Nothing is dropped without a word: `SFTDataModule.statistics` counts the records read, dropped (by reason), cut to
``block_size`` and malformed, and what the rows hold; malformed records are one `DataError` unless
``skip_malformed``, and what is skipped, dropped or cut is a rank-zero warning.

Shape legend: ``T`` = ``block_size``, ``B`` = ``batch_size``, ``R`` = rows.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_hybrid.core.batch import IGNORE_INDEX
from lightning_hybrid.data.chat_formats import Record, check_paths, read_records
from lightning_hybrid.data.corpus import (
    TOKENIZER_FILES,
    ByteCorpusDataModule,
    DataError,
    DataPosition,
    has_tokenizer,
    statistics_line,
)
from lightning_hybrid.data.sft_tokens import (  # the private names re-exported: the tests import them from here
    Document,
    _located_document,  # noqa: F401
    _prefix_pieces,  # noqa: F401
    _renderer,  # noqa: F401
    tokenize_conversation,
)

__all__ = [
    "IGNORE_INDEX",
    "PackedRows",
    "SFTDataModule",
    "batch_statistics",
    "pack_documents",
    "tokenize_conversation",
]

PathLike = Union[str, os.PathLike]
_MALFORMED_SHOWN = 5  # in the error
_MALFORMED_LISTED = 20  # in the warning


# ---------------------------------------------------------------------------------------------- rows
def pack_documents(docs: Sequence[Document], block_size: int, pad_id: int, pack: bool = True) -> Dict[str, Tensor]:
    """Documents (token ids, per-token trained flags) as the rows of the batch format, every tensor ``(R, T)`` int64.

    ``pack``: greedy in order, a document goes into the current row if it fits in what is left of it, else starts
    a new row; otherwise one document per row. The rest of a row is padding (``pad_id``, attention 0, position 0,
    label -100). ``labels[r, t]`` is the token at ``t + 1`` where that token is in the same document and trained,
    else -100. Raises `DataError` for an empty document or one longer than ``block_size``.
    """
    rows: List[List[Document]] = []
    used = block_size  # no open row yet
    for i, (ids, trained) in enumerate(docs):
        if not 0 < len(ids) <= block_size or len(trained) != len(ids):
            raise DataError(f"document {i} has {len(ids)} tokens and {len(trained)} flags: it needs 1 to"
                             f" block_size={block_size} tokens, one flag each")
        if pack and used + len(ids) <= block_size:
            rows[-1].append((ids, trained))
            used += len(ids)
        else:
            rows.append([(ids, trained)])
            used = len(ids)
    columns: Dict[str, List[List[int]]] = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": []}
    for row in rows:
        out = {key: [] for key in columns}
        for ids, trained in row:
            out["input_ids"] += ids
            out["labels"] += [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])] + [IGNORE_INDEX]
            out["attention_mask"] += [1] * len(ids)
            out["position_ids"] += range(len(ids))
        pad = block_size - len(out["input_ids"])
        for key, fill in (("input_ids", pad_id), ("labels", IGNORE_INDEX), ("attention_mask", 0), ("position_ids", 0)):
            columns[key].append(out[key] + [fill] * pad)
    # Data is built on the CPU (the loaders' pinned-memory path and Lightning move batches to the device).
    return {key: torch.tensor(value, dtype=torch.int64, device="cpu").reshape(len(rows), block_size)
            for key, value in columns.items()}


def batch_statistics(rows: Dict[str, Tensor]) -> Dict[str, float]:
    """``rows``, ``documents``, ``tokens`` (real, not padding), ``loss_tokens`` (labels other than -100) and
    ``packing_efficiency`` (tokens / (rows * T)) of batch-format tensors."""
    mask = rows["attention_mask"].bool()
    n, block_size = mask.shape
    tokens = int(mask.sum())
    return {
        "rows": n,
        "documents": int(((rows["position_ids"] == 0) & mask).sum()),
        "tokens": tokens,
        "loss_tokens": int((rows["labels"] != IGNORE_INDEX).sum()),
        "packing_efficiency": tokens / (n * block_size) if n else 0.0,
    }


class PackedRows(Dataset):
    """The rows of batch-format tensors: item ``i`` is ``{key: tensor[i]}`` (each ``(T,)``), which the default
    collate function stacks into a dict batch of ``(B, T)`` tensors."""

    def __init__(self, rows: Dict[str, Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, i: int) -> Dict[str, Tensor]:
        return {key: value[i] for key, value in self.rows.items()}


# ---------------------------------------------------------------------------------------------- data module
@dataclass
class _Tally:
    """What became of the records, both splits: for `SFTDataModule.statistics` and the warnings."""

    malformed: List[str] = field(default_factory=list)  # "file:line: why"
    dropped: Counter = field(default_factory=Counter)  # reason -> records
    truncated: int = 0  # kept, cut to block_size
    longest: int = 0  # tokens, before any cut
    too_long: List[Tuple[str, int]] = field(default_factory=list)  # (where, tokens) under truncate=False


def _malformed_error(malformed: List[str], read: int) -> DataError:
    shown = "; ".join(malformed[:_MALFORMED_SHOWN])
    more = f"; and {len(malformed) - _MALFORMED_SHOWN} more" if len(malformed) > _MALFORMED_SHOWN else ""
    return DataError(f"{len(malformed)} of {read} records are malformed (not a chat record, or one the chat template"
                     f" cannot render): {shown}{more}. Fix them, or set data.skip_malformed=true to skip them (each"
                     " listed in a warning and in statistics()['malformed'])")


def _skipped_warning(malformed: List[str]) -> str:
    listed = "".join(f"\n  {m}" for m in malformed[:_MALFORMED_LISTED])
    more = f"\n  ... and {len(malformed) - _MALFORMED_LISTED} more" if len(malformed) > _MALFORMED_LISTED else ""
    return f"data: skipped {len(malformed)} malformed records (data.skip_malformed=true):{listed}{more}"


def _losses_warning(tally: _Tally, read: int, block_size: int) -> Optional[str]:
    """One line on what was dropped (but the malformed, warned of apart) and cut; ``None`` when nothing was."""
    dropped = {reason: n for reason, n in tally.dropped.items() if reason != "malformed"}
    parts = []
    if dropped:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in dropped.items())
        parts.append(f"dropped {sum(dropped.values())} of {read} records ({reasons})")
    if tally.truncated:
        parts.append(f"cut {tally.truncated} of {read} records to block_size={block_size} tokens (the longest has"
                     f" {tally.longest}; raise data.block_size to keep them whole)")
    return "data: " + "; ".join(parts) if parts else None


class SFTDataModule(DataPosition, L.LightningDataModule):
    """Supervised fine-tuning on chat / instruction records (see the module docstring and
    `lightning_hybrid.data.chat_formats`), dict batches of ``(B, T)`` int64 tensors: ``input_ids``, ``labels`` (shifted,
    -100 off the assistant's tokens), ``attention_mask``, ``position_ids``.

    Args:
        path: a file (``.jsonl``, ``.jsonl.gz``, ``.json``, ``.json.gz``, ``.parquet``, ``.arrow``), a folder
            written by ``Dataset.save_to_disk``, or a list of them (read in order).
        tokenizer: a local Hugging Face folder (e.g. the model's own) whose tokenizer is used (its chat template if
            it has one, else the plain format); ``None``, or a folder without a tokenizer: bytes (vocabulary 256;
            the latter said in a warning).
        block_size: row length ``T``.
        batch_size: per-process batch size ``B``.
        pack: pack several documents into a row (greedy, in order); ``False``: one document per row, padded.
        val_fraction: the last ``val_fraction`` of the records (at least one, and at least one left for training,
            when there are two or more; none when 0) are the validation (and test) split.
        train_on_prompt: take the loss on the prompt's tokens too, not only the assistant's.
        truncate: cut a document longer than ``block_size`` to its first ``block_size`` tokens (counted, warned);
            ``False``: such documents are a `DataError` naming the first and how many.
        shuffle: shuffle the training records before packing, and the rows every epoch (seeded by ``seed``).
        seed: seed of the shuffling.
        num_workers: DataLoader workers.
        skip_malformed: skip malformed records (bad JSON, not a record, one the chat template cannot render or
            locate), each listed in a warning and in ``statistics()["malformed"]``; ``False``: they are one
            `DataError` naming how many and the first few, found by reading the whole input.

    Everything is built once in :meth:`setup`, identically on every rank. A record with no assistant turn (unless
    ``train_on_prompt``) or no trained target left (e.g. a prompt cut to ``block_size``) is dropped: it would take no
    loss; it is counted and warned of. After setup, :meth:`statistics` says what became of every record, and
    ``rows``, ``documents``, ``tokens``, ``loss_tokens`` and ``packing_efficiency`` describe the training split
    (`batch_statistics`). No ``DistributedSampler`` is created here: the strategy injects it
    (`lightning_hybrid.runtime.sample_order`).
    """

    def __init__(
        self,
        path: Union[PathLike, Sequence[PathLike]],
        tokenizer: Optional[PathLike] = None,
        block_size: int = 1024,
        batch_size: int = 8,
        pack: bool = True,
        val_fraction: float = 0.05,
        train_on_prompt: bool = False,
        truncate: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        skip_malformed: bool = False,
    ) -> None:
        super().__init__()
        if block_size <= 1 or batch_size <= 0:
            raise DataError(f"block_size must be > 1 and batch_size > 0, got {block_size}, {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.paths = check_paths([path] if isinstance(path, (str, os.PathLike)) else list(path))
        if tokenizer is not None and not os.path.isdir(tokenizer):
            raise FileNotFoundError(f"tokenizer: {str(tokenizer)!r} is not a folder (a Hugging Face model folder,"
                                    " or null for bytes)")
        self.block_size = block_size
        self.batch_size = batch_size
        self.pack = pack
        self.val_fraction = val_fraction
        self.train_on_prompt = train_on_prompt
        self.truncate = truncate
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.skip_malformed = skip_malformed
        self.tokenizer = None
        if tokenizer is None:
            self.tokenizer_name = "bytes"
        elif has_tokenizer(tokenizer):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
            self.tokenizer_name = str(tokenizer)
        else:
            self.tokenizer_name = f"bytes (no tokenizer files in {tokenizer})"
            rank_zero_warn(f"tokenizer: {str(tokenizer)!r} has none of the tokenizer files {list(TOKENIZER_FILES)}:"
                           " the fine-tuning data is bytes (vocabulary 256, the plain format, no chat template)")
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else ByteCorpusDataModule.vocab_size
        self.pad_token_id = next((i for i in (getattr(self.tokenizer, "pad_token_id", None),
                                              getattr(self.tokenizer, "eos_token_id", None)) if i is not None), 0)
        self.train_rows: Optional[Dict[str, Tensor]] = None
        self.val_rows: Optional[Dict[str, Tensor]] = None
        self._statistics: Optional[Dict[str, Any]] = None

    def prepare_data(self) -> None:
        """Nothing to download: the records are read from local files in :meth:`setup`."""

    def setup(self, stage: Optional[str] = None) -> None:
        """Read, split, tokenise and pack the records (once); `DataError` for malformed records (unless
        ``skip_malformed``), records too long (under ``truncate=False``) or a training split without a full batch."""
        if self.train_rows is not None:
            return
        records, malformed = read_records(self.paths)
        read = len(records) + len(malformed)
        n = len(records)
        n_val = min(max(int(n * self.val_fraction), 1), n - 1) if n >= 2 and self.val_fraction > 0 else 0
        train, val = records[: n - n_val], records[n - n_val:]
        if self.shuffle:
            generator = torch.Generator(device="cpu").manual_seed(self.seed)
            order = torch.randperm(len(train), generator=generator, device=generator.device).tolist()
            train = [train[i] for i in order]
        tally = _Tally(malformed=malformed)
        train_docs, val_docs = self._tokenize_records(train, tally), self._tokenize_records(val, tally)
        if tally.malformed and not self.skip_malformed:
            raise _malformed_error(tally.malformed, read)
        if tally.too_long:
            (where, length), others = tally.too_long[0], len(tally.too_long) - 1
            also = f" (and {others} more records, the longest with {tally.longest} tokens)" if others else ""
            raise DataError(f"{where}: the record has {length} tokens, more than block_size={self.block_size}{also}:"
                            " raise block_size, or set truncate=true to cut them")
        if tally.malformed:
            tally.dropped["malformed"] = len(tally.malformed)
            rank_zero_warn(_skipped_warning(tally.malformed))
        losses = _losses_warning(tally, read, self.block_size)
        if losses:
            rank_zero_warn(losses)
        train_rows = pack_documents(train_docs, self.block_size, self.pad_token_id, self.pack)
        val_rows = pack_documents(val_docs, self.block_size, self.pad_token_id, self.pack)
        train_stats = batch_statistics(train_rows)
        statistics = {
            "tokenizer": self.tokenizer_name, "records": read, "dropped": dict(tally.dropped),
            "malformed": tally.malformed, "truncated": tally.truncated, "longest": tally.longest,
            "block_size": self.block_size, **train_stats,
            **{f"val_{key}": value for key, value in batch_statistics(val_rows).items()},
        }
        if train_stats["rows"] < self.batch_size:
            raise DataError(f"the training split makes {train_stats['rows']} rows, fewer than"
                            f" batch_size={self.batch_size}: no full batch ({n - n_val} records in {self.paths};"
                            f" {statistics_line(statistics)})")
        self.train_rows, self.val_rows, self._statistics = train_rows, val_rows, statistics
        for key, value in train_stats.items():
            setattr(self, key, value)

    def _tokenize_records(self, records: Sequence[Record], tally: _Tally) -> List[Document]:
        """The records' documents (token ids, trained flags), cut or refused past ``block_size``; what was dropped,
        cut or malformed counted in ``tally``."""
        docs = []
        for record in records:
            if not self.train_on_prompt and not any(m["role"] == "assistant" for m in record.messages):
                tally.dropped["no assistant turn"] += 1
                continue
            try:
                ids, trained = tokenize_conversation(record.messages, self.tokenizer, record.tools)
            except DataError as e:
                tally.malformed.append(f"{record.where}: {e}")
                continue
            tally.longest = max(tally.longest, len(ids))
            cut = len(ids) > self.block_size
            if cut and not self.truncate:
                tally.too_long.append((record.where, len(ids)))
                continue
            ids, trained = ids[: self.block_size], trained[: self.block_size]
            if self.train_on_prompt:
                trained = [True] * len(ids)
            if not any(trained[1:]):
                tally.dropped["no trained token left after truncation" if cut else "no trained token"] += 1
                continue
            tally.truncated += cut
            docs.append((ids, trained))
        return docs

    def statistics(self) -> Dict[str, Any]:
        """What became of the records (after :meth:`setup`; JSON-serialisable, printed by
        `lightning_hybrid.data.corpus.statistics_line`). Over the whole input (the split is made after reading):
        ``tokenizer`` (its folder, or ``"bytes ..."``), ``records`` (read), ``dropped`` (reason -> records:
        ``"no assistant turn"``, ``"no trained token left after truncation"``, ``"malformed"`` when skipped, ...),
        ``malformed`` (``"file:line: why"`` of each skipped one), ``truncated`` (records cut to ``block_size`` and
        kept), ``longest`` (tokens of the longest record, before any cut), ``block_size``. Of the training split's
        rows (`batch_statistics`): ``rows``, ``documents``, ``tokens`` (real, not padding), ``loss_tokens``,
        ``packing_efficiency``; the validation split's as ``val_rows``, ``val_documents``, ... Every record is
        accounted for: ``records == documents + val_documents + sum(dropped.values())``."""
        if self._statistics is None:
            raise RuntimeError("call setup() before statistics()")
        return copy.deepcopy(self._statistics)

    def _require(self, rows: Optional[Dict[str, Tensor]]) -> PackedRows:
        if rows is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        return PackedRows(rows)

    def train_dataloader(self) -> DataLoader:
        return self.resumable_loader(self._require(self.train_rows), self.batch_size, self.shuffle, self.seed,
                                     self.num_workers)

    def val_dataloader(self) -> DataLoader:
        # The last batch kept even when partial: a small validation split still gives a loss.
        return DataLoader(self._require(self.val_rows), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The test split is the validation split."""
        return self.val_dataloader()
