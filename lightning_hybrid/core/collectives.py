"""How a tensor is split over one tensor-parallel group, and the autograd-aware collectives over it
(Megatron's f/g operators, and sequence parallelism's).

`ShardSpec` describes a split: along one dimension, fused part by fused part. A plain split has one part;
a fused projection (``[q; k; v]``, ``[gate; up]``) has several, each split on its own so that a rank holds
``[q_r; k_r; v_r]``. `ShardSpec.chunks` says which contiguous pieces of the unsplit tensor a rank holds, which
is all that splitting, gathering and checkpoints need.

Every collective is issued in one function: `all_reduce`, `all_gather` (`start_all_gather`), `reduce_scatter`
(and the all-to-all it runs on gloo). Each picks its form there and nowhere else: a functional collective
(``torch.ops._c10d_functional``: out of place, one op with its own output) under ``torch.compile``, which traces
it into its graph, and inside a selective activation checkpoint (`functional_collectives`), which keeps its result
so that the recomputation does not communicate; else torch.distributed's in-place collective. Eager runs, selective
recompute and compiled layers therefore run the same code below, whatever the form; so does the row layer's custom
op (`layers.row_parallel_linear`), which selective recompute and compile use in place of its op-by-op form.

The four TP autograd functions are the whole of the communication of a TP layer; each forward/backward pair
is conjugate, so the gradient of a TP layer equals the gradient of the unsplit layer. Sequence parallelism
adds four more along the sequence dimension (dim 1 of batch-first ``[B, T, H]`` activations; Megatron's
SP operators; `sequence_parallel` places them): all-gather at a TP unit's entry (backward reduce-scatter),
reduce-scatter at a row layer's exit (backward all-gather), and at the ends of a run of sequence-split blocks a
split (backward all-gather) and an all-gather (backward split). All of them run on the TP group they are given.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

# Inside a selective activation checkpoint the forward collectives are functional, so the checkpoint keeps their
# results and its recomputation does not communicate. A context variable, set around the checkpointed function
# only, like torch's own grad and dispatch modes.
_FUNCTIONAL = contextvars.ContextVar("lightning_hybrid_functional_collectives", default=False)
_C10D = torch.ops._c10d_functional
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _functional() -> bool:
    """Whether collectives run as functional collectives: inside `functional_collectives`, and under
    ``torch.compile``, which traces them into its graph (torch.distributed's in-place collectives, and the look-up
    of the context variable, would break the graph there)."""
    return torch.compiler.is_compiling() or _FUNCTIONAL.get()


def functional_collectives_active() -> bool:
    """Whether the collectives are functional: inside a selective checkpoint (`functional_collectives`) or under
    ``torch.compile``."""
    return _functional()


@contextlib.contextmanager
def functional_collectives() -> Iterator[None]:
    """Run the collectives of TP and SP layers as functional collectives (see `_FUNCTIONAL`)."""
    token = _FUNCTIONAL.set(True)
    try:
        yield
    finally:
        _FUNCTIONAL.reset(token)


# ------------------------------------------------------------------------- the collectives, each issued here only
def all_reduce(x: Tensor, group: dist.ProcessGroup, op: str = "sum") -> Tensor:
    """``x`` (contiguous) reduced over ``group`` (``op``: ``"sum"``, ``"max"`` or ``"min"``): a new tensor when
    functional, else ``x`` itself, reduced in place."""
    if _functional():
        return _C10D.wait_tensor(_C10D.all_reduce(x, op, group.group_name))
    dist.all_reduce(x, op=_REDUCE_OPS[op], group=group)
    return x


def start_all_reduce(x: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """A sum of ``x`` (contiguous) over ``group`` started now, in place (never functional: for the eager backward of
    `lightning_hybrid.parallel.tensor_parallel.layers`' column layers); the function returned waits for it and gives
    ``x``, reduced."""
    work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish() -> Tensor:
        work.wait()
        return x

    return finish


def start_all_gather(x: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """An all-gather of ``x`` (contiguous) started now; the function returned waits for it and gives the ranks'
    tensors concatenated along dim 0 in rank order, ``[world * x.size(0), ...]``."""
    world = dist.get_world_size(group)
    if _functional():
        started = _C10D.all_gather_into_tensor(x, world, group.group_name)
        return lambda: _C10D.wait_tensor(started)
    out = x.new_empty((world * x.size(0), *x.shape[1:]))
    work = dist.all_gather_single(out, x, group=group, async_op=True)

    def finish() -> Tensor:
        work.wait()
        return out

    return finish


def all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The ranks' ``x`` (contiguous) concatenated along dim 0 in rank order: ``[world * x.size(0), ...]``."""
    return start_all_gather(x, group)()


def _all_to_all(parts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``parts`` ``[world, ...]`` (contiguous): index ``r`` goes to rank ``r``; returns ``[world, ...]`` holding at
    index ``r`` what rank ``r`` sent here."""
    world = parts.size(0)
    if _functional():
        return _C10D.wait_tensor(_C10D.all_to_all_single(parts, [1] * world, [1] * world, group.group_name))
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    return out


def reduce_scatter(parts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``parts`` ``[world, ...]`` (contiguous; index ``r`` is this rank's contribution to rank ``r``) -> the sum
    over the ranks of their contributions to this rank, ``[...]``."""
    if _functional():
        if dist.get_backend(group) == dist.Backend.GLOO:
            return _all_to_all(parts, group).sum(0)
        scattered = _C10D.reduce_scatter_tensor(parts.flatten(0, 1), "sum", parts.size(0), group.group_name)
        return _C10D.wait_tensor(scattered)
    return start_reduce_scatter(parts, group)()


def start_reduce_scatter(parts: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """`reduce_scatter` started now (never functional: for eager backward code that computes while it runs); the
    function returned waits for it and gives its result."""
    if dist.get_backend(group) == dist.Backend.GLOO:
        # Gloo reduce-scatters by all-reducing (2 (n-1)/n of the bytes, and its time); an all-to-all of the parts
        # and a local sum move (n-1)/n, like NCCL's reduce-scatter.
        received = torch.empty_like(parts)
        work = dist.all_to_all_single(received, parts, group=group, async_op=True)
        return lambda: (work.wait(), received.sum(0))[1]
    out = parts.new_empty(parts.shape[1:])
    work = dist.reduce_scatter_single(out, parts.flatten(0, 1), group=group, async_op=True)
    return lambda: (work.wait(), out)[1]


# ---------------------------------------------------------------------------------------------- split tensors
@dataclass(frozen=True)
class ShardSpec:
    """A tensor split along ``dim`` over the TP group; ``part_sizes``: full sizes of its fused parts along ``dim``."""

    dim: int
    part_sizes: tuple[int, ...]

    def chunks(self, rank: int, world: int) -> list[tuple[int, int, int]]:
        """``(local_offset, full_offset, length)`` along ``dim`` of the pieces of the unsplit tensor that
        ``rank`` holds, in local order: part ``i`` (full size ``P_i`` at offset ``sum(P_<i)``) contributes its
        ``rank``-th ``1/world`` slice."""
        out, local, full = [], 0, 0
        for size in self.part_sizes:
            length = size // world
            out.append((local, full + rank * length, length))
            local, full = local + length, full + size
        return out


def split_shard(t: Tensor, spec: ShardSpec, rank: int, world: int) -> Tensor:
    """This rank's piece of the unsplit ``t`` (a new contiguous tensor)."""
    pieces = [t.narrow(spec.dim, full, length) for _, full, length in spec.chunks(rank, world)]
    return torch.cat(pieces, dim=spec.dim) if len(pieces) > 1 else pieces[0].contiguous()


def gather_shard(t: Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> Tensor:
    """Inverse of `split_shard` over ``group``: all-gather the local pieces and re-assemble the unsplit tensor."""
    world = dist.get_world_size(group)
    if world == 1:
        return t
    shards = all_gather(t.contiguous(), group).chunk(world)
    per_rank = [spec.chunks(r, world) for r in range(world)]
    pieces = []
    for index in range(len(spec.part_sizes)):
        pieces += [shards[r].narrow(spec.dim, per_rank[r][index][0], per_rank[r][index][2]) for r in range(world)]
    return torch.cat(pieces, dim=spec.dim)


# ------------------------------------------------------------------------------ TP operators (Megatron's f, g)
class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        contiguous = x.contiguous()
        out = all_reduce(contiguous, group)
        if out is not contiguous:
            # Functional: the clone is the tensor model code may change in place (recomputed; the reduction is kept).
            return out.clone()
        if contiguous is x:
            # Reduced in place: declaring it keeps the result an ordinary tensor that model code may modify in
            # place (Falcon adds the residual with `+=`), rather than a view of this function's input.
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dimension (by parts). Backward: keep this rank's piece of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, spec: ShardSpec) -> Tensor:
        ctx.group, ctx.spec = group, spec
        return gather_shard(x, spec, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return split_shard(grad, ctx.spec, rank, world), None, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.spec = group, ShardSpec(-1, (x.size(-1),))
        return split_shard(x, ctx.spec, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return gather_shard(grad, ctx.spec, ctx.group), None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup, spec: ShardSpec) -> Tensor:
    """``spec``: how the last dimension of the full output is split (``spec.dim == -1``)."""
    return _GatherFromTP.apply(x, group, spec)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ScatterToTP.apply(x, group)


# ----------------------------------------------------------------------------------- SP operators (sequence)
SEQ_DIM = 1  # batch-first activations [B, T, H]


def _check_seq(x: Tensor, world: int) -> None:
    if x.dim() <= SEQ_DIM or x.size(SEQ_DIM) % world != 0:
        raise ValueError(
            f"sequence_parallel needs activations [batch, sequence, ...] whose sequence length divides by tp={world};"
            f" got a tensor of shape {list(x.shape)}. Use a sequence length that is a multiple of tp, or"
            " sequence_parallel=False."
        )


def _rank_major(x: Tensor, world: int) -> Tensor:
    """``[B, T, ...]`` -> ``[world, B, T/world, ...]``, contiguous (one copy): rank ``r``'s part of the
    sequence, of every sequence of the batch, at index ``r``."""
    return x.reshape(x.size(0), world, x.size(1) // world, *x.shape[2:]).transpose(0, 1).contiguous()


def _sequence_major(gathered: Tensor, world: int) -> Tensor:
    """``[world * B, T/world, ...]`` (the rank parts, rank after rank) -> ``[B, T, ...]``, contiguous."""
    parts = gathered.view(world, -1, *gathered.shape[1:])
    return parts.transpose(0, 1).reshape(parts.size(1), world * parts.size(2), *parts.shape[3:])


def start_seq_all_gather(x: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """`seq_all_gather` started now; the function returned waits for it and gives its result."""
    world = dist.get_world_size(group)
    finish = start_all_gather(x.contiguous(), group)
    return lambda: _sequence_major(finish(), world)


def seq_all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, T/tp, ...]`` shards -> ``[B, T, ...]``, rank order along the sequence."""
    return start_seq_all_gather(x, group)()


def seq_reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, T, ...]`` partial sums -> this rank's ``[B, T/tp, ...]`` of their sum over ``group`` (contiguous:
    pipeline stages send it as it is)."""
    world = dist.get_world_size(group)
    _check_seq(x, world)
    return reduce_scatter(_rank_major(x, world), group)


def start_seq_reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """`seq_reduce_scatter` started now (eager); the function returned waits for it and gives its result."""
    world = dist.get_world_size(group)
    _check_seq(x, world)
    return start_reduce_scatter(_rank_major(x, world), group)


def seq_split(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This rank's ``[B, T/tp, ...]`` of ``[B, T, ...]`` (a copy)."""
    world = dist.get_world_size(group)
    _check_seq(x, world)
    return x.chunk(world, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()


class _GatherSequenceForTP(torch.autograd.Function):
    """Forward: all-gather the sequence (a TP unit's input). Backward: reduce-scatter (each rank's gradient of
    the whole input is its own heads' part)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return seq_all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return seq_reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter over the sequence (a row layer's partial sums). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return seq_reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return seq_all_gather(grad, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    """Forward: keep this rank's part of the sequence (entering sequence-split blocks). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return seq_split(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return seq_all_gather(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence (leaving sequence-split blocks). Backward: keep this rank's part (the
    gradient of the whole is the same on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return seq_all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return seq_split(grad, ctx.group), None


def gather_sequence_for_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _GatherSequenceForTP.apply(x, group)


def reduce_scatter_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ReduceScatterSequence.apply(x, group)


def split_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _SplitSequence.apply(x, group)


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _GatherSequence.apply(x, group)


# ------------------------------------------------------------------------------------------ gradient summation
@torch.no_grad()
def sum_grads_over_tp_(grads: list[Tensor], group: dist.ProcessGroup) -> None:
    """In place, one all-reduce (sum) over ``group`` of these gradients (or local tensors of DTensors, or slices
    of ZeRO buckets): the strategy's summation of per-rank parts, once per optimizer step."""
    if not grads:
        return
    flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
