"""A TP unit's backward: the reduction of its input's gradient under its column layers' weight-gradient GEMMs.

A paired unit (an attention or MLP module) reduces its input's gradient over TP in backward: an all-reduce, or under
sequence parallelism, where it all-gathered its input along the sequence at entry, a reduce-scatter. That gradient is
the sum of what every consumer of the input gives back (q, k and v, or gate and up): complete only once the last
column layer's backward has run, and each of those has already computed its weight's gradient by then, so an
ordinary backward has nothing left to compute while the reduction runs. Megatron-Core defers the weight gradients; so
does this module:

* the unit's entry is one autograd node that takes the unit's column weights (and biases) as inputs, through views
  (`_weight_edges`): `_UnitGather` under SP (forward: the all-gather), `_UnitEntry` without (forward: a view);
* a column layer fed the unit's input computes its input gradient only (`deferred_column`) and leaves its output
  gradient with the unit (`UnitGrads.stash`); without SP also its input gradient, which is a per-rank part to be
  summed over TP (`UnitGrads.add_input_grad`), where the input's other consumers give replicated gradients;
* the entry's backward, which autograd runs after every consumer of the input, starts the reduction (the
  reduce-scatter of the input's gradient; without SP the all-reduce of the column layers' summed input gradients),
  computes each column weight's and bias's gradient from those output gradients and the input, then waits (and
  adds the other consumers' gradient). Under SP the input is the shard all-gathered again (`Regather`: the unit keeps
  its input's sequence shard, not the gathered sequence, as Megatron does), or inside a checkpoint what the
  checkpoint keeps.

The products, operand layouts and sums are those of ``F.linear``'s own backward: under SP bit for bit the ordinary
gradients; without it the sum over TP is taken once a unit, not once a layer (equal within rounding;
`tests/tensor_parallel/test_tensor_parallel_apply.py`). Where a backward call wants the input's gradient but not the
weights' (`torch.distributed.pipelining`'s zero-bubble schedule splits the two passes) the weights' wait, with their
output gradients, for the call that wants them; the engine says which it is (`_wanted`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.core.autocast import autocast_inputs
from lightning_hybrid.core.collectives import (
    seq_all_gather,
    seq_reduce_scatter,
    start_all_gather,
    start_all_reduce,
    start_seq_all_gather,
    start_seq_reduce_scatter,
)


class Regather:
    """A unit input's sequence shard, all-gathered again in backward, for the saved tensors its layers keep (as
    saved-tensor hooks: `pack`, `unpack`; one gather serves every view unpacked in a row, as q, k and v keep the
    same input) and for the deferred weight gradients (`take`). `prefetch` starts the all-gather early (a gradient
    hook at the unit's output calls it: under the backward of its row layer and attention)."""

    def __init__(self, shard: Tensor, full: Tensor, group: dist.ProcessGroup, takers: int = 0):
        self.storage = full.untyped_storage()._cdata
        self.shard, self.group = shard.detach(), group
        self.unpacks, self.takers = 0, takers  # the uses still to come
        self.started = self.full = None

    def pack(self, t: Tensor):
        if t.untyped_storage()._cdata != self.storage:
            return t
        self.unpacks += 1
        return ("regather", t.size(), t.stride(), t.storage_offset())

    def prefetch(self) -> None:
        if (self.unpacks or self.takers > 0) and self.full is None and self.started is None:
            self.started = start_seq_all_gather(self.shard, self.group)

    def _gathered(self) -> Tensor:
        if self.full is None:
            started, self.started = self.started, None
            self.full = started() if started is not None else seq_all_gather(self.shard, self.group)
        return self.full

    def _release(self) -> None:
        if self.unpacks <= 0 and self.takers <= 0:
            self.full = None

    def unpack(self, packed):
        if not isinstance(packed, tuple) or not packed or packed[0] != "regather":
            return packed
        regathered = self._gathered()
        self.unpacks -= 1
        self._release()
        _, size, stride, offset = packed
        return regathered.as_strided(size, stride, offset)

    def take(self) -> Tensor:
        """The gathered input, for the weight gradients (one of the ``takers`` announced)."""
        full = self._gathered()
        self.takers -= 1
        self._release()
        return full


class UnitGrads:
    """What a unit's column layers leave for its entry's backward: per layer, the output gradients of its calls on
    the unit's input (`stash`) and the dtype its GEMM saw the input in; without sequence parallelism also the sum of
    their input gradients (`add_input_grad`), which the entry all-reduces."""

    def __init__(self, columns: list, group: dist.ProcessGroup, sequence_parallel: bool = True,
                 keeps_input: bool = False):
        self.columns, self.group, self.sequence_parallel = columns, group, sequence_parallel
        self.full = None  # a weak reference to the unit's input (gathered under SP): the layers fed it defer
        self.regather: Optional[Regather] = None  # under SP outside checkpoints: the input gathered again
        self.keeps_input = keeps_input  # under SP inside a checkpoint: the entry keeps the gathered input
        self.grads: list[list[Tensor]] = [[] for _ in columns]
        self.tasks: list = [None] * len(columns)  # the backward call each layer's gradients came from
        self.dtypes: list = [None] * len(columns)
        self.input_grad: Optional[Tensor] = None
        self.input_task = None
        self.zero: Optional[Tensor] = None

    def add_input_grad(self, grad: Tensor) -> None:
        """A column layer's input gradient (no sequence parallelism): summed here, in the running backward call."""
        task = torch._C._current_graph_task_id()
        if self.input_task != task or self.input_grad is None:
            self.input_grad, self.input_task = grad, task
        else:
            self.input_grad = self.input_grad + grad

    def nothing(self, like: Tensor) -> Tensor:
        """A zero gradient for the unit's input (a broadcast scalar, no memory), what the column layers give autograd
        in place of the input gradients they leave here: the entry then receives a gradient however the backward is
        split (torch's zero-bubble schedule keeps what reaches a node, and skips a node that received nothing)."""
        if self.zero is None or self.zero.shape != like.shape or self.zero.dtype != like.dtype:
            self.zero = like.new_zeros(()).expand(like.shape)
        return self.zero

    def take_input_grad(self) -> Optional[Tensor]:
        grad, self.input_grad = (self.input_grad, None) if self.input_task == torch._C._current_graph_task_id() \
            else (None, None)
        return grad

    def feeds(self, x: Tensor) -> bool:
        """Whether ``x`` is the unit's input (the entry gives this state to the unit's own column layers only)."""
        return self.full is not None and self.full() is x

    def stash(self, slot: int, grad2d: Tensor) -> None:
        """A call's output gradient, from the running backward call: those of an earlier call (a graph kept and
        run again) are dropped."""
        task = torch._C._current_graph_task_id()
        if self.tasks[slot] != task:
            self.grads[slot], self.tasks[slot] = [], task
        self.grads[slot].append(grad2d)

    def clear(self) -> None:
        self.grads = [[] for _ in self.columns]

    def weight_grads(self, wanted: list[bool], full: Optional[Tensor] = None) -> list[Optional[Tensor]]:
        """Per column layer, the weight's and the bias's gradients (``None`` where not ``wanted`` or not used), from
        the unit's input ``full`` (under SP: all-gathered again)."""
        out: list[Optional[Tensor]] = []
        if full is None and any(self.grads):
            full = self.regather.take()
        inputs: dict = {}
        for slot, layer in enumerate(self.columns):
            grads, (want_w, want_b) = self.grads[slot], wanted[2 * slot: 2 * slot + 2]
            grad_w = grad_b = None
            if grads and want_w:
                dtype = self.dtypes[slot]
                if dtype not in inputs:
                    inputs[dtype] = full.to(dtype).reshape(-1, full.size(-1))
                x2d, weight = inputs[dtype], layer.weight.t() if layer.transposed else layer.weight  # as multiplied
                for g in grads:
                    grad_w = _add(grad_w, linear_weight_grad(g, x2d, weight))
                grad_w = (grad_w.t() if layer.transposed else grad_w).to(layer.weight.dtype)
            if grads and want_b and layer.bias is not None:
                for g in grads:
                    grad_b = _add(grad_b, g.sum(0))
                grad_b = grad_b.to(layer.bias.dtype)
            out += [grad_w, grad_b]
        return out


def _add(total: Optional[Tensor], t: Tensor) -> Tensor:
    return t if total is None else total + t


def _weight_edges(columns: list) -> list[Optional[Tensor]]:
    """The column layers' weights and biases, each as a view (``None`` where frozen or absent): a view's backward
    node is one the engine can be asked about inside ``autograd.grad`` (a leaf's is not), which is how `_wanted`
    tells whether a call wants the weights' gradients."""
    edges = []
    for layer in columns:
        for p in (layer.weight, layer.bias):
            edges.append(p.view_as(p) if p is not None and p.requires_grad else None)
    return edges


def linear_weight_grad(grad2d: Tensor, x2d: Tensor, weight: Tensor) -> Tensor:
    """The gradient of ``weight`` in ``F.linear(x, weight)`` as torch's own backward computes it: ``F.linear``
    multiplies by ``weight.t()``, whose gradient comes in that operand's layout (column-major when ``weight`` is
    row-major, an nn.Linear's; row-major for a Conv1D's transposed view)."""
    if weight.stride(-1) == 1 and weight.stride(0) == weight.size(-1):
        return grad2d.t().mm(x2d)
    return x2d.t().mm(grad2d).t()


class _SequenceRow(torch.autograd.Function):
    """A row layer under sequence parallelism, eager: ``x W^T`` reduce-scattered along the sequence. Backward: the
    all-gather of the output's gradient started, this rank's part of the input's gradient computed from its own part
    while the others arrive, then theirs and the weight's gradient -- each the product ``F.linear``'s backward
    computes (on rows of it, for the input's): bit for bit the ordinary backward's. A backward call that wants only
    one of the two (the zero-bubble schedule's passes) computes that one."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, group: dist.ProcessGroup) -> Tensor:
        partial = F.linear(x, weight)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dtype = group, partial.dtype
        return seq_reduce_scatter(partial, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        (x_node, _), (w_node, _) = ctx.next_functions
        want_x = ctx.needs_input_grad[0] and _wanted(x_node) is not False
        want_w = ctx.needs_input_grad[1] and _wanted(w_node) is not False
        # Under autocast an fp32 bias added after the reduction makes the output fp32: the product's gradient in the
        # product's dtype, as the op-by-op form's addition hands it back.
        grad = grad.to(ctx.dtype).contiguous()
        finish = start_all_gather(grad, group)  # [world * B, T/tp, out]: the ranks' parts, rank after rank
        local = grad.matmul(weight) if want_x else None
        parts = finish().view(world, *grad.shape)
        grad_x = grad_w = None
        if want_x:
            pieces = [local if j == rank else parts[j].matmul(weight) for j in range(world)]
            grad_x = torch.stack(pieces, 1).flatten(1, 2)  # [B, world, T/tp, in] -> [B, T, in]
        if want_w:
            whole = parts.transpose(0, 1).reshape(-1, grad.size(-1))  # the sequence in order, [B T, out]
            grad_w = linear_weight_grad(whole, x.reshape(-1, x.size(-1)), weight)
        return grad_x, grad_w, None


def sequence_row(x: Tensor, weight: Tensor, group: dist.ProcessGroup) -> Tensor:
    """A sequence-parallel row layer's ``reduce_scatter(x W^T)`` (``x``, ``weight`` cast as autocast casts them),
    its backward's all-gather under this rank's part of the input gradient (`_SequenceRow`). The weight enters as a
    view, so that the engine can say whether a backward call wants its gradient."""
    return _SequenceRow.apply(x, weight.view_as(weight), group)


def _wanted(node) -> Optional[bool]:
    """Whether the running backward call executes ``node`` (``None``: the engine cannot say -- a leaf inside
    ``autograd.grad``)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return None


class _UnitGather(torch.autograd.Function):
    """Forward: the sequence all-gathered (the unit's input). Backward: the reduce-scatter of its gradient started,
    the deferred weight gradients computed, the reduce-scatter waited for (module docstring)."""

    @staticmethod
    def forward(ctx, shard: Tensor, state: UnitGrads, *weights: Optional[Tensor]) -> Tensor:
        ctx.state = state
        ctx.tensors = [isinstance(t, Tensor) for t in (shard, state, *weights)]  # the inputs with an edge
        full = seq_all_gather(shard, state.group)
        if state.keeps_input:
            ctx.save_for_backward(full)
        state.full = weakref.ref(full)
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        state = ctx.state
        nodes, want_input = _nodes(ctx)
        finish = start_seq_reduce_scatter(grad, state.group) if want_input else None
        grads = _weight_grads(ctx, state, nodes, ctx.saved_tensors[0] if state.keeps_input else None)
        return (finish() if finish is not None else None), None, *grads


def _nodes(ctx) -> tuple[list, bool]:
    """A unit entry's input nodes (one per input; ``None`` for a non-tensor) and whether the running backward call
    wants the input's gradient."""
    edges = iter(ctx.next_functions)  # one per tensor input
    nodes = [next(edges)[0] if tensor else None for tensor in ctx.tensors]
    return nodes, ctx.needs_input_grad[0] and _wanted(nodes[0]) is not False


def _weight_grads(ctx, state: UnitGrads, nodes: list, full: Optional[Tensor] = None) -> list[Optional[Tensor]]:
    """The column weights' gradients the running backward call wants; where it wants none (the inputs' pass of a
    zero-bubble schedule) their output gradients wait for the call that does."""
    wanted = [needs and _wanted(node) is not False for needs, node in zip(ctx.needs_input_grad[2:], nodes[2:])]
    if not any(wanted):
        return [None] * len(wanted)
    grads = state.weight_grads(wanted, full)
    state.clear()
    return grads


class _UnitEntry(torch.autograd.Function):
    """Without sequence parallelism. Forward: the unit's input as it is (a view). Backward: the all-reduce of its
    column layers' input gradients started, the deferred weight gradients computed, the all-reduce waited for and
    the gradient of the input's other consumers (replicated over TP: not reduced) added."""

    @staticmethod
    def forward(ctx, x: Tensor, state: UnitGrads, *weights: Optional[Tensor]) -> Tensor:
        ctx.state = state
        ctx.set_materialize_grads(False)
        ctx.tensors = [isinstance(t, Tensor) for t in (x, state, *weights)]
        ctx.save_for_backward(x)
        out = x.view_as(x)
        state.full = weakref.ref(out)
        return out

    @staticmethod
    def backward(ctx, grad: Optional[Tensor]):
        state, (x,) = ctx.state, ctx.saved_tensors
        nodes, want_input = _nodes(ctx)
        columns = state.take_input_grad()
        finish = start_all_reduce(columns.contiguous(), state.group) if want_input and columns is not None else None
        grads = _weight_grads(ctx, state, nodes, x)
        grad_x = None
        if want_input:
            grad_x = finish() if finish is not None else None
            if grad is not None and grad is not state.zero:  # the input's other consumers' gradient
                grad_x = grad if grad_x is None else grad_x + grad
        return grad_x, None, *grads


def enter_unit(x: Tensor, state: UnitGrads) -> Tensor:
    """The unit's input (no sequence parallelism) through one node that also takes its column layers' weights
    (`_UnitEntry`)."""
    return _UnitEntry.apply(x, state, *_weight_edges(state.columns))


def gather_unit_input(shard: Tensor, state: UnitGrads) -> Tensor:
    """The unit's input gathered along the sequence by one node that also takes its column layers' weights
    (`_UnitGather`); ``state.regather`` is to be set by the caller (it needs the gathered tensor)."""
    return _UnitGather.apply(shard, state, *_weight_edges(state.columns))


class _DeferredColumn(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of a column layer fed its unit's gathered input: backward computes the input's
    gradient and leaves the output's with the unit (``weight`` and ``bias`` come detached, cast as autocast casts
    them; their gradients are the unit's)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], state: UnitGrads, slot: int) -> Tensor:
        ctx.x_dtype = x.dtype
        x = autocast_inputs(x)[0]
        state.dtypes[slot] = x.dtype
        ctx.save_for_backward(weight)
        ctx.state, ctx.slot = state, slot
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        state = ctx.state
        grad2d = grad.reshape(-1, grad.size(-1))
        state.stash(ctx.slot, grad2d)
        grad_x = grad2d.mm(weight).view(*grad.shape[:-1], weight.size(-1)).to(ctx.x_dtype)
        if not state.sequence_parallel:  # a part of the sum over TP: the unit's entry reduces the layers' sum
            state.add_input_grad(grad_x)
            grad_x = state.nothing(grad_x)
        return grad_x, None, None, None, None


def deferred_column(layer, x: Tensor, state: UnitGrads) -> Tensor:
    """``layer``'s (a `ColumnParallelLinear`'s) output on its unit's gathered input ``x``, its weight gradients
    deferred to the unit's entry."""
    weight = layer.weight.detach()
    weight = weight.t() if layer.transposed else weight
    bias = None if layer.bias is None else layer.bias.detach()
    weight, *bias = autocast_inputs(weight, *([] if bias is None else [bias]))
    slot = next(i for i, c in enumerate(state.columns) if c is layer)  # (the layer is one of them: `feeds`)
    return _DeferredColumn.apply(x, weight, bias[0] if bias else None, state, slot)


def reduce_at_entry(unit: nn.Module, group: dist.ProcessGroup, columns_of: Callable[[nn.Module], list]) -> None:
    """Hooks of a paired unit without sequence parallelism: its main input enters through `_UnitEntry`, whose
    backward all-reduces the sum of its column layers' (``columns_of(unit)``) input gradients once, under their
    weight gradients -- one all-reduce a unit where each column layer reduced its own (three for separate q, k and
    v). Not compiled (the compiler traces the backward: the layers keep their own form there); inside activation
    checkpointing, selective or not, the checkpoint keeps (or recomputes) the input the entry keeps, and the
    backward, which no checkpoint runs again, reduces as outside."""
    from lightning_hybrid.parallel.tensor_parallel.verify import replace_main_input  # (verify imports the layers)

    entered: list = []

    def pre(module, args, kwargs):
        active = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        columns = columns_of(module) if active else []
        entered.append(columns)
        if not columns:
            return None
        state = UnitGrads(columns, group, sequence_parallel=False)
        for column in columns:
            column.unit_grads = state
        return replace_main_input(args, kwargs, lambda x: enter_unit(x, state))

    def post(module, args, kwargs, output):
        for column in entered.pop():
            column.unit_grads = None

    unit.register_forward_pre_hook(pre, with_kwargs=True)
    unit.register_forward_hook(post, with_kwargs=True, always_call=True)
