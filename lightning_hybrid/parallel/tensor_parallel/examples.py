"""Example inputs for setup-time verification: how to run a model once before it is split.

In order: the LightningModule's own ``example_input_array`` (Lightning's attribute for exactly this); random
token ids for a transformers model inside it, or for a module whose first pipeline layer is a token embedding
(run through its `pipeline_layers`); for a block the example did not reach, a random ``[2, 11, in_features]``
input when it takes a single tensor. All
drawn from fixed-seed generators, so every rank of a TP group builds the same input and the global random
state is untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_hybrid.core.protocol import PipelineLayers
from lightning_hybrid.parallel.tensor_parallel.layers import linear_shape
from lightning_hybrid.parallel.tensor_parallel.model_plans import _is_transformers_model
from lightning_hybrid.parallel.tensor_parallel.verify import Captured

BATCH, LENGTH = 2, 11  # 11: unlikely to equal a head count, so per-head inputs are found unambiguously


def _generator() -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(20_240_917)


def _to(value, device: torch.device):
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _example_length(module: nn.Module, multiple: int = 1) -> int:
    """``LENGTH`` tokens, or ``LENGTH * multiple`` (sequence parallelism splits the sequence over ``multiple``
    ranks), within the model's maximum length (then the largest multiple of ``multiple`` that fits)."""
    config = getattr(module, "config", None)
    limits = [getattr(config, a, None) for a in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len")]
    limit = min([LENGTH * multiple] + [v for v in limits if isinstance(v, int) and v > 0])
    return max(limit // multiple, 1) * multiple


def random_ids(vocab: int, length: int = LENGTH) -> Tensor:
    generator = _generator()
    return torch.randint(0, vocab, (BATCH, length), generator=generator, device=generator.device)


def model_example(module: nn.Module, device: torch.device, multiple: int = 1) -> Callable[[], object] | None:
    """A function running ``module`` (a LightningModule, unsplit) once on an example input, or ``None``; random
    token ids are a multiple of ``multiple`` long."""
    example = getattr(module, "example_input_array", None)
    if example is not None:
        example = _to(example, device)
        if isinstance(example, dict):
            return lambda: module(**example)
        return lambda: module(*example) if isinstance(example, (list, tuple)) else module(example)
    inner = next((m for m in module.modules() if _is_transformers_model(m)), None)
    if inner is not None and callable(getattr(inner, "get_input_embeddings", None)):
        ids = random_ids(inner.get_input_embeddings().num_embeddings, _example_length(inner, multiple)).to(device)
        return lambda: inner(input_ids=ids)
    layers = module.pipeline_layers() if isinstance(module, PipelineLayers) else None
    first = first_layer_example(module, layers[0], device, multiple) if layers else None
    if first is None:
        return None

    def through_layers():  # the pipeline protocol: forward(x) applies the layers in sequence
        x = first
        for layer in layers:
            x = layer(x)
        return x

    return through_layers


def first_layer_example(module: nn.Module, first_layer: nn.Module, device: torch.device,
                        multiple: int = 1) -> Tensor | None:
    """The input of pipeline layer 0: ``example_input_array`` (a tensor), or token ids when that layer is (or
    starts with) an ``nn.Embedding``."""
    example = getattr(module, "example_input_array", None)
    if isinstance(example, Tensor):
        return example.to(device)
    embedding = next((m for m in first_layer.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        return random_ids(embedding.num_embeddings, _example_length(module, multiple)).to(device)
    return None


def synthetic_call(block: nn.Module, multiple: int = 1) -> Captured | None:
    """A call of a block the example did not reach: random hidden states ``[2, 11 * multiple, d]`` (``d``: the
    input size of its first linear-like module), or token ids for an embedding."""
    if isinstance(block, nn.Embedding):
        return Captured.of((random_ids(block.num_embeddings),), {})
    first = next((linear_shape(m) for m in block.modules() if linear_shape(m) is not None), None)
    if first is None:
        return None
    generator = _generator()
    hidden = torch.randn(BATCH, LENGTH * multiple, first.in_features, generator=generator, device=generator.device)
    return Captured.of((hidden,), {})
