"""Tensor parallelism by module replacement: layers, the plan that picks them, and `apply_tp`."""

from lightning_hybrid.tensor_parallel.apply import apply_tp
from lightning_hybrid.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    gather_full_state_dict,
    load_full_state_dict,
    tp_sharded_parameter_names,
)
from lightning_hybrid.tensor_parallel.plan import LayerPlan, TPPlan, resolve_tp_plan

__all__ = [
    "ColumnParallelLinear",
    "LayerPlan",
    "RowParallelLinear",
    "ShardSpec",
    "TPPlan",
    "VocabParallelEmbedding",
    "apply_tp",
    "gather_full_state_dict",
    "load_full_state_dict",
    "resolve_tp_plan",
    "tp_sharded_parameter_names",
]
