"""Context parallelism: every sequence of the batch split over the ``cp`` ranks, exact.

**The split.** Each CP rank holds ``T / cp`` tokens of every sequence: for causal attention the work of a token
grows with its position, so the sequence is cut into ``2 * cp`` chunks and rank ``r`` takes chunks ``r`` and
``2 * cp - 1 - r`` (the zigzag split of Megatron-LM and TorchTitan), which gives every rank the same attention
work. `split_batch` cuts a token batch (`lightning_hybrid.core.batch`) this way after it has been read whole: labels
(already shifted), the padding mask and the positions of each token in its document are those of the whole
sequence, so everything outside attention -- embeddings, norms, MLPs, the head, the per-token loss -- is the same
computation on fewer tokens. The positions always travel (``position_ids`` of the `TokenBatch` the module
receives): a rank's tokens are not contiguous.

**Attention** is the one place where tokens meet. Inside every layer the strategy wraps (`ContextParallel`), a
`torch.overrides.TorchFunctionMode` catches ``F.scaled_dot_product_attention`` (transformers' SDPA) and
`document_attention` (the reference GPT's), all-gathers the keys and values over the CP group (backward: the sum of
their gradients, back to the rank that holds them), puts them in the sequence's order, and attends each of the
rank's two chunks to the keys up to the chunk's last token under the mask of the whole sequence: causal by the
tokens' places in the sequence and within each document (documents restart where the positions do not continue by
+1, `lightning_hybrid.core.batch.document_ids`): one SDPA call per document the chunk meets (plain causal batches:
one call, causal aligned to the lower right), no mask of the block. The model's own mask (built for the rank's tokens
alone) is replaced, so it must be that mask: a float mask carrying anything but 0 / -inf (ALiBi), or an attention
that is neither causal nor masked, is refused when first seen.

**All-gather by default, or a ring.** Gathering K and V costs each rank ``(cp - 1) / cp`` of the sequence's keys and
values per layer (forward, and the same back in backward), the same volume a ring passes, in one collective that
NCCL runs at full bandwidth, and it leaves SDPA's kernels and any mask untouched. The gather and the attention are
checkpointed, so a layer keeps only its own keys and values for backward, which gathers them again; what grows with
``T`` per rank beyond its ``T / cp`` tokens is the layer being computed's: the whole sequence's keys and values (and
their gradients). ``cp_attention="ring"`` passes them around the group instead (`ring`: partial attentions merged
by their log-sum-exp, two ranks' keys and values at a time), not checkpointed: what it keeps (the rank's own
queries, keys, values, output and log-sum-exp) is what SDPA keeps at ``cp = 1`` over ``cp``, and its backward then
runs no second forward ring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from lightning_hybrid.core.autocast import autocast_inputs
from lightning_hybrid.core.batch import TokenBatch, document_ids
from lightning_hybrid.core.document_attention import (
    causal_sdpa_arguments,
    document_attention,
    document_block_attention,
    document_spans,
    label_spans,
)
from lightning_hybrid.core.hooks import StepHooks
from lightning_hybrid.parallel.context_parallel.layers import kv_group_of, restricted_attention_of
from lightning_hybrid.parallel.context_parallel.ring import ring_attention

__all__ = ["ContextParallel", "ContextParallelHooks", "apply_cp", "gather_prefixes", "split_batch", "zigzag_indices"]


def zigzag_indices(length: int, cp: int, rank: int, device: Optional[torch.device] = None) -> Tensor:
    """The places in a sequence of ``length`` tokens of the tokens CP rank ``rank`` of ``cp`` holds: chunks
    ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``. ``ValueError`` unless ``2 * cp`` divides ``length``."""
    if length % (2 * cp):
        raise ValueError(
            f"A sequence of {length} tokens does not split into 2 * cp = {2 * cp} equal chunks (context parallelism"
            f" gives each CP rank two of them): use a sequence length that is a multiple of {2 * cp}."
        )
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def split_batch(batch: Any, cp: int, rank: int) -> TokenBatch:
    """This CP rank's share of a token batch (an ``(x, y)`` pair or a dict of `lightning_hybrid.core.batch`), read whole
    first: ``input_ids`` and ``labels`` (shifted over the whole sequence) of its tokens, their ``position_ids`` in
    their documents -- always, even where they happen to count 0, 1, ... (the attention's mask is made from them)
    -- and the ``padding`` mask where the batch has padding. A `TokenBatch`, which the modules read as it is."""
    tokens = TokenBatch.from_batch(batch)
    ids = tokens.input_ids
    places = zigzag_indices(ids.size(1), cp, rank, ids.device)
    positions = tokens.position_ids
    if positions is None:
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    padding = tokens.padding[:, places] if tokens.padding is not None else None
    return TokenBatch(ids[:, places], tokens.labels[:, places], positions[:, places], padding)


class ContextParallel:
    """The attention of the layers of one module over the CP ``group`` (see the module doc).

    `wrap` makes a layer's ``forward`` run its attention over the whole sequence: the layer reads the positions
    of its tokens from its ``position_ids`` keyword (the batch's, split by `split_batch`; every layer of the
    reference GPT and of a transformers decoder takes them), and activation checkpointing, applied after, recomputes
    through the same wrapper. ``calls`` counts the attentions caught (a module whose layers make none does not
    reach its attention through SDPA: refused by the strategy after the first step). ``recompute_attention``:
    backward gathers the keys and values again and recomputes the attention rather than keeping them (off where
    activation checkpointing recomputes the layers: their recomputation, or a selective policy, decides; the ring
    never checkpoints its own: it keeps no whole-sequence keys and values).
    """

    def __init__(self, group: dist.ProcessGroup, recompute_attention: bool = True,
                 kv_group: Optional[int] = None, ring: bool = False) -> None:
        self.group, self.recompute_attention = group, recompute_attention
        self.ring = ring  # the keys and values passed around the group (`ring.ring_attention`), not all-gathered
        self.kv_group = kv_group  # the model's query heads per key/value head, where its config says (`kv_group_of`)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.calls = 0
        self.verified = False  # the strategy found attention caught after the first step
        self._positions: Optional[Tensor] = None
        self._batch_positions: Optional[Tensor] = None  # the batch's, for layers that receive none
        self._checked: set[tuple] = set()
        # id(positions) -> (positions, docs, whole positions, spans); (id, chunk) -> (positions, spans cut at chunks);
        # (id, "labels", chunk) -> (positions, each token's document and chunk as one label)
        self._documents: dict = {}
        self._layer: Optional[int] = None  # the index of the layer running (`wrap`'s order)
        self._layers = 0
        self._kv_groups: dict[tuple, int] = {}  # (layer, query heads) -> query heads per key/value head gathered
        self._windows: dict[int, tuple] = {}  # layer -> its (window, chunk) (`restricted_attention_of`)
        self.layers: list[nn.Module] = []  # the wrapped layers, in `wrap`'s order
        self.enabled = True  # False: the layers run as on one device (the probe's reference)

    def wrap(self, layer: nn.Module) -> None:
        forward = layer.forward
        index, self._layers = self._layers, self._layers + 1
        self._windows[index] = restricted_attention_of(layer)
        self.layers.append(layer)

        def context_parallel_forward(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:  # the whole sequence on one rank (`lightning_hybrid.checks.probe`'s reference)
                return forward(*args, **kwargs)
            with self.attending(kwargs.get("position_ids"), index):
                return forward(*args, **kwargs)

        layer.forward = context_parallel_forward
        layer.register_forward_pre_hook(self._prepare_documents, with_kwargs=True)

    @contextmanager
    def attending(self, positions: Optional[Tensor], layer: Optional[int] = None) -> Iterator[None]:
        """While a layer runs: its tokens' positions, and SDPA caught."""
        saved = self._positions, self._layer
        self._positions, self._layer = positions, layer
        try:
            with _AttentionMode(self):
                yield
        finally:
            self._positions, self._layer = saved

    # ------------------------------------------------------------------ attention
    def attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False) -> Tensor:
        """``F.scaled_dot_product_attention`` of this rank's queries against the keys and values of the whole
        sequence, under the mask of the whole sequence."""
        self._check_mask(attn_mask, is_causal, query)
        query, key, value = autocast_inputs(query, key, value)  # caught before autocast casts them
        positions = self._positions if self._positions is not None else self._batch_positions
        if positions is None or positions.size(0) != query.size(0):
            raise ValueError(
                "Under context parallelism the attention needs the positions of its tokens (a CP rank's tokens are not"
                " contiguous): the layers receive none (position_ids=...), and the batch's do not fit these queries"
                f" ({query.size(0)} rows; a pipeline's micro-batch): train this model with cp=1 or pp=1."
            )
        local = query.size(-2)
        if key.size(-2) != local or positions.size(-1) != local:
            raise RuntimeError(f"context parallelism: the attention's keys ({key.size(-2)}) and positions"
                               f" ({positions.size(-1)}) do not cover the rank's {local} queries")
        # Grouped-query attention: a model may hand SDPA its key/value heads once (enable_gqa) on one rank and
        # repeated per query head on another (transformers decides by the rank's own mask). Every rank gathers one
        # head per group -- the heads repeat after the gather -- with the group size all ranks found at the layer's
        # first attention (`_kv_group`): 1 (gathered per query head) where any rank cannot tell its groups.
        heads = query.size(-3)
        group = self._kv_group(key, value, heads)
        kv_heads = heads // group
        if key.size(-3) > kv_heads:  # repeated per query head by the model: one of each group's copies
            step = key.size(-3) // kv_heads
            key, value = key[..., ::step, :, :], value[..., ::step, :, :]
        elif key.size(-3) < kv_heads:
            key = key.repeat_interleave(kv_heads // key.size(-3), dim=-3)
            value = value.repeat_interleave(kv_heads // value.size(-3), dim=-3)
        docs = self.documents(positions, query.device)
        spans = self._documents[id(positions)][3]  # each row's documents' places (`document_spans`)
        # Checkpointed: backward gathers the keys and values again rather than keeping the whole sequence's (and
        # what SDPA saves of the rank's queries against them) for every layer until its backward. (Not inside a
        # checkpointed layer: its recomputation, or a selective policy replaying the ops in order, decides.)
        window, chunk = self._windows.get(self._layer, (None, None)) if self._layer is not None else (None, None)
        if self.ring:  # each query sees the keys of its own label (document, and attention chunk)
            if dropout_p > 0:
                raise ValueError(f"cp_attention='ring' computes attention without dropout (dropout_p={dropout_p});"
                                 " use cp_attention='all_gather', or no attention dropout.")
            labels = docs if chunk is None else self._chunk_labels(positions, docs, chunk, query.device)
            ring = (query, key, value, labels, self.group, scale, window)
            # Not checkpointed (unlike the all-gather, whose whole-sequence keys and values it would keep): the ring
            # keeps the rank's own queries, keys and values, its output and log-sum-exp -- what SDPA keeps at cp=1,
            # 1/cp of it -- so its backward runs no second forward ring.
            return ring_attention(*ring)
        if chunk is not None:  # attention chunks: a document is cut where a chunk starts (same document and chunk)
            spans = self._chunk_spans(positions, 0 if docs is None else docs, chunk, query.device)
        args = (query, key, value, spans, dropout_p, scale, window)
        return self._attend(*args) if not self.recompute_attention else checkpoint(self._attend, *args,
                                                                                   use_reentrant=False)

    def _kv_group(self, key: Tensor, value: Tensor, heads: int) -> int:
        """How many query heads share a key/value head in this layer, as every CP rank agrees, decided at the layer's
        first attention: the group a rank handed fewer key heads than query heads sees in the shapes, or else the
        model's config says (``kv_group``) -- the largest over the ranks (an all-reduce) -- confirmed by every rank:
        its key heads that many fewer, or handed them repeated per query head, its copies equal side by side, as
        transformers' ``repeat_kv`` and the reference GPT make them (an all-reduce of the verdicts). 1 (gathered per
        query head) where neither shapes nor config tell the groups, or a rank does not confirm them: nothing is
        inferred from equal copies alone (a constant key would look grouped). Outside the dispatch modes: a
        selectively recomputed layer must run the same ops in its recomputation."""
        index = (self._layer, heads)
        group = self._kv_groups.get(index)
        if group is not None:
            return group
        with _disable_current_modes(), torch.no_grad():
            hint = self.kv_group if self.kv_group and heads % self.kv_group == 0 else 0
            seen = heads // key.size(-3) if key.size(-3) < heads else hint
            agreed = torch.tensor([seen], dtype=torch.int64, device=key.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            group = int(agreed.item())
            if group > 1:
                confirmed = heads % group == 0 and (
                    key.size(-3) == heads // group
                    or key.size(-3) == heads and all(
                        torch.equal(t, t[..., ::group, :, :].repeat_interleave(group, dim=-3)) for t in (key, value)))
                verdict = torch.tensor([int(confirmed)], dtype=torch.int64, device=key.device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.group)
                group = group if verdict.item() else 1
        group = max(group, 1)
        self._kv_groups[index] = group
        return group

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, spans: Optional[list], dropout_p: float,
                scale: Optional[float], window: Optional[int] = None) -> Tensor:
        """Each of the rank's two chunks (chunks ``rank`` and ``2 cp - 1 - rank`` of the sequence) attends the
        keys of the sequence up to its own last token, in the sequence's order (`document_block_attention`): plain
        causal batches (``spans`` None) in one call, causal aligned to the lower right, which SDPA's kernels take
        without a mask tensor; batches with documents (attention chunks: documents cut at every chunk) one call per
        document a row's chunk meets, no mask of the block; a sliding ``window`` a mask per call."""
        chunk = query.size(-2) // 2
        indices = (self.rank, 2 * self.size - 1 - self.rank)
        ends = tuple((index + 1) * chunk for index in indices)
        repeats = query.size(-3) // key.size(-3)  # the key/value heads repeat per query head after the gather
        keys = gather_prefixes(key, self.group, ends, repeats)
        values = gather_prefixes(value, self.group, ends, repeats)
        outputs = []
        for part, index, k, v in zip(query.split(chunk, dim=-2), indices, keys, values):
            outputs.append(document_block_attention(part, k, v, spans, index * chunk, dropout_p, scale, window))
        return torch.cat(outputs, dim=-2)

    def whole_positions(self, positions: Tensor, device: torch.device) -> Tensor:
        """``(B, T)``: the positions of every token of the sequence, in its order (found with `documents`)."""
        self.documents(positions, device)
        return self._documents[id(positions)][2]

    def documents(self, positions: Tensor, device: torch.device) -> Optional[Tensor]:
        """``(B, T)``: the document of every token of the sequence (in its order), or ``None`` where the batch is
        plain causal attention (every row one document from position 0). Found once per (micro-)batch, before its
        first layer (`_prepare_documents`: an all-gather of the positions and a host sync, outside any checkpointed
        region -- a selective recomputation replays the layer's ops in their order, so a layer must run the same
        ops in its forward and its recomputation), and looked up by the layers, which make each SDPA call's mask
        from it."""
        entry = self._documents.get(id(positions))
        if entry is None or entry[0] is not positions:
            entry = (positions, *self._find_documents(positions, device))
            self._documents[id(positions)] = entry
        return entry[1]

    def new_batch(self, positions: Optional[Tensor] = None) -> None:
        """A batch starts (``positions``: its tokens' positions, for layers that receive none, as GPT-BigCode's
        blocks), or the last one's backward is done: its documents are dropped."""
        self._documents.clear()
        self._batch_positions = positions

    @contextmanager
    def batch(self, positions: Optional[Tensor]) -> Iterator[None]:
        """Within the block another batch runs (``positions``: its tokens', for layers that receive none); the
        batch of before, and its documents, afterwards (`lightning_hybrid.checks.probe`)."""
        saved = self._batch_positions, dict(self._documents)
        self.new_batch(positions)
        try:
            yield
        finally:
            self._batch_positions, self._documents = saved[0], saved[1]

    def _prepare_documents(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.enabled:
            return
        positions = kwargs.get("position_ids")
        positions = self._batch_positions if positions is None else positions
        if isinstance(positions, Tensor) and not positions.is_meta:
            self.documents(positions, positions.device)

    def _chunk_spans(self, positions: Tensor, docs: Any, chunk: int, device: torch.device) -> list:
        """Each row's runs in one document and attention chunk (position // ``chunk``): once per batch and chunk."""
        kept = self._documents.get((id(positions), chunk))
        if kept is None or kept[0] is not positions:
            with _disable_current_modes():  # (a selective recomputation replays ops in order: it finds these kept)
                kept = (positions, label_spans(self._chunk_labels(positions, docs, chunk, device)))  # a host sync
            self._documents[(id(positions), chunk)] = kept
        return kept[1]

    def _chunk_labels(self, positions: Tensor, docs: Optional[Tensor], chunk: int, device: torch.device) -> Tensor:
        """``(B, T)``: each token's document and attention chunk (position // ``chunk``) as one label; once per batch
        and chunk, outside the dispatch modes (a host sync)."""
        kept = self._documents.get((id(positions), "labels", chunk))
        if kept is None or kept[0] is not positions:
            with _disable_current_modes():
                chunks = self.whole_positions(positions, device) // chunk
                kept = (positions, (0 if docs is None else docs) * (int(chunks.max()) + 1) + chunks)
            self._documents[(id(positions), "labels", chunk)] = kept
        return kept[1]

    def _find_documents(self, positions: Tensor, device: torch.device) -> tuple:
        """The documents (``None``: plain causal attention), the positions of the whole sequence and each row's
        documents' places (`document_spans`; a host sync, once per batch)."""
        with torch.no_grad():
            pieces = [torch.empty_like(positions) for _ in range(self.size)]
            dist.all_gather(pieces, positions.contiguous(), group=self.group)
            whole = _in_sequence_order(pieces, dim=-1)  # (B, T): the positions in the sequence's order
            if bool((whole == torch.arange(whole.size(-1), device=device)).all()):
                return None, whole, None  # plain causal attention
            return document_ids(whole), whole, document_spans(whole)

    def _check_mask(self, attn_mask: Optional[Tensor], is_causal: bool, query: Tensor) -> None:
        """Refuse, when first seen, an attention whose own mask is not the causal document mask this replaces."""
        if attn_mask is None:
            if not is_causal and query.size(-2) > 1:
                raise ValueError("context parallelism: an attention that is neither causal nor masked"
                                 " (bidirectional) is not supported: the mask of a causal LM is replaced.")
            return
        key = (attn_mask.dtype, tuple(attn_mask.shape))
        if key in self._checked:
            return
        if attn_mask.is_floating_point():
            # Outside the dispatch modes: a selectively recomputed layer must run the same ops in its recomputation,
            # which does not check again.
            with _disable_current_modes():
                mask = attn_mask.detach()
                allowed = bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min)).all())
            if not allowed:
                raise ValueError(
                    "context parallelism: the attention's mask adds biases (e.g. ALiBi), which cannot be rebuilt for"
                    " the whole sequence: train this model with cp=1."
                )
        self._checked.add(key)


class _AttentionMode(TorchFunctionMode):
    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[Mapping] = None):
        kwargs = kwargs or {}
        if func is document_attention:  # causal within each document: the CP attention's are the whole sequence's
            func, (args, kwargs) = F.scaled_dot_product_attention, causal_sdpa_arguments(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self.cp.calls += 1
            return self.cp.attention(*args, **kwargs)
        return func(*args, **kwargs)


def gather_prefixes(t: Tensor, group: dist.ProcessGroup, ends: tuple[int, ...], repeats: int = 1) -> tuple[Tensor, ...]:
    """``t`` ``(..., heads, T / cp, D)``, a rank's two zigzag chunks (`zigzag_indices`), of every rank of ``group``
    put together in the sequence's order, each head repeated ``repeats`` times side by side (grouped-query
    attention's key/value heads, gathered once, for every query head), and of that ``(..., heads * repeats, T, D)``
    the first ``end`` tokens for each of ``ends``. Backward: each rank gets the sum over the ranks (and a head's
    copies) of the gradients of its tokens (one buffer of the gathered size, whatever the number of prefixes; no
    zero-padded gradient per prefix)."""
    return _GatherPrefixes.apply(t, group, ends, repeats)


def _sequence_chunks(cp: int) -> list[tuple[int, int]]:
    """For each chunk of the sequence in its order (``2 cp`` of them): the rank holding it and which of the rank's
    two chunks it is."""
    return [(i, 0) if i < cp else (2 * cp - 1 - i, 1) for i in range(2 * cp)]


def _in_sequence_order(pieces: list[Tensor], dim: int) -> Tensor:
    """Every rank's two zigzag chunks (``pieces``, the ranks' tokens in rank order along ``dim``) put together in
    the sequence's order."""
    chunk = pieces[0].size(dim) // 2
    return torch.cat([pieces[rank].narrow(dim, slot * chunk, chunk) for rank, slot in _sequence_chunks(len(pieces))],
                     dim=dim)


class _GatherPrefixes(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, group: dist.ProcessGroup, ends: tuple[int, ...],
                repeats: int) -> tuple[Tensor, ...]:
        size = dist.get_world_size(group)
        ctx.group, ctx.ends, ctx.shape, ctx.repeats = group, ends, t.shape, repeats
        pieces = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(pieces, t.contiguous(), group=group)
        whole = _in_sequence_order(pieces, dim=-2)
        del pieces
        if repeats > 1:
            whole = whole.repeat_interleave(repeats, dim=-3)
        return tuple(whole.narrow(-2, 0, end) for end in ends)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], None, None, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        reference = next(g for g in grads if g is not None)
        chunk = ctx.shape[-2] // 2
        # (cp, ..., T / cp, D): each rank's tokens in its own order, so that rank r's part is buf[r]
        buf = reference.new_zeros((size, *ctx.shape))
        for grad, end in zip(grads, ctx.ends):
            if grad is None:
                continue
            if ctx.repeats > 1:  # a head's copies: their gradients summed
                grad = grad.unflatten(-3, (-1, ctx.repeats)).sum(-3)
            for i, (holder, slot) in enumerate(_sequence_chunks(size)[:end // chunk]):
                buf[holder].narrow(-2, slot * chunk, chunk).add_(grad.narrow(-2, i * chunk, chunk))
        if dist.get_backend(group) == "nccl":
            out = reference.new_empty(ctx.shape)
            dist.reduce_scatter_tensor(out, buf, group=group)
            return out, None, None, None
        dist.all_reduce(buf, group=group)  # gloo: no reduce-scatter of its own that keeps memory bounded
        return buf[rank].clone(), None, None, None


def apply_cp(module: nn.Module, layers: list[str], group: dist.ProcessGroup, recompute_attention: bool,
             device: torch.device, ring: bool = False) -> "ContextParallelHooks":
    """Context parallelism on ``module``: each of its ``layers`` (module names) attends over the CP ``group``
    (`ContextParallel.wrap`; ``ring``: `ring_attention`); returns the hooks of its steps, which hold the
    `ContextParallel`."""
    context = ContextParallel(group, recompute_attention, kv_group_of(module), ring)
    for name in layers:
        context.wrap(module.get_submodule(name))
    return ContextParallelHooks(context, type(module).__name__, device)


class ContextParallelHooks(StepHooks):
    """What context parallelism does during a step: each batch becomes this rank's share of its sequences
    (`split_batch`, a `TokenBatch` with the tokens' positions); after the first training step, a module none of
    whose attentions went through SDPA is refused on every rank; after backward, the batch's documents are let go."""

    def __init__(self, context: ContextParallel, module_name: str, device: torch.device) -> None:
        self.context, self.module_name, self.device = context, module_name, device

    def on_batch(self, batch: Any, stage: str) -> TokenBatch:
        context = self.context
        if stage == "predict":
            raise ValueError(f"predict under cp={context.size} is not supported: each rank would return its share of"
                             " the sequences' logits, in the split's order; predict with cp=1.")
        try:
            share = split_batch(TokenBatch.from_batch(batch), context.size, context.rank)
        except (ValueError, TypeError) as e:
            raise type(e)(f"cp={context.size}: {e}") from e
        context.new_batch(share.position_ids)
        return share

    def after_training_step(self) -> None:
        context = self.context
        if context.verified:
            return
        calls = torch.tensor([context.calls], device=self.device)
        dist.all_reduce(calls)
        if not int(calls):
            raise ValueError(
                f"cp={context.size}: no attention of {self.module_name} went through"
                " torch.nn.functional.scaled_dot_product_attention, which context parallelism splits over the"
                " sequence: use an SDPA attention (transformers: attn_implementation='sdpa'), or cp=1."
            )
        context.verified = True

    def after_backward(self) -> None:
        self.context.new_batch()  # the batch's documents: no longer needed
