"""How fast a GEMM runs by its shape: `matmul_time_factor`, the blocks' weight GEMMs against the cluster's
``matmul_efficiency`` (`lightning_hybrid.planner.cluster.Cluster.matmul_k0`)."""

from __future__ import annotations

from .model import ModelSpec

__all__ = ["matmul_time_factor", "moe_time_factors"]


def matmul_time_factor(model: ModelSpec, tp: int = 1, k0: float = 0.0) -> float:
    """How much longer a block's weight GEMMs take than at the cluster's ``matmul_efficiency``, by their shapes.

    A GEMM ``(M x K) @ (K x N)`` runs at ``E K / (K + K0)`` of the peak: each output tile pays, besides its
    ``K``-deep reduction at ``E`` of the peak, a fixed cost (loading its first operands, the epilogue writing it,
    the last wave's tail) worth a reduction ``K0`` deep -- so GEMMs with a short reduction are slow whatever ``M``
    and ``N``. Per device under TP the reduction is ``h`` for the column-parallel matrices (q/k/v, the MLP's up and
    gate) and ``a d / tp`` and ``F / tp`` for the row-parallel ones (o, down). The factor is the weights' mean of
    ``1 + K0 / K`` (1 for ``k0 = 0``: one efficiency for every shape, as on the CPU cluster). `estimate_time` applies
    it to the blocks' weight GEMMs (a MoE block's experts too) and ``1 + K0/h`` to the LM head; attention's core
    (flash / SDPA kernels, whose reduction is the head or the sequence) stays at ``E``."""
    if k0 <= 0:
        return 1.0
    return _mean_factor(_attention_parts(model, tp) + _mlp_parts(model, model.ffn, tp), k0)


def moe_time_factors(model: ModelSpec, tp: int = 1, k0: float = 0.0) -> tuple[float, float]:
    """`matmul_time_factor` for a MoE block's two kinds of weight GEMMs: ``(split, experts)`` -- the attention's and
    the shared experts' (split over TP like a dense block's), and the router's and experts' on the routed tokens,
    each expert whole on its rank: reductions ``h`` (router, up, gate) and the expert's width ``F_e`` (down: a
    narrow expert's down projection is a short reduction, slow whatever the tokens)."""
    if k0 <= 0:
        return 1.0, 1.0
    h = model.hidden
    experts = [(model.experts * h, h)] + [(w, k) for w, k in _mlp_parts(model, model.expert_ffn, 1)]
    return (_mean_factor(_attention_parts(model, tp) + _mlp_parts(model, model.shared_ffn, tp), k0),
            _mean_factor(experts, k0))


def _attention_parts(model: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """``(weights, reduction per device)`` of the attention's matrices: q, k, v (column: ``h``) and o (row)."""
    h, o = model.hidden, model.heads * model.head_dim * model.hidden
    return [(model.attention_weights() - o, h), (o, model.heads * model.head_dim / tp)]


def _mlp_parts(model: ModelSpec, width: int, tp: int) -> list[tuple[float, float]]:
    """``(weights, reduction per device)`` of an MLP of ``width`` split over ``tp``: up (and gate) ``h``, down
    ``width / tp``; none for width 0."""
    if not width:
        return []
    h = model.hidden
    return [(model.mlp_weights(width) - h * width, h), (h * width, width / tp)]


def _mean_factor(parts: list[tuple[float, float]], k0: float) -> float:
    """The weights' mean of ``1 + K0 / K`` over ``parts``."""
    weights = sum(w for w, _ in parts)
    return sum(w * (1 + k0 / k) for w, k in parts) / weights if weights else 1.0
