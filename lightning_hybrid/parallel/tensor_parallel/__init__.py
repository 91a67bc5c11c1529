"""Tensor parallelism by module replacement: layers, the plan that picks them, verification, and `apply_tp`."""

from lightning_hybrid.core.collectives import ShardSpec
from lightning_hybrid.parallel.tensor_parallel.apply import TPResult, apply_tp, apply_variant
from lightning_hybrid.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full_state_dict,
    load_full_state_dict,
    shard_embedding,
    tp_shard_specs,
    tp_sharded_parameter_names,
)
from lightning_hybrid.parallel.tensor_parallel.plan import TPPlan, resolve_tp_plan
from lightning_hybrid.parallel.tensor_parallel.variants import LayerPlan, Variant

__all__ = [
    "ColumnParallelLinear",
    "LayerPlan",
    "RowParallelLinear",
    "ShardSpec",
    "TPPlan",
    "TPResult",
    "Variant",
    "apply_tp",
    "apply_variant",
    "gather_full_state_dict",
    "load_full_state_dict",
    "resolve_tp_plan",
    "shard_embedding",
    "tp_shard_specs",
    "tp_sharded_parameter_names",
]
