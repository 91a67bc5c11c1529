"""Module replacement: turn a plain model into its tensor-parallel form, in place."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_hybrid.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_hybrid.tensor_parallel.plan import TPPlan


def apply_tp(model: nn.Module, group: dist.ProcessGroup, plan: TPPlan) -> None:
    """Replace the modules named in ``plan`` by TP layers holding this rank's slices (over ``group``).

    Also divides the head-count attributes of split attention modules by the TP size, so model code that
    reads them sees this rank's heads, and re-ties weights the unsplit model shared (e.g. tied embeddings).
    Idempotent: modules that are already TP layers are left alone; modules the plan names but ``model`` no
    longer holds (layers of other pipeline stages) are skipped.
    """
    tp = dist.get_world_size(group)
    modules = dict(model.named_modules())
    tied = _tied_weight_owners(model)
    for name, layer_plan in plan.layers.items():
        original = modules.get(name)
        if not isinstance(original, (nn.Linear, nn.Embedding)):  # done (a TP layer), or held by another pipeline
            continue  # rank: absent, or the stand-in of a pipeline layer that is itself a Linear / Embedding
        if isinstance(original, nn.Embedding):
            replacement: nn.Module = VocabParallelEmbedding(original, group)
        elif layer_plan.style == "colwise":
            replacement = ColumnParallelLinear(original, group, layer_plan.gather_output, layer_plan.part_sizes)
        else:
            replacement = RowParallelLinear(original, group, layer_plan.input_is_parallel)
        _set_submodule(model, name, replacement)
    for parent_name, attrs in plan.head_attrs.items():
        parent = modules.get(parent_name)
        if parent is None or getattr(parent, "_tp_heads_divided", False):
            continue
        for attr in attrs:
            setattr(parent, attr, getattr(parent, attr) // tp)
        parent._tp_heads_divided = True
    _retie(model, tied)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def _tied_weight_owners(model: nn.Module) -> list[list[str]]:
    """Groups of ``module.param`` names that share one Parameter (only groups of two or more)."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{module_name}.{param_name}" if module_name else param_name)
    return [sorted(set(names)) for names in owners.values() if len(set(names)) > 1]


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    for names in tied:
        params = [model.get_parameter(n) for n in names]
        first = params[0]
        for name, param in zip(names[1:], params[1:]):
            if param is first:
                continue
            if param.shape != first.shape:
                raise ValueError(
                    f"Tied parameters {names} were split differently by tensor parallelism ({list(first.shape)} vs"
                    f" {list(param.shape)}); split them the same way or mark both 'replicate' in tp_plan."
                )
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name) if module_name else model, leaf, first)
