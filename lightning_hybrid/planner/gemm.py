"""How fast a GEMM runs by its shape: `matmul_time_factor`, the blocks' weight GEMMs against the cluster's
``matmul_efficiency`` (`lightning_hybrid.planner.cluster.Cluster.matmul_k0`)."""

from __future__ import annotations

from .model import ModelSpec

__all__ = ["matmul_time_factor"]


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
    h, F, o = model.hidden, model.ffn, model.heads * model.head_dim * model.hidden
    parts = [(model.attention_weights() - o, h), (o, model.heads * model.head_dim / tp),
             (model.mlp_weights(F) - h * F, h), (h * F, F / tp)]
    weights = sum(w for w, _ in parts)
    return sum(w * (1 + k0 / k) for w, k in parts) / weights if weights else 1.0
