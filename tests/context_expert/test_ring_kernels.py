"""Ring attention's fused kernels for one chunk pair: the CPU's flash kernel against the explicit fp32 scores
(`ring_kernels.py`; the whole ring against one device is `test_context_parallel.py`'s), and the CUDA kernel's calls
traced on meta tensors (its arguments, the padded log-sum-exp and the aligned bias: what a CPU can check of a path it
cannot run; `tests/strategy/test_cuda.py` runs it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_hybrid.parallel.context_parallel import ring
from tests.context_expert.ring_kernels import B, C, D, H, pair_cases, pair_kernel_errors


def test_the_cpu_flash_kernel_is_the_explicit_attention_of_a_chunk_pair():
    errors = pair_kernel_errors("cpu", torch.float32)
    assert max(errors.values()) < 1e-5, errors
    assert set(errors) == set(pair_cases("cpu"))


def test_a_pair_whose_rows_see_no_key_merges_as_nothing():
    """The CPU kernel leaves a log-sum-exp of 0 on a row that sees no key (a weight of 1 in the merge): the pair's
    log-sum-exp there is -inf and its output 0."""
    mask, causal = pair_cases("cpu")["documents, rows seeing nothing"]
    q = k = v = torch.ones(B, H, C, D)
    out, lse, _ = ring._pair_forward(q, k, v, mask, causal, 1.0)
    blind = ~mask.any(-1)  # (B, 1, C)
    assert blind.any()
    assert torch.isinf(lse.squeeze(-1)[blind.expand(B, H, C)]).all()
    assert (out[blind.expand(B, H, C)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_kernel_calls_trace_on_meta_tensors(monkeypatch, dtype):
    monkeypatch.setattr(ring, "_kernel", lambda q: "cuda")
    q, k, v = (torch.empty(B, H, C, D, device="meta", dtype=dtype) for _ in range(3))
    for name, (mask, causal) in pair_cases("meta").items():
        out, lse, philox = ring._pair_forward(q, k, v, mask, causal, 0.25)
        assert out.shape == q.shape and out.dtype == torch.float32, name
        assert lse.shape == (B, H, C, 1) and lse.dtype == torch.float32, name
        assert len(philox) == 2, name
        grads = ring._pair_backward(q, q, k, v, q, lse, mask, causal, 0.25, philox)
        assert [g.shape for g in grads] == [q.shape] * 3, name
        if mask is not None:
            bias = ring._bias(mask, q, k, "cuda")
            assert bias.shape == (B, H, C, C) and bias.dtype == dtype, name
            assert bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1, (name, bias.stride())


def test_other_devices_and_head_sizes_take_the_explicit_scores():
    assert ring._kernel(torch.empty(1, 1, 4, 8, device="meta")) == "explicit"
    assert ring._kernel(torch.empty(1, 1, 4, 6)) == "cpu"
