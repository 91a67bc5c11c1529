"""Tensor-parallel layers that hold plain local shards (Megatron / picotron style).

Each layer is built from the unsplit module it replaces (`from_module`) and copies this rank's slice of its
weights, so a TP model starts from exactly the one-device initialisation. ``shard_specs`` names, for each
parameter, the dimension it is split on and its fused parts, which is all `gather_full_state_dict` needs to
re-assemble the unsplit tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.tensor_parallel.comm import (
    copy_to_tp,
    gather_from_tp,
    gather_parts,
    reduce_from_tp,
    scatter_to_tp,
    split_parts,
)


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split along ``dim`` over the TP group; ``part_sizes`` are the full sizes of fused parts."""

    dim: int
    part_sizes: tuple[int, ...]


def _shard(t: Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> nn.Parameter:
    local = split_parts(t.detach(), spec.dim, spec.part_sizes, dist.get_rank(group), dist.get_world_size(group))
    return nn.Parameter(local.clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by output features: weight ``[out/tp, in]``, bias ``[out/tp]``.

    Input ``[..., in]`` (replicated over TP); output ``[..., out/tp]`` or, with ``gather_output``, the full
    ``[..., out]`` (all-gather over the TP group). Fused outputs (``part_sizes``, e.g. q/k/v) are split per part.
    """

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, gather_output: bool, part_sizes: tuple[int, ...]):
        super().__init__()
        self.group = group
        self.tp_size = dist.get_world_size(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gather_output = gather_output
        self.part_sizes = part_sizes
        self.shard_specs = {"weight": ShardSpec(0, part_sizes)}
        self.weight = _shard(linear.weight, self.shard_specs["weight"], group)
        if linear.bias is not None:
            self.shard_specs["bias"] = ShardSpec(0, part_sizes)
            self.bias = _shard(linear.bias, self.shard_specs["bias"], group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.group, [size // self.tp_size for size in self.part_sizes])
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.size(0)}),"
            f" parts={list(self.part_sizes)}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by input features: weight ``[out, in/tp]``, bias ``[out]`` replicated.

    Input ``[..., in/tp]`` (``input_is_parallel``) or ``[..., in]`` (this rank's slice is taken); the partial
    products are all-reduced (sum) over the TP group before the bias is added; output ``[..., out]``.
    """

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, input_is_parallel: bool):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.input_is_parallel = input_is_parallel
        self.shard_specs = {"weight": ShardSpec(1, (linear.in_features,))}
        self.weight = _shard(linear.weight, self.shard_specs["weight"], group)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.size(1)}), out_features={self.out_features},"
            f" input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding with its rows (the vocabulary) split: weight ``[vocab/tp, dim]``.

    Input ids ``[...]`` (replicated over TP); each rank looks up the ids in its vocabulary range, zeros the
    others, and the partial embeddings are all-reduced (sum) over the TP group: output ``[..., dim]``.
    """

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.shard_specs = {"weight": ShardSpec(0, (embedding.num_embeddings,))}
        self.weight = _shard(embedding.weight, self.shard_specs["weight"], group)
        local = self.num_embeddings // dist.get_world_size(group)
        self.vocab_start = dist.get_rank(group) * local
        self.vocab_end = self.vocab_start + local
        pad = embedding.padding_idx
        self.local_padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local vocab [{self.vocab_start}, {self.vocab_end})"


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def tp_sharded_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of the parameters that hold a TP shard (the rest are replicated over TP)."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name in getattr(module, "shard_specs", {}):
            names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def tp_shard_specs(model: nn.Module) -> dict[str, tuple[ShardSpec, dist.ProcessGroup]]:
    """Qualified parameter name -> (how it is split, its TP group), for every TP-sharded parameter."""
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = (spec, module.group)
    return specs


def unsplit_shape(name: str, tensor: Tensor, specs: dict) -> list[int]:
    """The unsplit shape of the TP-local ``tensor`` (a ZeRO-3 DTensor's shape is already its TP-local one)."""
    shape = list(tensor.shape)
    if name in specs:
        spec, group = specs[name]
        shape[spec.dim] *= dist.get_world_size(group)
    return shape


def unsplit(name: str, tensor: Tensor, specs: dict) -> Tensor:
    """A TP-local tensor (a DTensor made full first) -> the unsplit tensor. Collective over the TP group
    (and the DTensor's mesh)."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if name in specs:
        spec, group = specs[name]
        tensor = gather_parts(tensor, spec.dim, spec.part_sizes, group)
    return tensor


def local_piece(name: str, full: Tensor, target: Tensor, specs: dict) -> Tensor:
    """The piece of the unsplit ``full`` that ``target`` holds: its TP slice and, for a ZeRO-3 DTensor, its
    rows of that slice (FSDP2 chunks dim 0 over the DP mesh as ``torch.chunk`` does)."""
    if name in specs:
        spec, group = specs[name]
        full = split_parts(full, spec.dim, spec.part_sizes, dist.get_rank(group), dist.get_world_size(group))
    if hasattr(target, "_local_tensor"):
        mesh = target.device_mesh
        full = full.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
    return full


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the unsplit model: TP shards all-gathered over their group, DTensors made full.

    Collective over the TP group (and over the DTensors' meshes): every rank of them must call it.
    """
    specs = tp_shard_specs(model)
    return {name: unsplit(name, tensor, specs).clone() for name, tensor in model.state_dict(keep_vars=True).items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, Tensor], strict: bool = True) -> None:
    """Load an unsplit state dict into a (possibly) TP-split, ZeRO-3-sharded ``model``: each rank copies its piece.

    Raises ``KeyError`` naming missing/unexpected keys (with ``strict``) and ``ValueError`` naming a key whose
    shape differs from the model's unsplit shape.
    """
    specs = tp_shard_specs(model)
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"The state dict does not fit the model: missing keys {missing}, unexpected keys {unexpected}.")
    for name, target in own.items():
        if name not in state_dict:
            continue
        source, expected = state_dict[name], unsplit_shape(name, target, specs)
        if list(source.shape) != expected:
            raise ValueError(f"State dict entry {name!r} has shape {list(source.shape)}, the model expects {expected}.")
        local = target._local_tensor if hasattr(target, "_local_tensor") else target
        local.copy_(local_piece(name, source, target, specs).to(device=local.device, dtype=local.dtype))
