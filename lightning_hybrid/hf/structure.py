"""Where a ``transformers`` causal LM's pipeline layers are: the trunk holding its decoder-layer list, the trunk's
modules before and after that list (embeddings, final norm), and the output head (`pipeline_structure`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PipelineDecompositionError", "cpu_twin", "pipeline_structure", "tensors_of"]


class PipelineDecompositionError(ValueError):
    """The model's forward does something that its pipeline layers, applied in order, do not."""


class _Structure:
    """Where a causal LM's pipeline layers are: the path to the trunk (the module holding the decoder-layer
    list), the trunk's modules before and after that list, and the head (a child of the root)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config
        n_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
        head = model.get_output_embeddings()
        if head is None:
            raise PipelineDecompositionError(
                f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)."
            )
        root_children = dict(model.named_children())
        self.head_name = next(n for n, m in root_children.items() if m is head)
        self.path: list[str] = []  # root -> trunk
        trunk = model
        while True:
            lists = [n for n, m in trunk.named_children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
            if len(lists) == 1:
                break
            holders = [n for n, m in trunk.named_children() if any(True for _ in m.parameters()) and m is not head]
            if len(holders) != 1 or len(lists) > 1:
                raise PipelineDecompositionError(
                    f"cannot find the decoder layers of {type(model).__name__}: no single nn.ModuleList of"
                    f" num_hidden_layers={n_layers} modules under {'.'.join(self.path) or 'the model'}."
                )
            self.path.append(holders[0])
            trunk = getattr(trunk, holders[0])
        self.trunk = trunk
        self.layers_name = lists[0]
        children = list(trunk.named_children())
        at = [n for n, _ in children].index(self.layers_name)
        # The model's own pipeline plan names the trunk's layers (when the trunk is the base model); without
        # one, the trunk's children holding parameters (and dropouts) are layers, the rest is shared.
        plan = getattr(config, "base_model_pp_plan", None) or {}
        planned = [n for n in plan if n != self.layers_name] if self.path == [model.base_model_prefix] else []

        def placed(name: str, module: nn.Module) -> bool:
            if planned:
                return name in planned
            return any(True for _ in module.parameters()) or isinstance(module, nn.Dropout)

        self.prologue = [n for n, m in children[:at] if placed(n, m)]
        self.epilogue = [n for n, m in children[at + 1 :] if placed(n, m)]
        self.shared = [n for n, m in children if n != self.layers_name and n not in self.prologue + self.epilogue]
        # Embeddings among them, by their output size (known here: TP may replace the modules later).
        self.embeddings = {n: int(_embedding_dim(m)) for n, m in children if n in self.prologue and _embedding_dim(m)}
        unplaced = [n for n in self.shared if any(True for _ in getattr(trunk, n).parameters())]
        unplaced += [
            f"{'.'.join(self.path[: i + 1])}~{n}" for i, owner in enumerate(self._path_modules()[:-1])
            for n, m in owner.named_children()
            if n != self.path[i] and m is not head and any(True for _ in m.parameters())
        ]
        if unplaced or not self.prologue:
            raise PipelineDecompositionError(
                f"cannot place {unplaced or 'the token embedding'} of {type(model).__name__} in a pipeline layer"
                " (parameters outside the embeddings, decoder layers, final norm and head)."
            )

    def _path_modules(self) -> list[nn.Module]:
        out, m = [self.model], self.model
        for n in self.path:
            m = getattr(m, n)
            out.append(m)
        return out

    def prefix(self, name: str) -> str:
        return ".".join([*self.path, name])

    def layer_names(self) -> list[str]:
        n = len(getattr(self.trunk, self.layers_name))
        return (
            [self.prefix(p) for p in self.prologue] + [self.prefix(f"{self.layers_name}.{i}") for i in range(n)]
            + [self.prefix(e) for e in self.epilogue] + [self.head_name]
        )

    def layers(self) -> list[nn.Module]:
        return [self.model.get_submodule(n) for n in self.layer_names()]


def pipeline_structure(model: nn.Module) -> list[str]:
    """The pipeline layers `CausalLM` makes of a ``transformers`` causal LM: their module names, in order."""
    return _Structure(model).layer_names()


def _embedding_dim(module: nn.Module) -> int:
    """The output size of an embedding (``nn.Embedding`` or a module with ``embedding_dim``); 0 otherwise."""
    return int(getattr(module, "embedding_dim", 0) or 0)


def tensors_of(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of every parameter and buffer of ``module``, shared ones under each name."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def cpu_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are new, uninitialised CPU tensors (nothing of the
    original's values is copied)."""
    memo: dict[int, Any] = {}
    for _, t in tensors_of(module):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="cpu")
            memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)
