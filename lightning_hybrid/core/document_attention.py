"""Causal attention within each document of a packed or padded batch, without a ``(T x T)`` mask.

A packed row holds several documents one after the other (and a padded row its padding as one more), each
restarting its positions (`lightning_hybrid.core.batch.document_ids`). One device's reference attends under the
block-diagonal causal mask (`lightning_hybrid.core.batch.document_causal_mask`): ``T x T`` booleans per row, which
SDPA copies to a float mask per call, and which keeps it off its fused causal kernels. `document_attention` computes
the same thing as one causal SDPA call per document (``is_causal=True``, no mask): each document attends to itself
alone -- what one device computes for the document alone, exactly -- with one host sync per call to find the
documents. Under ``torch.compile`` it attends under the mask instead (traceable: one call per document would compile
again for every batch's documents). Sliding windows (``window``: a query sees the keys less than that many places
before it) take a ``(n x n)`` mask per document longer than the window.

It is a ``torch`` function that modes see (`torch.overrides.handle_torch_function`): context parallelism
(`lightning_hybrid.parallel.context_parallel`) takes it over as it takes SDPA over, with the documents of the whole
sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils._python_dispatch import _disable_current_modes

from lightning_hybrid.core.batch import document_ids

__all__ = ["block_mask", "causal_band", "causal_sdpa_arguments", "document_attention", "document_block_attention",
           "document_spans", "label_spans"]


def document_spans(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids`` ``(B, T)``, the ``(start, end)`` places of its documents: a host sync, once per
    tensor (kept on it, with the version it was read at: every layer of a forward gets the same positions). Its ops
    run outside the dispatch modes: a selective recomputation replays a layer's ops in order, and the recomputation
    finds the spans kept."""
    kept = getattr(position_ids, "_document_spans", None)
    if kept is not None and kept[0] == position_ids._version:
        return kept[1]
    with _disable_current_modes():
        spans = label_spans(document_ids(position_ids))
    position_ids._document_spans = (position_ids._version, spans)
    return spans


def label_spans(labels: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``labels`` ``(B, T)``, the ``(start, end)`` places of its runs of equal labels (a host sync; outside
    the dispatch modes, as `document_spans`)."""
    with _disable_current_modes():
        change = torch.ones_like(labels, dtype=torch.bool)
        change[:, 1:] = labels[:, 1:] != labels[:, :-1]
        rows, starts = change.nonzero(as_tuple=True)
    length = labels.size(-1)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(labels.size(0))]
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
    if torch.compiler.is_compiling():  # a traceable mask: a call per document would recompile for every batch
        # Made whenever there are positions, without asking whether they are packed (a host sync: a graph break).
        windowed = window is not None and n > window
        mask = None  # plain causal
        if position_ids is not None or windowed:
            docs = (torch.zeros(query.size(0), n, dtype=torch.long, device=query.device) if position_ids is None
                    else document_ids(position_ids))
            mask = block_mask(docs, 0, n, window if windowed else None)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=mask is None, scale=scale, enable_gqa=gqa)
    spans = [[(0, n)]] * query.size(0) if position_ids is None else document_spans(position_ids)
    if all(row == [(0, n)] for row in spans):  # one document a row: one call for all rows
        return _lower_right(query, key, value, 0, dropout_p, scale, window)
    # split, not sliced: the backward of a split is one concatenation, of a slice a zero tensor of the whole input
    rows = []
    for row, q_row, k_row, v_row in zip(spans, query.split(1), key.split(1), value.split(1)):
        lengths = [end - start for start, end in row]
        pieces = [_lower_right(q, k, v, 0, dropout_p, scale, window)
                  for q, k, v in zip(*(t.split(lengths, dim=-2) for t in (q_row, k_row, v_row)))]
        rows.append(_joined(pieces))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def document_block_attention(query: Tensor, key: Tensor, value: Tensor, spans: Optional[list[list[tuple[int, int]]]],
                             start: int, dropout_p: float = 0.0, scale: Optional[float] = None,
                             window: Optional[int] = None) -> Tensor:
    """The queries at places ``start .. start + n - 1`` of a sequence (``query`` ``(B, heads, n, D)``) against its keys
    and values at places ``0 .. start + n - 1`` (``(B, heads, start + n, D)``), causal within each document (``spans``:
    per row the ``(start, end)`` places of its documents in the whole sequence, `document_spans`; ``window`` as in
    `document_attention`): what SDPA computes under `block_mask`, as one SDPA call per document a row's queries meet --
    those queries against the document's keys up to the last of them, causal aligned to the lower right -- with no
    ``n x (start + n)`` mask (context parallelism's chunks, `lightning_hybrid.parallel.context_parallel`). ``spans``
    None: every row one document from place 0, one call for all rows."""
    if spans is None:
        return _lower_right(query, key, value, start, dropout_p, scale, window)
    end = start + query.size(-2)
    rows = []
    for row, q_row, k_row, v_row in zip(spans, query.split(1), key.split(1), value.split(1)):
        keys = [(first, min(last, end)) for first, last in row if first < end]  # each document's keys up to end
        k_pieces, v_pieces = (t.split([hi - lo for lo, hi in keys], dim=-2) for t in (k_row, v_row))
        mine = [i for i, (_, hi) in enumerate(keys) if hi > start]  # the documents the chunk's queries are in
        q_pieces = q_row.split([keys[i][1] - max(keys[i][0], start) for i in mine], dim=-2)
        pieces = [_lower_right(q, k_pieces[i], v_pieces[i], max(keys[i][0], start) - keys[i][0], dropout_p, scale,
                               window) for q, i in zip(q_pieces, mine)]
        rows.append(_joined(pieces))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def _joined(pieces: list[Tensor]) -> Tensor:
    """The documents' outputs ``(1, heads, n_i, D)`` as one ``(1, heads, n, D)`` laid out tokens first, as SDPA lays
    out its output: the ``(B, T, heads * D)`` view of it the output projection takes is then no copy."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([p.transpose(1, 2) for p in pieces], dim=1).transpose(1, 2)


def _lower_right(q: Tensor, k: Tensor, v: Tensor, offset: int, dropout_p: float, scale: Optional[float],
                 window: Optional[int]) -> Tensor:
    """SDPA of queries at places ``offset ..`` of a document against its keys ``0 ..`` up to the last query: causal
    (within ``window``)."""
    n, m = q.size(-2), k.size(-2)
    gqa = k.size(-3) != q.size(-3)
    if window is None or m <= window:
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        with _disable_current_modes():  # a tensor subclass, which a dispatch mode (a memory tracker) refuses
            mask = causal_lower_right(n, m)
    else:
        mask = causal_band(offset, m, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


def causal_band(start: int, end: int, window: Optional[int], device: torch.device,
                keys: Optional[tuple[int, int]] = None) -> Tensor:
    """``(end - start, key_end - key_start)``: whether the query at place ``start + i`` may see the key at place
    ``key_start + j`` -- not later than it and, with ``window``, less than ``window`` places before it
    (transformers' ``sliding_window_overlay``); the keys ``keys`` (``(key_start, key_end)``), by default
    ``0 .. end - 1``."""
    key_start, key_end = keys if keys is not None else (0, end)
    distance = (torch.arange(start, end, device=device).unsqueeze(1)
                - torch.arange(key_start, key_end, device=device).unsqueeze(0))  # query place - key place
    return distance >= 0 if window is None else (distance >= 0) & (distance < window)


def block_mask(docs: Tensor, start: int, end: int, window: Optional[int] = None) -> Tensor:
    """``(B, 1, end - start, end)``: the causal document mask of the queries at places ``start .. end - 1`` of the
    sequence against its keys ``0 .. end - 1`` (True: may attend), from ``docs`` ``(B, T)``, the document of every
    token (`lightning_hybrid.core.batch.document_ids`) -- rows ``start:end`` and columns ``:end`` of one device's
    `lightning_hybrid.core.batch.document_causal_mask`; with ``window``, a query sees only the keys less than ``window``
    places before it (`causal_band`). What `document_block_attention` attends under without making it; the
    traceable mask of `document_attention` under ``torch.compile`` with a window."""
    mask = (docs[:, start:end].unsqueeze(-1) == docs[:, :end].unsqueeze(-2)) & causal_band(start, end, window,
                                                                                             docs.device)
    return mask.unsqueeze(1)
