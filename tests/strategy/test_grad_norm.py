"""The global gradient norm across TP shards, ZeRO (DP) shards and pipeline stages, and clipping by it: on real
gloo process groups, without Lightning, against the norm of the unsplit gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_hybrid.grad_norm import clip_grads_, global_grad_norm
from lightning_hybrid.testing import run_distributed


def _unsplit_gradients() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g), "c": torch.randn(6, generator=g),
            "d": torch.randn(4, 2, generator=g)}


def _norms_over_meshes() -> dict[str, float]:
    """On 4 ranks: the norm of the same gradients split over a (dp=2, tp=2) mesh and over a (pp=2, tp=2) mesh."""
    dist.init_process_group("gloo")
    full = _unsplit_gradients()
    # dp x tp: a is a TP shard (rows), b replicated, c a ZeRO slice over dp, d a ZeRO slice of a TP shard.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    pieces = [
        (full["a"].chunk(2, dim=0)[tp], True, False),
        (full["b"], False, False),
        (full["c"].chunk(2)[dp], False, True),
        (full["d"].chunk(2, dim=0)[tp].flatten().chunk(2)[dp], True, True),
    ]
    dp_tp = global_grad_norm(pieces, mesh["tp"].get_group(), mesh["dp"].get_group())
    # pp x tp: stage 0 holds a (TP shard) and b, stage 1 holds c (TP shard) and d; no DP group.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    sharded, replicated = (full["a"], full["b"]) if pp == 0 else (full["c"], full["d"])
    pp_tp = global_grad_norm([(sharded.chunk(2, dim=0)[tp], True, False), (replicated, False, False)],
                             mesh["tp"].get_group(), None, mesh["pp"].get_group())
    # Clipping to half the norm scales every local piece by the same factor, on every rank.
    local = [p.clone() for p, *_ in pieces]
    clip_grads_(local, max_norm=dp_tp.item() / 2, total_norm=dp_tp)
    scales = [(after / before).flatten() for after, (before, *_) in zip(local, pieces)]
    return {"dp_tp": dp_tp.item(), "pp_tp": pp_tp.item(), "scale_min": min(s.min().item() for s in scales),
            "scale_max": max(s.max().item() for s in scales)}


def test_global_norm_equals_the_unsplit_norm_on_every_rank():
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in _unsplit_gradients().values()])).item()
    for result in run_distributed(_norms_over_meshes, 4):
        assert abs(result["dp_tp"] - expected) <= 1e-6 * expected
        assert abs(result["pp_tp"] - expected) <= 1e-6 * expected
        assert abs(result["scale_min"] - 0.5) < 1e-5 and abs(result["scale_max"] - 0.5) < 1e-5


def test_without_groups_it_is_the_plain_norm_and_clipping_leaves_small_gradients():
    grads = list(_unsplit_gradients().values())
    norm = global_grad_norm([(g, False, False) for g in grads], None, None)
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    before = [g.clone() for g in grads]
    clip_grads_(grads, max_norm=2 * norm.item(), total_norm=norm)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
