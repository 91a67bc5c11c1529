"""Causal attention within each document of a packed or padded batch, without a ``(T x T)`` mask.

A packed row holds several documents one after the other (and a padded row its padding as one more), each
restarting its positions (`lightning_hybrid.core.batch.document_ids`). One device's reference attends under the
block-diagonal causal mask (`lightning_hybrid.core.batch.document_causal_mask`): ``T x T`` booleans per row, which
SDPA copies to a float mask per call, and which keeps it off its fused causal kernels. `document_attention` computes
the same thing as one causal SDPA call per document (``is_causal=True``, no mask): each document attends to itself
alone -- what one device computes for the document alone, exactly -- with one host sync per call to find the
documents. Sliding windows (``window``: a query sees the keys less than that many places before it) take a
``(n x n)`` mask per document longer than the window.

It is a ``torch`` function that modes see (`torch.overrides.handle_torch_function`): context parallelism
(`lightning_hybrid.parallel.context_parallel`) takes it over as it takes SDPA over, with the documents of the whole
sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from lightning_hybrid.core.batch import document_ids

__all__ = ["causal_sdpa_arguments", "document_attention", "document_spans"]


def document_spans(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids`` ``(B, T)``, the ``(start, end)`` places of its documents (a host sync)."""
    docs = document_ids(position_ids)
    change = torch.ones_like(docs, dtype=torch.bool)
    change[:, 1:] = docs[:, 1:] != docs[:, :-1]
    rows, starts = change.nonzero(as_tuple=True)
    length = position_ids.size(-1)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(position_ids.size(0))]
    for row, start in zip(rows.tolist(), starts.tolist()):
        if spans[row]:
            spans[row][-1] = (spans[row][-1][0], start)
        spans[row].append((start, length))
    return spans


def causal_sdpa_arguments(query: Tensor, key: Tensor, value: Tensor, position_ids: Optional[Tensor] = None,
                          dropout_p: float = 0.0, scale: Optional[float] = None,
                          window: Optional[int] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the causal ``F.scaled_dot_product_attention`` call (no mask) that stands for a
    `document_attention` call where the attention takes the documents from elsewhere: context parallelism, from the
    whole sequence's positions. ``ValueError`` for a ``window``, which that call would not carry."""
    if window is not None:
        raise ValueError(f"document_attention(window={window}) cannot be taken over as a causal SDPA call (context"
                         " parallelism keeps the sliding window a transformers config declares, not this one).")
    return (query, key, value), {"dropout_p": dropout_p, "is_causal": True, "scale": scale,
                                 "enable_gqa": key.size(-3) != query.size(-3)}


def document_attention(query: Tensor, key: Tensor, value: Tensor, position_ids: Optional[Tensor] = None,
                       dropout_p: float = 0.0, scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=<causal within each document>)`` for queries,
    keys and values ``(B, heads, T, D)`` (grouped-query attention: fewer key/value heads that divide the query heads)
    and ``position_ids`` ``(B, T)`` (``None``: one document per row), computed per document (module docstring)."""
    if has_torch_function((query, key, value)):
        return handle_torch_function(document_attention, (query, key, value), query, key, value,
                                     position_ids=position_ids, dropout_p=dropout_p, scale=scale, window=window)
    gqa = key.size(-3) != query.size(-3)
    n = query.size(-2)
    spans = [[(0, n)]] * query.size(0) if position_ids is None else document_spans(position_ids)
    if all(row == [(0, n)] for row in spans) and (window is None or n <= window):
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    rows = []
    for b, row in enumerate(spans):
        pieces = []
        for start, end in row:
            q, k, v = (t[b : b + 1, :, start:end] for t in (query, key, value))
            length = end - start
            if window is not None and length > window:
                places = torch.arange(length, device=query.device)
                distance = places.unsqueeze(1) - places.unsqueeze(0)
                mask = (distance >= 0) & (distance < window)
                pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                             scale=scale, enable_gqa=gqa))
            else:
                pieces.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                             scale=scale, enable_gqa=gqa))
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
