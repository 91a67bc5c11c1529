"""A sequence-parallel unit's backward: its input's reduce-scatter under its column layers' weight-gradient GEMMs.

Under sequence parallelism a paired unit (an attention or MLP module) all-gathers its input along the sequence at
entry, and its backward reduce-scatters the gradient of the gathered input. That gradient is the sum of what every
consumer of the input gives back (q, k and v, or gate and up): complete only once the last column layer's backward
has run, and each of those has already computed its weight's gradient by then, so an ordinary backward has nothing
left to compute while the reduce-scatter runs. Megatron-Core defers the weight gradients; so does this module:

* the unit's entry is one autograd node (`gather_unit_input`, `_UnitGather`) that takes the unit's column weights
  (and biases) as inputs, through views (`_weight_edges`);
* a column layer fed the gathered input computes its input gradient only (`deferred_column`) and leaves its output
  gradient with the unit (`UnitGrads.stash`);
* the entry's backward, which autograd runs after every consumer of the gathered input, starts the reduce-scatter,
  computes each column weight's and bias's gradient from those output gradients and the input all-gathered again
  (`Regather`: the unit keeps its input's sequence shard, not the gathered sequence, as Megatron does), then waits.

The products, operand layouts and sums are those of ``F.linear``'s own backward: bit for bit the ordinary gradients
(`tests/tensor_parallel/test_tensor_parallel_apply.py`). Where a backward call wants the input's gradient but not the
weights' (`torch.distributed.pipelining`'s zero-bubble schedule splits the two passes) the weights' wait, with their
output gradients, for the call that wants them; the engine says which it is (`_wanted`).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_hybrid.core.autocast import autocast_inputs
from lightning_hybrid.core.collectives import seq_all_gather, start_seq_all_gather, start_seq_reduce_scatter


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
    the gathered input (`stash`) and the dtype its GEMM saw the input in."""

    def __init__(self, columns: list, group: dist.ProcessGroup):
        self.columns, self.group = columns, group
        self.full = None  # a weak reference to the gathered input: the layers fed it defer
        self.regather: Optional[Regather] = None
        self.grads: list[list[Tensor]] = [[] for _ in columns]
        self.tasks: list = [None] * len(columns)  # the backward call each layer's gradients came from
        self.dtypes: list = [None] * len(columns)

    def feeds(self, layer, x: Tensor) -> bool:
        return self.full is not None and self.full() is x and any(c is layer for c in self.columns)

    def stash(self, slot: int, grad2d: Tensor) -> None:
        """A call's output gradient, from the running backward call: those of an earlier call (a graph kept and
        run again) are dropped."""
        task = torch._C._current_graph_task_id()
        if self.tasks[slot] != task:
            self.grads[slot], self.tasks[slot] = [], task
        self.grads[slot].append(grad2d)

    def clear(self) -> None:
        self.grads = [[] for _ in self.columns]

    def weight_grads(self, wanted: list[bool]) -> list[Optional[Tensor]]:
        """Per column layer, the weight's and the bias's gradients (``None`` where not ``wanted`` or not used)."""
        out: list[Optional[Tensor]] = []
        full = self.regather.take() if any(self.grads) else None
        inputs: dict = {}
        for slot, layer in enumerate(self.columns):
            grads, (want_w, want_b) = self.grads[slot], wanted[2 * slot: 2 * slot + 2]
            grad_w = grad_b = None
            if grads and want_w:
                dtype = self.dtypes[slot]
                if dtype not in inputs:
                    inputs[dtype] = full.to(dtype).reshape(-1, full.size(-1))
                x2d = inputs[dtype]
                for g in grads:
                    grad_w = _add(grad_w, _weight_grad(g, x2d, layer))
                grad_w = grad_w.to(layer.weight.dtype)
            if grads and want_b and layer.bias is not None:
                for g in grads:
                    grad_b = _add(grad_b, g.sum(0))
                grad_b = grad_b.to(layer.bias.dtype)
            out += [grad_w, grad_b]
        return out


def _add(total: Optional[Tensor], t: Tensor) -> Tensor:
    return t if total is None else total + t


def _weight_grad(grad2d: Tensor, x2d: Tensor, layer) -> Tensor:
    """``F.linear``'s weight gradient, in its operand layout (torch's ``mm_mat2_backward``): ``grad^T x`` for an
    nn.Linear's row-major ``[out, in]`` weight; for a Conv1D's ``[in, out]`` (multiplied as ``weight.t().t()``)
    computed as ``(x^T grad)^T`` and transposed into its layout."""
    if layer.transposed:
        return x2d.t().mm(grad2d)
    return grad2d.t().mm(x2d)


def _weight_edges(columns: list) -> list[Optional[Tensor]]:
    """The column layers' weights and biases, each as a view (``None`` where frozen or absent): a view's backward
    node is one the engine can be asked about inside ``autograd.grad`` (a leaf's is not), which is how `_wanted`
    tells whether a call wants the weights' gradients."""
    edges = []
    for layer in columns:
        for p in (layer.weight, layer.bias):
            edges.append(p.view_as(p) if p is not None and p.requires_grad else None)
    return edges


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
        state.full = weakref.ref(full)
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        state = ctx.state
        edges = iter(ctx.next_functions)  # one per tensor input
        nodes = [next(edges)[0] if tensor else None for tensor in ctx.tensors]
        want_input = ctx.needs_input_grad[0] and _wanted(nodes[0]) is not False
        finish = start_seq_reduce_scatter(grad, state.group) if want_input else None
        wanted = [needs and _wanted(node) is not False for needs, node in zip(ctx.needs_input_grad[2:], nodes[2:])]
        grads = [None] * len(wanted)
        if any(wanted):  # else (the inputs' pass of a zero-bubble schedule) they wait for the weights' pass
            grads = state.weight_grads(wanted)
            state.clear()
        return (finish() if finish is not None else None), None, *grads


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
        grad2d = grad.reshape(-1, grad.size(-1))
        ctx.state.stash(ctx.slot, grad2d)
        grad_x = grad2d.mm(weight).view(*grad.shape[:-1], weight.size(-1)).to(ctx.x_dtype)
        return grad_x, None, None, None, None


def deferred_column(layer, x: Tensor, state: UnitGrads) -> Tensor:
    """``layer``'s (a `ColumnParallelLinear`'s) output on its unit's gathered input ``x``, its weight gradients
    deferred to the unit's entry."""
    weight = layer.weight.detach()
    weight = weight.t() if layer.transposed else weight
    bias = None if layer.bias is None else layer.bias.detach()
    weight, *bias = autocast_inputs(weight, *([] if bias is None else [bias]))
    slot = next(i for i, c in enumerate(state.columns) if c is layer)
    return _DeferredColumn.apply(x, weight, bias[0] if bias else None, state, slot)
