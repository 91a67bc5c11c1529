"""ZeRO-3's float8 all-gather: each FP8 linear's weight gathered as float8 (1 byte an element) instead of in its
training precision, as torchao's ``enable_fsdp_float8_all_gather`` does for FSDP2 -- with the scale one device
computes.

The float8 GEMM casts the gathered weight to float8 anyway (tensorwise: one scale for the whole tensor), so the
cast can move before the gather: each rank casts its shard with the whole weight's scale and FSDP2 gathers the
float8 values, which are the float8 values of the whole weight, element for element. The weight's parameter holds
torchao's ``WeightWithDynamicFloat8CastTensor`` (FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
extension: the shard is cast before the gather and the gathered bytes become a ``Float8TrainingTensor``, which
`lightning_hybrid.parallel.float8`'s GEMMs take as they are). The scale is set on it before each gather
(`Float8WeightScales`): the amax of every shard of every float8 weight of an FSDP unit, MAX-reduced in one
all-reduce over the stage's ranks -- the data-parallel shards and, in a TP-split layer, every TP piece, so that a
split weight is scaled by the unsplit weight's amax as one device scales it (torchao's own path reduces over the
FSDP mesh alone, which under TP would scale each TP piece by itself). Cost: one all-reduce of a few floats per
forward of each FSDP unit holding float8 weights; the gathered bytes of those weights halve (bf16) or quarter (fp32).

Only tensorwise weight scaling has one scale per tensor to cast a shard with (torchao alike); rowwise recipes and
other ZeRO stages refuse the option (`lightning_hybrid.parallel.float8.validate_float8`, `ParallelOptions`).
Weights shared with other modules (an LM head tied to the embedding) are gathered in their training precision:
the embedding reads the same gathered tensor.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.core.collectives import all_reduce


def float8_all_gather_on(module: nn.Module) -> bool:
    """Whether ``module`` is a float8 linear (`lightning_hybrid.parallel.float8`) whose config asks for the float8
    all-gather."""
    matmul = getattr(module, "float8", None)
    return matmul is not None and bool(getattr(matmul.config, "enable_fsdp_float8_all_gather", False))


def wrap_float8_weights(module: nn.Module, shared: set[int]) -> list[str]:
    """Before ``fully_shard``: each float8 linear's weight that asks for the float8 all-gather (and is not in
    ``shared``, ids of parameters other modules use too) becomes a parameter holding torchao's
    ``WeightWithDynamicFloat8CastTensor`` (same values, same name, same ``requires_grad``). Returns their names."""
    wrapped = []
    for name, child in module.named_modules():
        if not float8_all_gather_on(child) or id(child.weight) in shared:
            continue
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        weight, matmul = child.weight, child.float8
        child.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(weight.data, matmul.mm_config,
                                              matmul.config.cast_config_weight.target_dtype),
            requires_grad=weight.requires_grad)
        wrapped.append(f"{name}.weight" if name else "weight")
    return wrapped


def is_float8_weight(p: Tensor) -> bool:
    """Whether ``p`` (a sharded DTensor parameter, or its local tensor) holds a float8-gathered weight."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # not imported: nothing was wrapped
    return fsdp_utils is not None and isinstance(getattr(p, "_local_tensor", p),
                                                 fsdp_utils.WeightWithDynamicFloat8CastTensor)


class Float8WeightScales:
    """A forward pre-hook (prepended, so that it runs before FSDP2 gathers the unit) of an FSDP unit that holds
    float8-gathered weights: sets each weight's scale (``_precomputed_scale``, which torchao's
    ``fsdp_pre_all_gather`` casts the shard with) from its amax over every rank that holds a piece of it (the float8
    layout's ``tokens`` group: the stage's data-parallel x context-parallel x TP ranks), one all-reduce for the unit.
    Computed at every forward of the unit, so that the optimizer step, a loaded checkpoint or a user's edit of the
    weights is always seen; a backward's gather (and an activation checkpoint's recompute) uses the same weights."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers  # the unit's float8 linears whose weights are gathered in float8
        self.weights = [layer.weight for layer in layers]  # the sharded parameters (DTensors), as FSDP2 made them

    @torch._dynamo.disable
    def __call__(self, module: nn.Module, args) -> None:
        from torchao.float8.float8_utils import amax_to_scale

        with torch.no_grad():
            shards = [w._local_tensor for w in self.weights]
            amaxes = torch.stack([torch.max(torch.abs(s._tensor)).float() if s.numel()
                                  else torch.zeros((), dtype=torch.float32, device=s.device) for s in shards])
            group: Optional[dist.ProcessGroup] = self.layers[0].float8.layout.tokens
            if group is not None:
                amaxes = all_reduce(amaxes, group, "max")
            for layer, shard, amax in zip(self.layers, shards, amaxes):
                config = layer.float8.config
                shard._precomputed_scale = amax_to_scale(amax, config.cast_config_weight.target_dtype,
                                                         config.round_scales_to_power_of_2)


def register_float8_scales(modules: list[nn.Module]) -> int:
    """After ``fully_shard``: a `Float8WeightScales` hook on each FSDP unit among ``modules`` (and their
    submodules) whose own parameters include float8-gathered weights. Returns how many units got one."""
    from torch.distributed.fsdp import FSDPModule

    units = {id(m): m for root in modules for m in root.modules() if isinstance(m, FSDPModule)}
    count = 0
    for unit in units.values():
        held = {id(p) for p in _own_parameters(unit)}
        layers = [m for m in unit.modules() if float8_all_gather_on(m) and id(m.weight) in held
                  and is_float8_weight(m.weight)]
        if layers:
            unit.register_forward_pre_hook(Float8WeightScales(layers), prepend=True)
            count += 1
    return count


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 shards with ``unit`` itself (not with an FSDP unit inside it)."""
    state = unit._get_fsdp_state()
    group = state._fsdp_param_group
    return [] if group is None else [p.sharded_param for p in group.fsdp_params]
