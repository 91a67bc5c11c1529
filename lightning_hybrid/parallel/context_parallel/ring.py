"""Ring attention: context parallelism's attention with the keys and values passed around the CP group
(``cp_attention="ring"``) instead of all-gathered, so that no rank ever holds more than two ranks' keys and values.

Each CP rank holds two zigzag chunks of every sequence (`lightning_hybrid.parallel.context_parallel`). In ``cp``
steps each rank's keys and values visit every rank (sent to the next rank while the current ones are attended to:
the transfer overlaps the block's compute); at every step the rank's two query chunks attend to the visiting
rank's two key chunks where the sequence's mask lets them -- causal by place, within a document (or a document and
attention chunk), within a sliding window -- and the partial results are merged by their log-sum-exp, as
FlashAttention merges key blocks. A chunk pair that the causal order masks whole is skipped. Backward runs the same
ring again: each block's gradients are recomputed from the saved output and log-sum-exp (FlashAttention's
backward), the query gradient stays, and the key and value gradients travel one step behind their keys and values,
home after the last step -- every transfer but that last one under a step's compute, in both passes. What a rank
keeps for backward is its own queries, keys, values, output and log-sum-exp (only its
queries, keys and values where `ContextParallel` checkpoints it, as it does the all-gather); what it
holds beyond that at any time is two ranks' keys and values (in backward also their gradients, and this step's
part of them) and the scores of
`ROWS` query rows against one chunk -- where the all-gather holds the whole sequence's keys and values of the layer
it computes.

Computed in fp32 with explicit scores (``ROWS x T / 2 cp`` per head at a time, transient), so it is the same
attention as one device's up to the order of fp32 sums (its kernels are not SDPA's fused ones: the all-gather,
which keeps SDPA, is the faster choice where the whole sequence's keys and values fit). Attention dropout is refused.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid.core.document_attention import causal_band

__all__ = ["ring_attention"]


def ring_attention(query: Tensor, key: Tensor, value: Tensor, labels: Optional[Tensor], group: dist.ProcessGroup,
                   scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """``(B, H, 2c, D)`` attention of this CP rank's queries (its zigzag chunks ``rank`` and ``2 cp - 1 - rank`` of
    ``c`` tokens) over the whole sequence's keys and values, each rank's ``key`` / ``value`` ``(B, Hkv, 2c, D)``
    (``Hkv`` dividing ``H``: grouped-query heads repeated per block) passed around ``group``. ``labels`` ``(B, T)``:
    a query sees only keys of its own label (documents, attention chunks), ``None`` for plain causal rows;
    ``window``: only keys less than that many places before it."""
    return _RingAttention.apply(query, key, value, labels, group, scale, window)


def _chunk_indices(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def _allowed(labels: Optional[Tensor], window: Optional[int], a: int, b: int, c: int,
             device: torch.device) -> Optional[Tensor]:
    """Which keys of chunk ``b`` the queries of chunk ``a`` (``c`` tokens each) see: ``(B or 1, 1, c, c)`` bools, or
    ``None`` for all of them (`causal_band`, and the same label)."""
    mask = None
    if a == b or window is not None:
        mask = causal_band(a * c, (a + 1) * c, window, device, keys=(b * c, (b + 1) * c))[None, None]
    if labels is not None:
        same = (labels[:, a * c:(a + 1) * c, None] == labels[:, None, b * c:(b + 1) * c])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _masked_whole(a: int, b: int, c: int, window: Optional[int]) -> bool:
    """Whether chunk ``a``'s queries see none of chunk ``b``'s keys: every key after every query, or every key at
    least ``window`` places before every query."""
    return b > a or (window is not None and (a - b - 1) * c + 1 >= window)


#: Query rows whose scores against a chunk are computed at once: the transient scores are ``ROWS x c`` per head.
ROWS = 128


def _row_blocks(c: int) -> list[slice]:
    return [slice(start, min(start + ROWS, c)) for start in range(0, c, ROWS)]


def _rows(allowed: Optional[Tensor], rows: slice) -> Optional[Tensor]:
    return None if allowed is None else allowed[..., rows, :]


def _scores(q: Tensor, k: Tensor, allowed: Optional[Tensor], scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _repeat(t: Tensor, repeats: int) -> Tensor:
    return t if repeats == 1 else t.repeat_interleave(repeats, dim=-3)


def _fold(t: Tensor, repeats: int) -> Tensor:
    """The gradient of `_repeat`: a key/value head's copies summed."""
    return t if repeats == 1 else t.unflatten(-3, (-1, repeats)).sum(-3)


def _pairs(ring: "_Ring", step: int, visiting: Tensor, c: int, repeats: int, labels: Optional[Tensor],
           window: Optional[int]):
    """At ``step`` of the ring, each (query chunk, key chunk) pair of this rank's queries and the ``visiting`` keys
    and values (``visiting[0]``, ``visiting[1]``: the rank ``step`` places before's) that the mask does not cut
    whole: ``(query slot, key slot, keys, values, allowed)``, the key/value heads repeated per query head."""
    source = (ring.rank - step) % ring.size
    for qa, a in enumerate(_chunk_indices(ring.rank, ring.size)):
        for kb, b in enumerate(_chunk_indices(source, ring.size)):
            if not _masked_whole(a, b, c, window):
                yield (qa, kb, _repeat(visiting[0].narrow(-2, kb * c, c), repeats),
                       _repeat(visiting[1].narrow(-2, kb * c, c), repeats),
                       _allowed(labels, window, a, b, c, visiting.device))


class _Ring:
    """One ring pass over ``group``: send a tensor to the next rank and receive the previous rank's."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: Tensor) -> tuple[Tensor, list]:
        received = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, labels: Optional[Tensor],
                group: dist.ProcessGroup, scale: Optional[float], window: Optional[int]) -> Tensor:
        ring = _Ring(group)
        scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        repeats = query.size(-3) // key.size(-3)
        c = query.size(-2) // 2
        q = query.float()
        q_chunks = q.split(c, dim=-2)
        out = [torch.zeros_like(part) for part in q_chunks]
        lse = [torch.full((*part.shape[:-1], 1), float("-inf"), device=q.device) for part in q_chunks]
        kv = torch.stack([key.float(), value.float()]).contiguous()
        for step in range(ring.size):
            works: list = []
            if step < ring.size - 1:
                incoming, works = ring.start(kv)
            for qa, _, k, v, allowed in _pairs(ring, step, kv, c, repeats, labels, window):
                for rows in _row_blocks(c):  # each query row's softmax is its own: scores a block of rows at a time
                    s = _scores(q_chunks[qa][..., rows, :], k, _rows(allowed, rows), scale)
                    block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                    finite = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
                    block_out = torch.matmul(torch.exp(s - finite), v)
                    before = lse[qa][..., rows, :]
                    merged = torch.logaddexp(before, block_lse)
                    safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
                    out[qa][..., rows, :] = (out[qa][..., rows, :] * torch.exp(before - safe)
                                             + block_out * torch.exp(block_lse - safe))
                    lse[qa][..., rows, :] = merged
            if works:
                _wait(works)
                kv = incoming
        output, log_sum_exp = torch.cat(out, dim=-2), torch.cat(lse, dim=-2)
        ctx.save_for_backward(query, key, value, output, log_sum_exp, labels)
        ctx.ring, ctx.scale, ctx.window, ctx.repeats = ring, scale, window, repeats
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        query, key, value, output, log_sum_exp, labels = ctx.saved_tensors
        ring, scale, window, repeats = ctx.ring, ctx.scale, ctx.window, ctx.repeats
        c = query.size(-2) // 2
        q, g = query.float(), grad.float()
        delta = (g * output).sum(-1, keepdim=True)  # FlashAttention's D = rowsum(dO * O)
        q_chunks, g_chunks = q.split(c, dim=-2), g.split(c, dim=-2)
        lse_chunks, delta_chunks = log_sum_exp.split(c, dim=-2), delta.split(c, dim=-2)
        dq = [torch.zeros_like(part) for part in q_chunks]
        # The keys and values travel ahead (each step's transfer under that step's compute) and their gradients one
        # step behind: the visiting keys' gradients so far, from the ranks they visited before, arrive under this
        # step's compute; this rank adds its part and sends them on under the next step's (home after the last).
        kv = torch.stack([key.float(), value.float()]).contiguous()
        dkv_works: list = []
        arriving: Optional[Tensor] = None  # the visiting keys' and values' gradients so far, in flight to this rank
        for step in range(ring.size):
            kv_works: list = []
            if step < ring.size - 1:
                incoming_kv, kv_works = ring.start(kv)
            parts = []  # (key slot, dk, dv) of this rank's chunk pairs, added to the travelling gradients in order
            for qa, kb, k, v, allowed in _pairs(ring, step, kv, c, repeats, labels, window):
                dk, dv = torch.zeros_like(k), torch.zeros_like(v)
                for rows in _row_blocks(c):
                    q_rows, g_rows = q_chunks[qa][..., rows, :], g_chunks[qa][..., rows, :]
                    s = _scores(q_rows, k, _rows(allowed, rows), scale)
                    p = torch.exp(s - lse_chunks[qa][..., rows, :])  # the block's attention weights (masked: 0)
                    dv += torch.matmul(p.transpose(-1, -2), g_rows)
                    ds = p * (torch.matmul(g_rows, v.transpose(-1, -2)) - delta_chunks[qa][..., rows, :])
                    dq[qa][..., rows, :] += torch.matmul(ds, k) * scale
                    dk += torch.matmul(ds.transpose(-1, -2), q_rows) * scale
                parts.append((kb, _fold(dk, repeats), _fold(dv, repeats)))
            _wait(dkv_works)
            dkv = torch.zeros_like(kv) if arriving is None else arriving  # step 0: this rank's own keys, first here
            for kb, dk, dv in parts:
                dkv[0].narrow(-2, kb * c, c).add_(dk)
                dkv[1].narrow(-2, kb * c, c).add_(dv)
            arriving, dkv_works = ring.start(dkv)
            if kv_works:
                _wait(kv_works)
                kv = incoming_kv
        _wait(dkv_works)
        dkv = arriving  # this rank's keys' and values' gradients, home from the last rank they visited
        grad_query = torch.cat(dq, dim=-2).to(query.dtype)
        return grad_query, dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None, None
