"""Activation checkpointing per layer: a checkpointed layer keeps only its input during forward and
recomputes its activations in backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved, so
dropout masks are the same in the recomputation)."""

from __future__ import annotations

import fnmatch
from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_targets(module: nn.Module, target: bool | str, pipelined: bool = False) -> list[str]:
    """Names of the modules to checkpoint: ``True`` -> every layer (the pipeline layers when the module is
    ``pipelined``, else the elements of its ``nn.ModuleList``s); a glob pattern -> the modules whose names match."""
    names = {id(m): n for n, m in module.named_modules()}
    if isinstance(target, str):
        chosen = [n for n in names.values() if n and fnmatch.fnmatchcase(n, target)]
        if not chosen:
            raise ValueError(f"activation_checkpointing={target!r} matches no module; names look like {list(names.values())[1:8]}")
        return chosen
    if pipelined:
        return [names[id(layer)] for layer in module.pipeline_layers() if id(layer) in names]
    return [names[id(m)] for sub in module.modules() if isinstance(sub, nn.ModuleList) for m in sub]


def apply_activation_checkpointing(module: nn.Module, names: list[str]) -> None:
    """Checkpoint each named submodule (in place; parameter names and state dicts do not change)."""
    for name in names:
        layer = module.get_submodule(name)
        if getattr(layer, "_activation_checkpointed", False):
            continue
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
        layer._activation_checkpointed = True
