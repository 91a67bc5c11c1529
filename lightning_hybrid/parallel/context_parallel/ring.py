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
keeps for backward is its own queries, keys, values, output and log-sum-exp (`ContextParallel` does not checkpoint
the ring: that is what SDPA keeps at cp=1, over cp; a checkpointed layer recomputes it whole); what it
holds beyond that at any time is two ranks' keys and values (in backward also their gradients, and this step's
part of them) and one chunk pair's kernel's working set (its mask as an additive bias, its output).

Each chunk pair runs on SDPA's own fused kernels where torch has one that takes a mask and returns the log-sum-exp
(`_pair_forward`, `_pair_backward`): the CPU's flash kernel, CUDA's memory-efficient kernel (head sizes a multiple
of 8); in the inputs' dtype, the merge in fp32 -- the same attention as one device's up to the order of its sums.
These are torch's private ops: each is checked once a process (by device and dtype) against the explicit scores on
the first chunk pair of its first forward and backward, before any transfer, and a difference is an error
(`_check`). Elsewhere explicit fp32 scores, ``ROWS`` query rows at a time. Attention dropout is refused.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid.core.document_attention import causal_band

__all__ = ["CP_ATTENTION", "ring_attention"]

#: The values of the strategy's ``cp_attention``: the keys and values all-gathered (`ContextParallel`'s default), or
#: passed around the CP group (`ring_attention`).
CP_ATTENTION = ("all_gather", "ring")


def ring_attention(query: Tensor, key: Tensor, value: Tensor, labels: Optional[Tensor], group: dist.ProcessGroup,
                   scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """``(B, H, 2c, D)`` attention of this CP rank's queries (its zigzag chunks ``rank`` and ``2 cp - 1 - rank`` of
    ``c`` tokens) over the whole sequence's keys and values, each rank's ``key`` / ``value`` ``(B, Hkv, 2c, D)``
    (``Hkv`` dividing ``H``: grouped-query heads repeated per block) passed around ``group``. ``labels`` ``(B, T)``:
    a query sees only keys of its own label (documents, attention chunks), ``None`` for plain causal rows;
    ``window``: only keys less than that many places before it. In SDPA's dtype: autocast's where it is on (as
    autocast casts SDPA's inputs), else the inputs' common one."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    with torch.autocast(device, enabled=False):  # the merge and the explicit scores in fp32, as written
        return _RingAttention.apply(query.to(dtype), key.to(dtype), value.to(dtype), labels, group, scale, window)


def _chunk_indices(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def _allowed(labels: Optional[Tensor], window: Optional[int], a: int, b: int, c: int,
             device: torch.device) -> tuple[Optional[Tensor], bool]:
    """Which keys of chunk ``b`` the queries of chunk ``a`` (``c`` tokens each) see: ``(mask, causal)``, the mask
    ``(B or 1, 1, c, c)`` bools (`causal_band`, and the same label), ``None`` with ``causal`` for a chunk's own keys
    in plain causal order (the kernels' own causal mask), ``None`` alone for all of them."""
    if labels is None and window is None:
        return None, a == b
    mask = None
    if a == b or window is not None:
        mask = causal_band(a * c, (a + 1) * c, window, device, keys=(b * c, (b + 1) * c))[None, None]
    if labels is not None:
        same = (labels[:, a * c:(a + 1) * c, None] == labels[:, None, b * c:(b + 1) * c])[:, None]
        mask = same if mask is None else mask & same
    return mask, False


def _masked_whole(a: int, b: int, c: int, window: Optional[int]) -> bool:
    """Whether chunk ``a``'s queries see none of chunk ``b``'s keys: every key after every query, or every key at
    least ``window`` places before every query."""
    return b > a or (window is not None and (a - b - 1) * c + 1 >= window)


#: Query rows whose scores against a chunk are computed at once where no fused kernel runs (`_explicit_forward`):
#: the transient scores are ``ROWS x c`` per head.
ROWS = 128


def _row_blocks(c: int) -> list[slice]:
    return [slice(start, min(start + ROWS, c)) for start in range(0, c, ROWS)]


def _repeat(t: Tensor, repeats: int) -> Tensor:
    return t if repeats == 1 else t.repeat_interleave(repeats, dim=-3)


def _fold(t: Tensor, repeats: int) -> Tensor:
    """The gradient of `_repeat`: a key/value head's copies summed."""
    return t if repeats == 1 else t.unflatten(-3, (-1, repeats)).sum(-3)


def _pairs(ring: "_Ring", step: int, visiting: Tensor, c: int, repeats: int, labels: Optional[Tensor],
           window: Optional[int]):
    """At ``step`` of the ring, each (query chunk, key chunk) pair of this rank's queries and the ``visiting`` keys
    and values (``visiting[0]``, ``visiting[1]``: the rank ``step`` places before's) that the mask does not cut
    whole: ``(query slot, key slot, keys, values, (mask, causal))``, the key/value heads repeated per query head."""
    source = (ring.rank - step) % ring.size
    for qa, a in enumerate(_chunk_indices(ring.rank, ring.size)):
        for kb, b in enumerate(_chunk_indices(source, ring.size)):
            if not _masked_whole(a, b, c, window):
                yield (qa, kb, _repeat(visiting[0].narrow(-2, kb * c, c), repeats),
                       _repeat(visiting[1].narrow(-2, kb * c, c), repeats),
                       _allowed(labels, window, a, b, c, visiting.device))


# ---------------------------------------------------------------------------------------------- one chunk pair
# A chunk pair's attention and its gradients, by the queries' device: SDPA's own fused kernels where torch has one
# that takes a mask and returns the log-sum-exp (the CPU's flash kernel; CUDA's memory-efficient kernel), explicit
# fp32 scores elsewhere. Each returns the pair's output and log-sum-exp in fp32 (the merge's precision); rows that
# see none of the pair's keys get the log-sum-exp -inf (and an output of 0), whatever the kernel leaves there.

def _kernel(q: Tensor) -> str:
    """``"cpu"``, ``"cuda"`` (head dimensions its kernel takes: multiples of 8) or ``"explicit"``."""
    if q.device.type == "cpu" or (q.device.type == "cuda" and q.size(-1) % 8 == 0):
        return q.device.type
    return "explicit"


def _bias(mask: Optional[Tensor], q: Tensor, k: Tensor, kernel: str) -> Optional[Tensor]:
    """``mask`` as the additive bias the fused kernels take: 0 where a key is seen, -inf where not, in the queries'
    dtype; for CUDA's kernel over every head and its rows 16-element aligned (as SDPA pads it)."""
    if mask is None:
        return None
    if kernel != "cuda":
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    b, h, rows, keys = q.size(0), q.size(1), q.size(-2), k.size(-2)
    bias = torch.zeros(*mask.shape[:-1], -(-keys // 16) * 16, dtype=q.dtype, device=q.device)[..., :keys]
    return bias.masked_fill_(~mask, float("-inf")).expand(b, h, rows, keys)


def _explicit_mask(mask: Optional[Tensor], causal: bool, c: int, device: torch.device) -> Optional[Tensor]:
    return torch.ones(c, c, dtype=torch.bool, device=device).tril()[None, None] if causal else mask


def _scores(q: Tensor, k: Tensor, allowed: Optional[Tensor], scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _explicit_forward(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor],
                      scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = q.float(), k.float(), v.float()
    outs, lses = [], []
    for rows in _row_blocks(q.size(-2)):  # each query row's softmax is its own: scores a block of rows at a time
        s = _scores(q[..., rows, :], k, None if allowed is None else allowed[..., rows, :], scale)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        outs.append(torch.matmul(torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)), v))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)


def _explicit_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       allowed: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor, Tensor]:
    delta = (g * out).sum(-1, keepdim=True)  # FlashAttention's D = rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows in _row_blocks(q.size(-2)):
        q_rows, g_rows = q[..., rows, :], g[..., rows, :]
        s = _scores(q_rows, k, None if allowed is None else allowed[..., rows, :], scale)
        p = torch.exp(s - lse[..., rows, :])  # the block's attention weights (masked: 0)
        dv += torch.matmul(p.transpose(-1, -2), g_rows)
        ds = p * (torch.matmul(g_rows, v.transpose(-1, -2)) - delta[..., rows, :])
        dq[..., rows, :] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q_rows) * scale
    return dq, dk, dv


def _pair_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool, scale: float,
                  kernel: Optional[str] = None) -> tuple[Tensor, Tensor, tuple]:
    """The pair's ``(output, log-sum-exp (..., rows, 1), what the CUDA kernel's backward takes back)`` on ``kernel``
    (default: the queries' device's, `_kernel`)."""
    kernel = kernel or _kernel(q)
    philox: tuple = ()
    if kernel == "explicit":
        return (*_explicit_forward(q, k, v, _explicit_mask(mask, causal, q.size(-2), q.device), scale), philox)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(mask, q, k, kernel), scale=scale)
    else:
        out, lse, *philox = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _bias(mask, q, k, kernel), True, 0.0, causal, scale=scale)
        lse = lse[..., :q.size(-2)]  # its rows padded to 32
    out, lse = out.float(), lse.unsqueeze(-1).float()
    if mask is not None:
        seen = mask.any(-1, keepdim=True)
        out, lse = out.masked_fill(~seen, 0.0), lse.masked_fill(~seen, float("-inf"))
    return out, lse, tuple(philox)


def _pair_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Optional[Tensor],
                   causal: bool, scale: float, philox: tuple,
                   kernel: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The pair's ``(dq, dk, dv)`` in fp32 from the whole attention's ``out`` and ``lse`` (FlashAttention's
    backward of one key block: its weights ``exp(s - lse)``, ``D = rowsum(g * out)``) on ``kernel`` (as
    `_pair_forward`); rows that see nothing anywhere (``lse`` -inf) contribute nothing."""
    kernel = kernel or _kernel(q)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    if kernel == "explicit":
        return _explicit_backward(g.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                  _explicit_mask(mask, causal, q.size(-2), q.device), scale)
    if kernel == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse.squeeze(-1), 0.0, causal, attn_mask=_bias(mask, q, k, kernel), scale=scale)
    else:
        rows = q.size(-2)
        padded = torch.zeros(*lse.shape[:-2], -(-rows // 32) * 32, dtype=torch.float32, device=q.device)
        padded[..., :rows] = lse.squeeze(-1)  # the layout its forward returned
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, _bias(mask, q, k, kernel), out, padded, *philox, 0.0, [True, True, True, False], causal,
            scale=scale)[:3]
    return tuple(t.float() for t in grads)


#: The fused kernels checked in this process against the explicit scores on their first chunk pair, by (device
#: type, dtype, "forward" or "backward"): calls of torch's private SDPA ops whose arguments or layouts a torch version
#: changed are an error at the first ring attention, not a silently different attention or gradient.
_CHECKED: set[tuple[str, torch.dtype, str]] = set()
#: How far a fused pair may be from the explicit scores (relative to the largest value, absolute below 1).
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
CHECK_TOLERANCE_16 = 3e-2


def _unchecked(q: Tensor, kind: str) -> bool:
    return _kernel(q) != "explicit" and (q.device.type, q.dtype, kind) not in _CHECKED


def _difference(got: tuple, want: tuple) -> float:
    """The largest difference of tensors ``got`` from ``want`` over their finite elements, relative to ``want``'s
    largest (absolute below 1); ``inf`` where they are not ``-inf`` in the same places."""
    error = 0.0
    for a, b in zip(got, want):
        a, b = a.float(), b.float()
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            return float("inf")
        finite = ~torch.isinf(b)
        if finite.any():
            error = max(error, ((a[finite] - b[finite]).abs().max() / b[finite].abs().max().clamp_min(1)).item())
    return error


def _check(kind: str, q: Tensor, got: tuple, want: tuple) -> None:
    """``RuntimeError`` unless a pair's fused results ``got`` are its explicit ones ``want`` within
    `CHECK_TOLERANCE` (`_difference`); else the kernel counts as checked for the queries' device and dtype."""
    error = _difference(got, want)
    if not error <= CHECK_TOLERANCE.get(q.dtype, CHECK_TOLERANCE_16):
        raise RuntimeError(f"cp_attention='ring': SDPA's fused {_kernel(q)} attention kernel ({q.dtype}) differs from"
                           f" the explicit attention of a chunk pair by {error:.2e} in its {kind} pass (torch"
                           f" {torch.__version__}), so the ring would not compute one device's attention: use"
                           " cp_attention='all_gather'.")
    _CHECKED.add((q.device.type, q.dtype, kind))


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
        q_chunks = query.split(c, dim=-2)
        out = [torch.zeros(part.shape, dtype=torch.float32, device=part.device) for part in q_chunks]
        lse = [torch.full((*part.shape[:-1], 1), float("-inf"), device=part.device) for part in q_chunks]
        kv = torch.stack([key, value]).contiguous()
        if _unchecked(query, "forward"):  # before any transfer starts: an error leaves none in flight
            qa, _, k, v, (mask, causal) = next(_pairs(ring, 0, kv, c, repeats, labels, window))
            pair = (q_chunks[qa], k, v, mask, causal, scale)
            _check("forward", query, _pair_forward(*pair)[:2], _pair_forward(*pair, kernel="explicit")[:2])
        philox: tuple = ()
        for step in range(ring.size):
            works: list = []
            if step < ring.size - 1:
                incoming, works = ring.start(kv)
            for qa, _, k, v, (mask, causal) in _pairs(ring, step, kv, c, repeats, labels, window):
                block_out, block_lse, philox = _pair_forward(q_chunks[qa], k, v, mask, causal, scale)
                merged = torch.logaddexp(lse[qa], block_lse)  # FlashAttention's merge of two key blocks
                safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
                out[qa] = out[qa] * torch.exp(lse[qa] - safe) + block_out * torch.exp(block_lse - safe)
                lse[qa] = merged
            if works:
                _wait(works)
                kv = incoming
        output = torch.cat(out, dim=-2).to(query.dtype)
        ctx.save_for_backward(query, key, value, output, torch.cat(lse, dim=-2), labels)
        ctx.ring, ctx.scale, ctx.window, ctx.repeats, ctx.philox = ring, scale, window, repeats, philox
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        query, key, value, output, log_sum_exp, labels = ctx.saved_tensors
        ring, scale, window, repeats = ctx.ring, ctx.scale, ctx.window, ctx.repeats
        c = query.size(-2) // 2
        grad = grad.to(query.dtype).contiguous()  # (an expanded gradient: the kernels read its rows)
        q_chunks, g_chunks, out_chunks = query.split(c, dim=-2), grad.split(c, dim=-2), output.split(c, dim=-2)
        lse_chunks = log_sum_exp.split(c, dim=-2)
        dq = [torch.zeros(part.shape, dtype=torch.float32, device=part.device) for part in q_chunks]
        # The keys and values travel ahead (each step's transfer under that step's compute) and their gradients one
        # step behind: the visiting keys' gradients so far, from the ranks they visited before, arrive under this
        # step's compute; this rank adds its part and sends them on under the next step's (home after the last).
        kv = torch.stack([key, value]).contiguous()
        if _unchecked(query, "backward"):  # before any transfer starts: an error leaves none in flight
            qa, _, k, v, (mask, causal) = next(_pairs(ring, 0, kv, c, repeats, labels, window))
            pair = (g_chunks[qa], q_chunks[qa], k, v, out_chunks[qa], lse_chunks[qa], mask, causal, scale, ctx.philox)
            _check("backward", query, _pair_backward(*pair), _pair_backward(*pair, kernel="explicit"))
        dkv_works: list = []
        arriving: Optional[Tensor] = None  # the visiting keys' and values' gradients so far, in flight to this rank
        for step in range(ring.size):
            kv_works: list = []
            if step < ring.size - 1:
                incoming_kv, kv_works = ring.start(kv)
            parts = []  # (key slot, dk, dv) of this rank's chunk pairs, added to the travelling gradients in order
            for qa, kb, k, v, (mask, causal) in _pairs(ring, step, kv, c, repeats, labels, window):
                dq_pair, dk, dv = _pair_backward(g_chunks[qa], q_chunks[qa], k, v, out_chunks[qa], lse_chunks[qa],
                                                 mask, causal, scale, ctx.philox)
                dq[qa] += dq_pair
                parts.append((kb, _fold(dk, repeats), _fold(dv, repeats)))
            _wait(dkv_works)
            if arriving is None:  # step 0: this rank's own keys, first here
                arriving = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dkv = arriving
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
