"""Autograd-aware collectives over one tensor-parallel process group (Megatron's f/g operators).

Each function is the whole of the communication of a TP layer; their forward/backward pairs are
conjugate so that the gradient of a TP layer equals the gradient of the unsplit layer.
Tensors split "by parts" are fused projections (for example ``[q; k; v]``): each part is split
separately, so a rank holds ``[q_r; k_r; v_r]``, and gathering restores ``[q; k; v]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def split_parts(t: Tensor, dim: int, part_sizes: Sequence[int], rank: int, world: int) -> Tensor:
    """This rank's slice of ``t`` along ``dim``; each part (full sizes ``part_sizes``) is split on its own."""
    chunks = [part.chunk(world, dim=dim)[rank] for part in t.split(list(part_sizes), dim=dim)]
    return torch.cat(chunks, dim=dim) if len(chunks) > 1 else chunks[0].contiguous()


def gather_parts(t: Tensor, dim: int, part_sizes: Sequence[int], group: dist.ProcessGroup) -> Tensor:
    """Inverse of `split_parts` over ``group``: all-gather the local slices and re-assemble each part."""
    world = dist.get_world_size(group)
    if world == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(shards, t.contiguous(), group=group)
    local_sizes = [size // world for size in part_sizes]
    per_rank_parts = [shard.split(local_sizes, dim=dim) for shard in shards]
    return torch.cat([torch.cat([parts[i] for parts in per_rank_parts], dim=dim) for i in range(len(part_sizes))], dim=dim)


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dimension (by parts). Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, part_sizes: tuple[int, ...]) -> Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.world = group, world
        ctx.full_parts = tuple(size * world for size in part_sizes)
        return gather_parts(x, -1, ctx.full_parts, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank = dist.get_rank(ctx.group)
        return split_parts(grad, -1, ctx.full_parts, rank, ctx.world), None, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return split_parts(x, -1, [x.size(-1)], dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return gather_parts(grad, -1, [grad.size(-1) * dist.get_world_size(ctx.group)], ctx.group), None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup, local_part_sizes: Sequence[int]) -> Tensor:
    return _GatherFromTP.apply(x, group, tuple(local_part_sizes))


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ScatterToTP.apply(x, group)
