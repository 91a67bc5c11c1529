"""Ring attention (``cp_attention="ring"``) against one device's masked SDPA, operator by operator: outputs and the
gradients of queries, keys and values of every rank's zigzag chunks, for plain causal rows, documents, a sliding
window (both), and grouped-query heads, with query rows taken a few at a time (`ring_attention.ROWS`). Whole runs:
tests/context_expert/test_context_parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hybrid.parallel.context_parallel import zigzag_indices
from tests.helpers import run_distributed

T = 48


def _case(heads: int = 4, kv_heads: int = 2, labels=None, window=None) -> float:
    from lightning_hybrid.parallel.context_parallel import ring

    ring.ROWS = 5  # several row blocks per chunk (12 tokens at cp2)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, T, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, T, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, T, 8, generator=g, requires_grad=True)
    grad = torch.randn(2, heads, T, 8, generator=g)
    places = torch.arange(T)
    allowed = (places[:, None] >= places[None, :])[None, None]
    if window is not None:
        allowed = allowed & (places[:, None] - places[None, :] < window)
    if labels is not None:
        allowed = allowed & (labels[:, None, :, None] == labels[:, None, None, :])
    repeats = heads // kv_heads
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1),
                                               attn_mask=allowed)
    reference.backward(grad)
    mine = zigzag_indices(T, dist.get_world_size(), dist.get_rank())
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring.ring_attention(*local, labels, dist.group.WORLD, None, window)
    out.backward(grad[:, :, mine])
    pairs = [(out, reference)] + [(t.grad, whole.grad) for t, whole in zip(local, (q, k, v))]
    return max((got - want[:, :, mine]).abs().max().item() for got, want in pairs)


def _cases() -> dict[str, float]:
    dist.init_process_group("gloo")
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 18, [0] * 30 + [1] * 18])
    return {"plain": _case(), "documents": _case(labels=docs), "window": _case(window=7),
            "documents and window": _case(labels=docs, window=5), "one key head per query head": _case(kv_heads=4)}


def test_ring_attention_is_one_devices_masked_attention():
    for per_rank in run_distributed(_cases, 2):
        assert max(per_rank.values()) < 5e-6, per_rank
