"""Ring attention's kernels for one chunk pair (`lightning_hybrid.parallel.context_parallel.ring`) against its
explicit fp32 scores, on any device: the output, the log-sum-exp (-inf on rows that see none of the pair's keys)
and the gradients of queries, keys and values from the pair's own output and log-sum-exp. Used by
`test_ring_kernels.py` on the CPU and by `tests/strategy/test_cuda.py` on a GPU."""

from __future__ import annotations

import torch

B, H, C, D = 2, 4, 40, 16


def pair_cases(device: torch.device | str) -> dict[str, tuple]:
    """name -> ``(mask, causal)`` of a chunk pair: every key, a chunk's own keys in causal order, documents whose
    rows see none of these keys in places, and documents within a window (a band)."""
    queries = torch.tensor([[1] * 20 + [2] * 20, [0] * 40], device=device)
    keys = torch.tensor([[0] * 15 + [1] * 25, [0] * 40], device=device)
    documents = (queries[:, :, None] == keys[:, None, :])[:, None]
    places = torch.arange(C, device=device)
    band = ((places[:, None] + 10 - places[None, :] >= 0) & (places[:, None] + 10 - places[None, :] < 25))[None, None]
    return {"every key": (None, False), "causal": (None, True), "documents, rows seeing nothing": (documents, False),
            "documents in a window": (documents & band, False)}


def pair_kernel_errors(device: torch.device | str, dtype: torch.dtype) -> dict[str, float]:
    """name -> the largest difference (output, finite log-sum-exps, gradients; relative to the largest value, or
    absolute below 1) between the device's kernels and the explicit scores in fp32 on the same inputs; ``inf`` where
    they disagree on which rows see no key."""
    from lightning_hybrid.parallel.context_parallel import ring

    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, C, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    scale = D ** -0.5
    errors = {}
    for name, (mask, causal) in pair_cases(device).items():
        out, lse, philox = ring._pair_forward(q, k, v, mask, causal, scale)
        want_out, want_lse, _ = ring._pair_forward(q, k, v, mask, causal, scale, kernel="explicit")
        forward = ring._difference((out, lse), (want_out, want_lse))
        if forward == float("inf"):
            errors[name] = forward
            continue
        grads = ring._pair_backward(grad, q, k, v, out.to(dtype), lse, mask, causal, scale, philox)
        want = ring._pair_backward(grad, q, k, v, want_out, want_lse, mask, causal, scale, (), kernel="explicit")
        errors[name] = max(forward, ring._difference(grads, want))
    return errors
