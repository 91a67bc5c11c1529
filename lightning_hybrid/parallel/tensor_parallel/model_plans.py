"""The tensor-parallel plans that models ship themselves.

`transformers` keeps a plan beside each model (``config.base_model_tp_plan`` for the base model, ``_tp_plan``
for the head, merged in the model's ``tp_plan``), maintained with the model code: module-name patterns
(``layers.*.self_attn.q_proj``) mapped to styles. `model_tp_plan` finds every transformers model inside a
module tree (as the LightningModule's child, or the LightningModule itself) and returns those plans with
absolute, ``fnmatch``-style patterns. Nothing here imports transformers: a model is an instance of its
``PreTrainedModel``, looked up only where transformers has loaded it (no instance exists before).

`MODEL_STYLES` maps their style names to ours; the styles we do not implement (expert parallelism, packed
MoE weights, sequence-parallel norms) leave the module replicated, and the plan's summary says so.
"""

from __future__ import annotations

import sys

from torch import nn

# Our styles: "colwise" / "rowwise" (+ whether the column output is gathered / the row input is whole),
# "embedding" (vocabulary split), "replicate".
MODEL_STYLES: dict[str, tuple[str, dict]] = {
    "colwise": ("colwise", {}),
    "colwise_gather_output": ("colwise", {"gather_output": True}),
    "colwise_rep": ("colwise", {"gather_output": True}),
    "rowwise": ("rowwise", {}),
    "rowwise_split_input": ("rowwise", {"input_is_parallel": False}),
    "rowwise_rep": ("rowwise", {"input_is_parallel": False}),
    "embedding_rowwise": ("rowwise", {}),
    "replicate": ("replicate", {}),
    "replicated_with_grad_allreduce": ("replicate", {}),
    "local": ("replicate", {}),
    "local_params": ("replicate", {}),
}


def _is_transformers_model(module: nn.Module) -> bool:
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return modeling_utils is not None and isinstance(module, modeling_utils.PreTrainedModel)


def _plan_of(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None)  # transformers >= 5: base model plan and head plan, merged
    if isinstance(plan, dict):
        return dict(plan)
    merged = dict(getattr(model, "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    merged.update({f"{inner}.{k}" if inner else k: v for k, v in base.items()})
    return merged


def model_tp_plan(root: nn.Module) -> dict[str, str]:
    """``{absolute module-name pattern: style}`` from every outermost transformers model in ``root``."""
    patterns: dict[str, str] = {}
    taken: list[str] = []
    for name, module in root.named_modules():
        if any(t == "" or name == t or name.startswith(t + ".") for t in taken) or not _is_transformers_model(module):
            continue
        taken.append(name)
        for key, style in _plan_of(module).items():
            patterns[f"{name}.{key}" if name else key] = style
    return patterns
