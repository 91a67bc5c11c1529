"""Fine-tuning data: chat and instruction records (JSONL) as dict batches, packed or padded, the loss on the answers.

Records, one JSON object per line of a ``.jsonl`` file (blank lines skipped):

* chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``;
* instruction: ``{"prompt" | "instruction": str, "input": str (optional), "response" | "output" | "completion": str}``,
  read as the messages ``[user: instruction (+ "\\n\\n" + input), assistant: response]``.

Each conversation becomes one **document**: token ids and, per token, whether it is an answer token (one an
assistant message adds). Two ways to write it as tokens:

* the tokenizer has a chat template (``tokenizer.chat_template``): the conversation is rendered prefix by prefix
  (``apply_chat_template(messages[:i], tokenize=False)``; before an assistant message with
  ``add_generation_prompt=True``, so the assistant header is prompt), each rendering must extend the one before
  it (else ``ValueError``: masking needs a template that only appends), and the text each assistant message adds
  -- its content and end-of-turn marker -- is its answer tokens. The pieces between renderings are tokenised one
  by one (``add_special_tokens=False``), so the tokens of the conversation start with the tokens of each prefix;
* otherwise (no template, or bytes: one byte = one token, vocabulary 256) the plain format, per message::

      <|{role}|>\\n{content}\\n

  where the ``<|assistant|>\\n`` header is prompt and ``{content}\\n`` the answer, followed by the tokenizer's eos
  token (an answer token) when it has one. No BOS token is added.

A document's labels are its ids shifted by one (``labels[t]`` = the token at ``t + 1``), ``-100`` where that target
is not an answer token (unless ``train_on_prompt``), at the document's last token and at padding: the batch format
of `lightning_hybrid.batch` (dicts of ``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, all
``(B, T)`` int64, positions restarting at 0 at every document).

Shape legend: ``T`` = ``block_size``, ``B`` = ``batch_size``, ``R`` = rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_hybrid.batch import IGNORE_INDEX
from lightning_hybrid.data import ByteCorpusDataModule, DataPosition, has_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "PackedRows",
    "Record",
    "SFTDataModule",
    "batch_statistics",
    "pack_documents",
    "read_records",
    "to_messages",
    "tokenize_conversation",
]

PathLike = Union[str, os.PathLike]
#: A document: token ids and, per token, whether it is trained (an answer token).
Document = Tuple[List[int], List[bool]]

#: The roles a chat message may have.
ROLES = ("system", "user", "assistant")
_PROMPT_KEYS = ("prompt", "instruction")
_RESPONSE_KEYS = ("response", "output", "completion")
_VALID = ('each line is one JSON object: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}'
          ' or {"prompt"|"instruction": str, "input": str (optional), "response"|"output"|"completion": str}')


# ---------------------------------------------------------------------------------------------- records
class Record(NamedTuple):
    """One conversation and where it was read (``"file:line"``, for error messages)."""

    where: str
    messages: List[Dict[str, str]]


def to_messages(record: Any) -> List[Dict[str, str]]:
    """The messages of a chat or instruction record (see the module docstring); ``ValueError`` saying what is
    wrong otherwise."""
    if not isinstance(record, dict):
        raise ValueError(f"got a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"'messages' must be a non-empty list, got {messages!r}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] = {m!r} must be {{\"role\": one of {list(ROLES)}, \"content\": str}}")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompts = [k for k in _PROMPT_KEYS if k in record]
    responses = [k for k in _RESPONSE_KEYS if k in record]
    if len(prompts) != 1 or len(responses) != 1:
        raise ValueError(f"an instruction record needs exactly one of {list(_PROMPT_KEYS)} and one of"
                         f" {list(_RESPONSE_KEYS)}, got keys {sorted(record)}")
    fields = {"prompt": record[prompts[0]], "input": record.get("input", ""), "response": record[responses[0]]}
    for name, value in fields.items():
        if not isinstance(value, str):
            raise ValueError(f"{name!r} must be a string, got {value!r}")
    prompt = fields["prompt"] + ("\n\n" + fields["input"] if fields["input"] else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["response"]}]


def read_records(paths: Union[PathLike, Sequence[PathLike]]) -> List[Record]:
    """The records of one JSONL file or several, in file and line order; ``ValueError`` naming the file and line of a
    bad one and what is valid."""
    records = []
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    records.append(Record(where, to_messages(json.loads(line))))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg}); {_VALID}") from None
                except ValueError as e:
                    raise ValueError(f"{where}: {e}; {_VALID}") from None
    return records


# ---------------------------------------------------------------------------------------------- tokens
def _encode(text: str, tokenizer: Any) -> List[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _plain_pieces(messages: List[Dict[str, str]]) -> List[Tuple[str, bool]]:
    """``(text, is answer)`` pieces of the plain format."""
    pieces = []
    for m in messages:
        pieces.append((f"<|{m['role']}|>\n", False))
        pieces.append((f"{m['content']}\n", m["role"] == "assistant"))
    return pieces


def _template_pieces(messages: List[Dict[str, str]], tokenizer: Any) -> List[Tuple[str, bool]]:
    """``(text, is answer)`` pieces of the chat template's rendering: the text each prefix of the conversation adds
    to the one before it (an assistant message's: answer)."""
    def render(i: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 -- jinja's errors: reported with the record
            raise ValueError(f"the chat template failed on messages[:{i}]: {type(e).__name__}: {e}") from None

    ends = []  # (rendered prefix, whether its last piece is an answer)
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i > 0:
            ends.append((render(i, True), False))
        ends.append((render(i + 1, False), m["role"] == "assistant"))
    pieces, done = [], ""
    for text, is_answer in ends:
        if not text.startswith(done):
            at = next((k for k, (a, b) in enumerate(zip(done, text)) if a != b), min(len(done), len(text)))
            raise ValueError(
                f"the chat template is not prefix-consistent: the rendering of a longer prefix of the conversation"
                f" does not start with that of a shorter one (they differ at character {at}: {done[at:at + 40]!r}"
                f" vs {text[at:at + 40]!r}); masking the prompt needs a template where each message only appends"
                " text: use another template, or a tokenizer without chat_template (the plain format)")
        pieces.append((text[len(done):], is_answer))
        done = text
    return pieces


def tokenize_conversation(messages: List[Dict[str, str]], tokenizer: Any = None) -> Document:
    """A conversation as token ids and per-token answer flags (see the module docstring): with ``tokenizer``'s chat
    template if it has one, else the plain format (``tokenizer`` ``None``: bytes)."""
    template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    eos = None if template or tokenizer is None else tokenizer.eos_token_id
    ids: List[int] = []
    trained: List[bool] = []
    for text, is_answer in _template_pieces(messages, tokenizer) if template else _plain_pieces(messages):
        piece = _encode(text, tokenizer) + ([eos] if is_answer and eos is not None else [])
        ids += piece
        trained += [is_answer] * len(piece)
    return ids, trained


# ---------------------------------------------------------------------------------------------- rows
def pack_documents(docs: Sequence[Document], block_size: int, pad_id: int, pack: bool = True) -> Dict[str, Tensor]:
    """Documents (token ids, per-token trained flags) as the rows of the batch format, every tensor ``(R, T)`` int64.

    ``pack``: greedy in order, a document goes into the current row if it fits in what is left of it, else starts
    a new row; otherwise one document per row. The rest of a row is padding (``pad_id``, attention 0, position 0,
    label -100). ``labels[r, t]`` is the token at ``t + 1`` where that token is in the same document and trained,
    else -100. Raises ``ValueError`` for an empty document or one longer than ``block_size``.
    """
    rows: List[List[Document]] = []
    used = block_size  # no open row yet
    for i, (ids, trained) in enumerate(docs):
        if not 0 < len(ids) <= block_size or len(trained) != len(ids):
            raise ValueError(f"document {i} has {len(ids)} tokens and {len(trained)} flags: it needs 1 to"
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
class SFTDataModule(DataPosition, L.LightningDataModule):
    """Supervised fine-tuning on chat / instruction JSONL (see the module docstring), dict batches of ``(B, T)``
    int64 tensors: ``input_ids``, ``labels`` (shifted, -100 off the answers), ``attention_mask``, ``position_ids``.

    Args:
        path: a JSONL file, or a list of them (read in order).
        tokenizer: a local Hugging Face folder (e.g. the model's own) whose tokenizer is used (its chat template if
            it has one, else the plain format); ``None``, or a folder without a tokenizer: bytes (vocabulary 256).
        block_size: row length ``T``.
        batch_size: per-process batch size ``B``.
        pack: pack several documents into a row (greedy, in order); ``False``: one document per row, padded.
        val_fraction: the last ``val_fraction`` of the records (at least one, and at least one left for training,
            when there are two or more; none when 0) are the validation (and test) split.
        train_on_prompt: take the loss on the prompt's tokens too, not only the answers'.
        truncate: cut a document longer than ``block_size`` to its first ``block_size`` tokens; ``False``: such a
            document is a ``ValueError`` naming its record.
        shuffle: shuffle the training records before packing, and the rows every epoch (seeded by ``seed``).
        seed: seed of the shuffling.
        num_workers: DataLoader workers.

    Everything is built once in :meth:`setup`, identically on every rank. A document with no trained target left
    (e.g. a prompt truncated to ``block_size``) is dropped: it would take no loss. After setup, ``rows``,
    ``documents``, ``tokens``, ``loss_tokens`` and ``packing_efficiency`` describe the training split
    (`batch_statistics`). No ``DistributedSampler`` is created here: Lightning injects it when needed.
    """

    def __init__(
        self,
        path: Union[PathLike, Sequence[PathLike]],
        tokenizer: Optional[PathLike] = None,
        block_size: int = 256,
        batch_size: int = 8,
        pack: bool = True,
        val_fraction: float = 0.05,
        train_on_prompt: bool = False,
        truncate: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size <= 1 or batch_size <= 0:
            raise ValueError(f"block_size must be > 1 and batch_size > 0, got {block_size}, {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not paths:
            raise ValueError("path: no file given (a JSONL file or a list of them)")
        for p in paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"path: {str(p)!r} is not a file (a JSONL file of chat or instruction records)")
        if tokenizer is not None and not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer: {str(tokenizer)!r} is not a folder (a Hugging Face model folder,"
                                    " or null for bytes)")
        self.paths = paths
        self.block_size = block_size
        self.batch_size = batch_size
        self.pack = pack
        self.val_fraction = val_fraction
        self.train_on_prompt = train_on_prompt
        self.truncate = truncate
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = None
        if tokenizer is not None and has_tokenizer(tokenizer):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else ByteCorpusDataModule.vocab_size
        self.pad_token_id = next((i for i in (getattr(self.tokenizer, "pad_token_id", None),
                                              getattr(self.tokenizer, "eos_token_id", None)) if i is not None), 0)
        self.train_rows: Optional[Dict[str, Tensor]] = None
        self.val_rows: Optional[Dict[str, Tensor]] = None

    def prepare_data(self) -> None:
        """Nothing to download: the records are read from local files in :meth:`setup`."""

    def setup(self, stage: Optional[str] = None) -> None:
        """Read, split, tokenise and pack the records (once)."""
        if self.train_rows is not None:
            return
        records = read_records(self.paths)
        n = len(records)
        n_val = min(max(int(n * self.val_fraction), 1), n - 1) if n >= 2 and self.val_fraction > 0 else 0
        train, val = records[: n - n_val], records[n - n_val:]
        if self.shuffle:
            generator = torch.Generator(device="cpu").manual_seed(self.seed)
            order = torch.randperm(len(train), generator=generator, device=generator.device).tolist()
            train = [train[i] for i in order]
        self.train_rows = pack_documents(self.tokenize_records(train), self.block_size, self.pad_token_id, self.pack)
        self.val_rows = pack_documents(self.tokenize_records(val), self.block_size, self.pad_token_id, self.pack)
        if len(self.train_rows["input_ids"]) < self.batch_size:
            raise ValueError(f"the training split makes {len(self.train_rows['input_ids'])} rows, fewer than"
                             f" batch_size={self.batch_size}: no full batch ({n - n_val} records in {self.paths})")
        for key, value in batch_statistics(self.train_rows).items():
            setattr(self, key, value)

    def tokenize_records(self, records: Sequence[Record]) -> List[Document]:
        """The records' documents (token ids, trained flags), truncated or refused past ``block_size``; those left
        with no trained target dropped."""
        docs = []
        for record in records:
            try:
                ids, trained = tokenize_conversation(record.messages, self.tokenizer)
            except ValueError as e:
                raise ValueError(f"{record.where}: {e}") from None
            if len(ids) > self.block_size:
                if not self.truncate:
                    raise ValueError(f"{record.where}: the record has {len(ids)} tokens, more than"
                                     f" block_size={self.block_size}: raise block_size, or set truncate=true to cut it")
                ids, trained = ids[: self.block_size], trained[: self.block_size]
            if self.train_on_prompt:
                trained = [True] * len(ids)
            if any(trained[1:]):
                docs.append((ids, trained))
        return docs

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
