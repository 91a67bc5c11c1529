"""The batches of next-token training: ``(x, y)`` token tensors, or dicts for fine-tuning data (padding, packed
documents, loss masks), read into one form, `TokenBatch`.

A dict batch holds ``(B, T)`` tensors:

* ``input_ids`` (required): token ids;
* ``labels``: the target of each position, **already shifted** (``labels[:, t]`` is the token that follows
  position ``t`` in its document, as ``y`` of an ``(x, y)`` batch), ``-100`` where no loss is taken (prompt, the
  last token of a document, padding); default: ``input_ids`` shifted by one, the last position ignored;
* ``attention_mask``: 1 for real tokens, 0 for padding (anywhere in the row);
* ``position_ids``: each token's position in its document; a document starts wherever they do not continue by
  +1 (the rule of ``transformers``' packed sequences), so packed documents restart at 0.

`TokenBatch.from_batch` reduces the padding mask and the positions to **one** side input, ``position_ids``, that
the models use for both: positions restart at each document, and a padding token becomes a document of its own
at position 0 (so no real token sees it, and every query has a key: no fully masked row). Labels at padding are
ignored. Rows that are each one document from position 0 with padding only after it need no side input at all:
causal attention already keeps the padding out of sight (``position_ids`` is then ``None``). Attention is causal
within each document (`document_ids`, `document_causal_mask`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["BATCH_KEYS", "IGNORE_INDEX", "TokenBatch", "document_causal_mask", "document_ids", "is_packed"]

#: The label of a position that takes no loss (cross entropy's default ``ignore_index``).
IGNORE_INDEX = -100
#: The keys a dict batch may hold.
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


@dataclass(frozen=True)
class TokenBatch:
    """One batch in the models' form: ``input_ids`` and ``labels`` ``(B, T)``, ``position_ids`` ``(B, T)`` where
    the batch is padded or packed (``None``: every row one document at positions ``0..T-1``), and ``padding``, the
    ``(B, T)`` boolean mask of the real tokens where the batch's ``attention_mask`` marks padding (``None``: every
    token is real; the models do not need it, the positions keep padding apart, but a loss over every token does:
    a mixture-of-experts router's load-balancing loss)."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Optional[Tensor] = None
    padding: Optional[Tensor] = None

    @classmethod
    def from_batch(cls, batch: Any) -> "TokenBatch":
        """An ``(x, y)`` pair (or list) of ``(B, T)`` tensors, or a dict with the keys of `BATCH_KEYS`; raises
        ``ValueError`` / ``TypeError`` naming what is wrong and what is valid."""
        if isinstance(batch, TokenBatch):
            return batch
        if isinstance(batch, Mapping):
            return cls._from_dict(batch)
        if isinstance(batch, Sequence) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            x, y = batch
            _check_tokens("x", x)
            _check_same_shape(x, {"y": y})
            return cls(x, y)
        raise TypeError(
            f"a batch is an (x, y) pair of token tensors (B, T) or a dict with keys {list(BATCH_KEYS)}"
            f" ('input_ids' required), got {type(batch).__name__}."
        )

    @classmethod
    def _from_dict(cls, batch: Mapping[str, Any]) -> "TokenBatch":
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown or "input_ids" not in batch:
            what = f"unknown keys {unknown}" if unknown else "no 'input_ids'"
            raise ValueError(f"a dict batch has {what}: valid keys are {list(BATCH_KEYS)} ('input_ids' required).")
        ids = batch["input_ids"]
        _check_tokens("input_ids", ids)
        others = {k: batch[k] for k in BATCH_KEYS[1:] if batch.get(k) is not None}
        _check_same_shape(ids, others)
        positions = others.get("position_ids")
        if positions is not None:
            positions = positions.long()
            if bool((positions < 0).any()):
                raise ValueError("position_ids must be >= 0 (a document's positions count from 0).")
        mask = others.get("attention_mask")
        real = None if mask is None or bool(mask.bool().all()) else mask.bool()
        if real is not None:
            if positions is None:  # left or right padding: each row's real tokens count from 0
                positions = real.long().cumsum(1) - 1
            positions = positions.masked_fill(~real, 0)  # a padding token: a document of its own
        labels = others.get("labels")
        if labels is None:  # the next token of the same document
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:, :-1] = ids[:, 1:]
            if positions is not None:
                labels[:, :-1].masked_fill_(document_ids(positions).diff(dim=-1) != 0, IGNORE_INDEX)
        labels = labels.long()
        if real is not None:
            labels = labels.masked_fill(~real, IGNORE_INDEX)
        if positions is not None and _plain_rows(positions, real):
            positions = None  # one document per row from position 0, padding after it: plain causal attention
        return cls(ids, labels, positions, real)

    def __getitem__(self, index: Any) -> Any:
        # Context parallelism hands modules their share of a batch as a TokenBatch: unpacking it as an (x, y) pair
        # (which Python does through __getitem__ here) would lose the positions of the rank's tokens, which are not
        # 0..T-1. No __iter__: Lightning then reads the batch's size from the dataclass's fields (`self.log`), where
        # an iterable batch would be iterated.
        raise TypeError(
            "this batch is a lightning_hybrid.core.batch.TokenBatch (context parallelism's share of a batch: its tokens"
            " are not contiguous), not an (x, y) pair: read it with TokenBatch.from_batch(batch) and give the model"
            " its position_ids (tokens.model_inputs()), as lightning_hybrid's LanguageModel does."
        )

    def model_inputs(self) -> dict[str, Tensor]:
        """The keyword inputs of the model besides the token ids: ``{"position_ids": ...}`` for a padded or packed
        batch, nothing otherwise."""
        return {} if self.position_ids is None else {"position_ids": self.position_ids}

    def loss_items(self) -> Tensor:
        """The number of positions that take a loss (labels other than `IGNORE_INDEX`)."""
        return count_loss_items(self.labels)


def count_loss_items(labels: Tensor) -> Tensor:
    """The number of labels other than `IGNORE_INDEX` (int64 scalar on ``labels``' device)."""
    return (labels != IGNORE_INDEX).sum()


def document_ids(position_ids: Tensor) -> Tensor:
    """``(B, T)``: the index of each token's document in its row; a document starts wherever the positions do not
    continue by +1 (``transformers``' rule for packed sequences)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def is_packed(position_ids: Optional[Tensor]) -> bool:
    """Whether some row holds more than one document or starts elsewhere than position 0 (a host sync)."""
    if position_ids is None:
        return False
    expected = torch.arange(position_ids.size(-1), device=position_ids.device)
    return not bool((position_ids == expected).all())


def document_causal_mask(position_ids: Optional[Tensor]) -> Optional[Tensor]:
    """The boolean attention mask ``(B, 1, T, T)`` (True: may attend) of causal attention within each document;
    ``None`` where that is plain causal attention (no positions, or every row one document at ``0..T-1``)."""
    if not is_packed(position_ids):
        return None
    assert position_ids is not None
    docs = document_ids(position_ids)
    n = position_ids.size(-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    # No in-place op: selective recompute hands back the tensors it cached, which must stay as they were.
    return ((docs.unsqueeze(-1) == docs.unsqueeze(-2)) & causal).unsqueeze(1)


def _plain_rows(positions: Tensor, real: Optional[Tensor]) -> bool:
    """Whether every row is one document at positions ``0..n-1`` followed only by padding: causal attention then
    keeps the padding out of every real token's view, as positions ``0..T-1`` do."""
    arange = torch.arange(positions.size(-1), device=positions.device)
    if real is None:
        return bool((positions == arange).all())
    return bool(((positions == arange) | ~real).all()) and bool((real.long().diff(dim=-1) <= 0).all())


def _check_tokens(name: str, t: Any) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2 or t.is_floating_point():
        got = f"a {t.dim()}-d {t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor (B, T), got {got}.")


def _check_same_shape(ids: Tensor, others: Mapping[str, Any]) -> None:
    for name, t in others.items():
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(ids.shape):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of the token ids' shape {tuple(ids.shape)}, got {got}.")
