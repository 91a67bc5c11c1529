"""ZeRO over the data-parallel dimension, on persistent gradient buckets.

* stages 0-2 (`ZeroOptimizer` + `GradientBuckets`): the trainable parameters of each optimizer param group are
  laid out in size-capped **buckets** (one dtype, device and TP category each, in backward order), and the
  parameters' ``.grad`` are views into their bucket's flat gradient buffer (as DDP's ``gradient_as_bucket_view``
  and Megatron's ``main_grad``). A post-accumulate-grad hook per parameter notes its gradient; when every
  parameter of a bucket has one in the last backward of an accumulation window, the bucket's reduction starts
  **asynchronously**, overlapping the rest of the backward, and is waited for before clipping and the step:
  - stage 0: all-reduce of each bucket (DDP semantics, 1 x gradients of communication);
  - stage 1: the user's optimizer is re-pointed at this rank's 1/dp slice of each bucket (its state is 1/dp);
    each bucket is reduce-scattered into that slice, the full buffers stay (gradients: Psi);
  - stage 2: as stage 1, but a bucket's full buffer exists only from its first gradient to its reduce-scatter
    (gradients: Psi/dp plus the bucket backward is filling and at most ``MAX_IN_FLIGHT`` being reduced; a
    bucket is freed as soon as its reduce-scatter is done).
  Stages 1 and 2 then all-gather the updated slices into the flat parameter buffers the model's parameters are
  views of (the same communication as DDP's all-reduce in total). On gloo, whose reduce-scatter and all-gather
  copy the whole buffer inside the call, both run as in-place collectives instead (`_COPYING_COLLECTIVES`).
* stage 3 (`apply_fsdp`): FSDP2 (`fully_shard`) over the DP sub-mesh; parameters, gradients and optimizer
  state are all 1/dp, parameters are gathered per layer for forward and backward (expert-parallel experts over
  their own DP group first: `apply_fsdp_experts`). On gloo FSDP2's all-gather and
  reduce-scatter are replaced by the same in-place collectives, and it prefetches nothing (`_fsdp_on_gloo`).

Gradients are reduced once per optimizer step: nothing is reduced during the earlier backward passes of an
accumulation window (``sync = False``) or inside a pipeline schedule (`GradientBuckets.reduce` after it).
Element-wise optimizers (SGD, Adam, AdamW, ...) give exactly the one-device update on the flat slices; an
optimizer that looks across a whole tensor (LAMB, Adafactor, Muon, LBFGS) does not, and stages 1-2 refuse it
(`check_elementwise`; a custom optimizer declares itself with a class attribute ``elementwise_update = True``).
A parameter without a gradient on any DP rank is skipped by one device's optimizer; a slice cannot skip part of
itself, so stages 1-2 refuse such a step with an error naming the parameters (stage 0 skips it as one device does).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.optim import Optimizer

DEFAULT_BUCKET_CAP_MB = 25.0
# Backends whose reduce-scatter may write into its own input at ``input[rank * n : (rank + 1) * n]`` (NCCL
# documents it).
_IN_PLACE_REDUCE_SCATTER = ("nccl",)
# Backends whose collectives copy the whole buffer inside the call, out of the live-tensor tracker's sight: gloo's
# reduce-scatter all-reduces a clone of its input, its all-gather fills a temporary as large as its output (+1x
# the bucket of resident memory per call, measured; under stage 1 every bucket of a backward is in flight at once).
# There a bucket all-reduces its buffer in place -- the all-reduce gloo's reduce-scatter runs, so the same sums,
# bit for bit, at any dp -- and its slices are gathered by one in-place broadcast per rank (copies): both allocate
# no more than a fixed ~2 MiB (tests/test_zero.py measures both).
_COPYING_COLLECTIVES = ("gloo",)
MAX_IN_FLIGHT = 1  # stage 2: reductions running while backward fills the next bucket

#: torch's optimizers whose update of an element reads only that element's parameter, gradient and state (and
#: scalars such as the learning rate and the step count): they step flat slices exactly as whole tensors.
ELEMENTWISE_OPTIMIZERS = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
})


def check_elementwise(optimizer: Optimizer, stage: int) -> None:
    """``TypeError`` unless ``optimizer``'s class updates element by element (`ELEMENTWISE_OPTIMIZERS`, or a class
    that declares ``elementwise_update = True``): ZeRO stages 1-2 step flat slices that cut across tensors."""
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS or getattr(cls, "elementwise_update", False) is True:
        return
    raise TypeError(
        f"zero_stage={stage} steps flat slices of the parameters, which only an element-wise optimizer updates as it"
        f" would whole tensors; {cls.__module__}.{cls.__qualname__} is not known to be one (an optimizer reading a"
        " whole tensor -- norms, factored moments, orthogonalisation -- would silently train another model). Use"
        f" one of {sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}, zero_stage 0 or 3, or declare a custom"
        " element-wise optimizer with the class attribute `elementwise_update = True`."
    )


class _Bucket:
    """Some parameters of one param group (one dtype, device and TP category) whose gradients are reduced as one.

    ``grad``: ``[padded]`` flat gradient buffer (the parameters' ``.grad`` are views ``views[i]`` of it; under
    stage 2 it exists only while the bucket accumulates). Stages 1-2 also own ``flat`` (``[padded]``, the
    parameters are views of it) and ``shard``: this rank's ``[padded/dp]`` slice ``flat[lo:hi]``, a Parameter
    the user's optimizer steps, whose ``.grad`` is the reduced slice of ``grad``.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, stage: int, tp_sharded: bool,
                 divisor: int | None = None):
        self.params, self.group, self.stage, self.tp_sharded = params, group, stage, tp_sharded
        # The reduced sum is divided by this: the group's size, or for experts (reduced over their own data-parallel
        # group, having met the tokens of the whole expert-parallel group) the full data-parallel size.
        self.divisor = divisor or dist.get_world_size(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.padded = -(-total // world) * world if stage else total
        size = self.padded // world
        self.lo, self.hi = rank * size, (rank + 1) * size
        like = params[0]
        self.grad: Tensor | None = None
        self.views: list[Tensor] = []
        self.shard_grad: Tensor | None = None
        if stage:
            self.flat = torch.zeros(self.padded, dtype=like.dtype, device=like.device)
            for p, offset in zip(params, self.offsets):
                self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset : offset + p.numel()].view_as(p)
            self.shard = nn.Parameter(self.flat[self.lo : self.hi])
            if stage == 2:  # persistent: the reduce-scatter writes straight into it
                self.shard_grad = torch.zeros(size, dtype=like.dtype, device=like.device)
        if stage < 2:
            self.allocate()
        self.work = None  # the running reduction
        self.scattered: Tensor | None = None  # stages 1-2: where the reduction leaves this rank's slice

    def offset(self, param: nn.Parameter) -> int:
        """Where ``param`` starts in the bucket's flat buffers."""
        return self.offsets[next(i for i, p in enumerate(self.params) if p is param)]

    def allocate(self) -> None:
        """The flat gradient buffer (zeros) and the parameters' views of it."""
        self.grad = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views = [self.grad[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def release(self) -> None:
        """Stage 2: drop the full gradient buffer (the slice has been reduced out of it)."""
        for p in self.params:
            p.grad = None
        self.grad, self.views = None, []

    def launch(self) -> None:
        """Start the reduction of ``grad`` over the DP group (asynchronous)."""
        assert self.grad is not None
        if self.stage == 0:  # averaged here, while backward still runs (as DDP does)
            self.work = dist.all_reduce(self.grad.div_(self.divisor), group=self.group, async_op=True)
            return
        backend = dist.get_backend(self.group)
        if backend in _COPYING_COLLECTIVES:  # the sum lands in the whole buffer, this rank's slice included
            self.scattered = self.grad[self.lo : self.hi]
            self.work = dist.all_reduce(self.grad, group=self.group, async_op=True)
            return
        if self.stage == 2:
            out = self.shard_grad
        elif backend in _IN_PLACE_REDUCE_SCATTER:  # this rank's slice of the buffer itself
            out = self.grad[self.lo : self.hi]
        else:
            out = self.grad.new_empty(self.hi - self.lo)
        self.scattered = out
        self.work = dist.reduce_scatter_single(out, self.grad, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the reduction; average it; stages 1-2 hand the slice to ``shard.grad``."""
        assert self.work is not None
        self.work.wait()
        self.work = None
        if self.stage == 0:
            return
        assert self.grad is not None and self.scattered is not None
        # Stage 1: the slice of the full buffer (gradients stay one buffer of Psi); stage 2: the persistent slice.
        mine = self.grad[self.lo : self.hi] if self.stage == 1 else self.shard_grad
        assert mine is not None
        if self.scattered.data_ptr() != mine.data_ptr():
            mine.copy_(self.scattered)
        self.shard.grad = mine.div_(self.divisor)
        self.scattered = None
        for p in self.params:  # the full views hold unreduced sums: not a gradient to read
            p.grad = None
        if self.stage == 2:
            self.release()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank's updated slice into ``flat`` (stages 1-2, after the step), over the DP group."""
        if dist.get_backend(self.group) in _COPYING_COLLECTIVES:  # rank r's slice, from rank r, in place
            size = self.hi - self.lo
            works = [dist.broadcast(self.flat[r * size : (r + 1) * size], group_src=r, group=self.group,
                                    async_op=True) for r in range(dist.get_world_size(self.group))]
            for work in works:
                work.wait()
            return
        dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


class ShardedGradient(Tensor):
    """What ``p.grad`` of a parameter is under ZeRO 1-2 from the gradient reduction to the optimizer step: the
    reduced gradient lives in bucket slices spread over the data-parallel ranks (this rank holds ``1/dp`` of it,
    which the optimizer steps), so no rank has ``p``'s gradient. Any use of it -- ``torch.nn.utils.clip_grad_norm_``,
    ``p.grad.norm()``, adding to it -- raises a ``RuntimeError`` that says what to use instead (where ``None`` would
    let a hand-called ``clip_grad_norm_`` silently clip nothing). ``is None`` checks see a gradient; the optimizer
    step and ``zero_grad`` set it back to ``None``."""

    _name: str
    _stage: int

    @staticmethod
    def __new__(cls, param: Tensor, name: str, stage: int) -> "ShardedGradient":
        out = Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        out._name, out._stage = name, stage
        return out

    def __init__(self, param: Tensor, name: str, stage: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"ShardedGradient({self._name!r}, zero_stage={self._stage})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        grad = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, ShardedGradient))
        raise RuntimeError(
            f"{func.__name__} on the gradient of {grad._name}: under zero_stage={grad._stage} the reduced gradient is"
            " split over the data-parallel ranks' bucket slices (the optimizer steps this rank's slice), so no rank"
            " holds p.grad. Clip with Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer,"
            " gradient_clip_val=..., gradient_clip_algorithm='norm') (by the global norm, as one device), read each"
            " parameter's whole-gradient norm with trainer.strategy.parameter_grad_norms(), or use zero_stage 0 or 3."
        )


@dataclass(frozen=True, eq=False)
class SlicePlace:
    """Where a parameter's ZeRO-1/2 optimizer state lives: in the state of ``shard``, this rank's slice
    ``[lo, hi)`` of a flat bucket of ``size`` elements reduced over ``group``; the parameter's elements start at
    ``start`` in that bucket. Parameters of one bucket share their ``shard``."""

    shard: nn.Parameter
    start: int
    lo: int
    hi: int
    size: int
    group: dist.ProcessGroup


def _layout(params: list[nn.Parameter], cap_bytes: int, key) -> list[list[nn.Parameter]]:
    """Parameters grouped by ``key`` and cut into buckets of at most ``cap_bytes`` (a larger parameter gets a
    bucket of its own), in backward order: the reverse of registration, as DDP does."""
    by_kind: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for p in reversed(params):
        by_kind[key(p)].append(p)
    out = []
    for kind_params in by_kind.values():
        current, size = [], 0
        for p in kind_params:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap_bytes:
                out.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            out.append(current)
    return out


class GradientBuckets:
    """The gradient buckets of one optimizer and the hooks that reduce them as backward completes them.

    ``sync``: whether this backward is the last of an accumulation window (reductions start during it).
    `wait` (after the backward) waits for every reduction; `reduce` (after a pipeline schedule, which ran its
    backward passes with ``sync = False``) starts and waits for all of them. Collective over the DP ``group``.
    """

    def __init__(
        self, buckets: list[_Bucket], group: dist.ProcessGroup, stage: int, names: dict[int, str] | None = None,
    ) -> None:
        self.buckets, self.group, self.stage = buckets, group, stage
        self.names = names or {}  # id(parameter) -> its name, for errors
        self.sync = True
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._seen: set[int] = set()  # parameters whose gradient is in their bucket in this window
        self._fired: dict[int, int] = defaultdict(int)  # bucket -> gradients completed in this backward
        self._in_backward = False
        self._launched: set[int] = set()  # buckets whose reduction of this window has started
        self._pending: list[_Bucket] = []  # started, not yet finished
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in buckets for p in b.params]

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        bucket, i = self._where[id(p)]
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.stage == 2:  # free the buckets whose reduce-scatter is done
            while self._pending and self._pending[0].work.is_completed():
                self._pending.pop(0).finish()
        self._adopt(bucket, i, p)
        self._fired[id(bucket)] += 1
        if self.sync and self._fired[id(bucket)] == len(bucket.params):
            self._launch(bucket)

    def _adopt(self, bucket: _Bucket, i: int, p: nn.Parameter) -> None:
        """Make ``p.grad`` its view of the bucket, adding a gradient autograd put elsewhere (the first of the
        window after ``zero_grad``, or one assigned by a pipeline schedule)."""
        if bucket.grad is None:
            bucket.allocate()
        view, grad = bucket.views[i], p.grad
        if isinstance(grad, ShardedGradient):  # the placeholder of the last step (`wait`)
            grad = None
        if grad is not None and grad is not view:
            if id(p) in self._seen:
                view.add_(grad)
            else:
                view.copy_(grad)
            p.grad = view
        if grad is not None:
            self._seen.add(id(p))

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._fired.clear()
        if self.sync:
            self._launch_rest()

    def _launch_rest(self) -> None:
        for bucket in self.buckets:
            if id(bucket) not in self._launched:
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        self._launched.add(id(bucket))
        if bucket.grad is None:
            bucket.allocate()
        for p, view in zip(bucket.params, bucket.views):  # no gradient in this window: contributes zeros
            if id(p) not in self._seen:
                view.zero_()
        bucket.launch()
        self._pending.append(bucket)
        if self.stage == 2:
            while len(self._pending) > MAX_IN_FLIGHT:
                self._pending.pop(0).finish()

    @torch.no_grad()
    def wait(self) -> None:
        """Wait for the reductions the backward started (and start those it did not, e.g. for parameters
        without a gradient); then the window is over."""
        self._in_backward = False
        self._fired.clear()
        self._launch_rest()
        for bucket in self._pending:
            bucket.finish()
        self._pending = []
        self._presence()
        self._seen.clear()
        self._launched.clear()
        if self.stage:  # the reduced gradient is in the slices: p.grad says so until the step (`ShardedGradient`)
            for bucket in self.buckets:
                for p in bucket.params:
                    p.grad = ShardedGradient(p, self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}"),
                                             self.stage)

    @torch.no_grad()
    def reduce(self) -> None:
        """Reduce now (after a pipeline schedule): take in the gradients it left, start every bucket, wait."""
        self.adopt()
        self.wait()

    @torch.no_grad()
    def adopt(self) -> None:
        """Take into the buckets the gradients backward left outside them (`_adopt`)."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    self._adopt(bucket, i, p)

    def gradient_of(self, param: nn.Parameter) -> Tensor | None:
        """``param``'s unreduced gradient of this window as the buckets hold it (its view; ``None`` where it has
        none or is not this optimizer's)."""
        where = self._where.get(id(param))
        if where is None or id(param) not in self._seen:
            return None
        bucket, i = where
        return bucket.views[i] if bucket.grad is not None else None

    def _presence(self) -> None:
        """A parameter without a gradient on every rank: under stage 0 it keeps ``grad=None`` (the optimizer skips
        it, as on one device; one with a gradient somewhere gets the average with zeros from the others); stages
        1-2 would step it with a zero gradient in its slice, so they raise ``RuntimeError`` naming it (on every
        rank alike)."""
        params = [p for b in self.buckets for p in b.params]
        seen = torch.tensor([id(p) in self._seen for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(seen, group=self.group)
        counts = seen.tolist()
        if self.stage == 0:
            views = [v for b in self.buckets for v in b.views]
            for p, view, count in zip(params, views, counts):
                p.grad = view if count else None
            return
        absent = [self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
                  for p, count in zip(params, counts) if not count]
        if absent:
            raise RuntimeError(
                f"zero_stage={self.stage}: {absent} got no gradient on any data-parallel rank in this step. One device"
                " would skip them; ZeRO-1/2 step flat slices and would update them with a zero gradient (weight decay,"
                " moments): another model. Freeze them (requires_grad=False), leave them out of the optimizer, or use"
                " zero_stage 0 or 3."
            )

    def clear(self) -> None:
        """Gradients to ``None`` (``zero_grad``); the buffers keep their memory and are written fresh by the
        next window. Under a pipeline, Lightning's ``zero_grad`` comes after the schedule's backward passes:
        the gradients of the window are kept in the buckets."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None

    def remove(self) -> None:
        """Detach the hooks from the parameters (the optimizer is done with)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class ZeroOptimizer(Optimizer):
    """Wraps the user's optimizer for ZeRO stage 0, 1 or 2 over the DP ``group``, on gradient buckets.

    The user's optimizer object is kept (LR schedulers hold it). Stage 0 leaves its param groups as they are;
    stages 1-2 re-point them at this rank's bucket slices, keeping every hyper-parameter. ``tp_sharded`` holds
    the ids of parameters that are TP shards, kept in other buckets than replicated ones so the gradient norm
    can count each once. ``bucket_cap_mb``: the size cap of one bucket. ``names``: id(parameter) -> name, for
    errors. Stages 1-2 take element-wise optimizers only (`check_elementwise`). ``experts``: the ids of expert
    parameters (`lightning_hybrid.expert_parallel`) and their own data-parallel group: they are bucketed apart and
    reduced (stages 1-2: sharded) over that group, their sum divided by the size of ``group`` all the same.
    """

    def __init__(
        self, optimizer: Optimizer, group: dist.ProcessGroup, stage: int, tp_sharded: set[int],
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, names: dict[int, str] | None = None,
        experts: tuple[set[int], dist.ProcessGroup] | None = None,
    ):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer implements zero_stage 0, 1 and 2, got {stage}.")
        if stage:
            check_elementwise(optimizer, stage)
        if optimizer.state and stage:
            raise ValueError("ZeroOptimizer must wrap a fresh optimizer (its state is not empty).")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is invalid: it must be a positive number of MiB.")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[_Bucket] = []
        for param_group in optimizer.param_groups:
            params = _unique(param_group["params"])
            trainable = [p for p in params if p.requires_grad]
            expert_ids, expert_group = experts if experts is not None else (set(), group)
            dp = dist.get_world_size(group)
            group_buckets = [
                _Bucket(ps, expert_group if id(ps[0]) in expert_ids else group, stage, id(ps[0]) in tp_sharded, dp)
                for ps in _layout(trainable, cap,
                                  lambda p: (p.dtype, p.device, id(p) in tp_sharded, id(p) in expert_ids))
            ]
            self.buckets.extend(group_buckets)
            if stage:
                param_group["params"] = [b.shard for b in group_buckets] + [p for p in params if not p.requires_grad]
        self.gradients = GradientBuckets(self.buckets, group, stage, names)
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def shards_state(self) -> bool:
        """Whether the optimizer steps bucket slices (stages 1-2) rather than the model's parameters."""
        return self.stage > 0

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step()
        if self.stage:
            for bucket in self.buckets:
                bucket.gather_parameters()
            self.gradients.clear()  # the placeholders (`ShardedGradient`) go
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gradients.clear()
        for bucket in self.buckets:
            if self.stage:
                bucket.shard.grad = None

    def grad_shards(self) -> list[tuple[Tensor, bool]]:
        """Stages 1-2: ``(slice gradient, is a TP shard)`` for each bucket that has one: the slices cover the
        reduced gradient exactly once over the DP group."""
        return [(b.shard.grad, b.tp_sharded) for b in self.buckets if self.stage and b.shard.grad is not None]

    def grad_pieces(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Stages 1-2: ``(parameter, the part of this rank's reduced slice that holds its gradient)`` for every
        parameter with such a part (flat; over the DP group the parts of a parameter make up its gradient)."""
        out = []
        for bucket in self.buckets:
            if bucket.shard.grad is None:
                continue
            for p, offset in zip(bucket.params, bucket.offsets):
                lo, hi = max(offset, bucket.lo), min(offset + p.numel(), bucket.hi)
                if lo < hi:
                    out.append((p, bucket.shard.grad[lo - bucket.lo : hi - bucket.lo]))
        return out

    def sliced_params(self) -> list[nn.Parameter]:
        """Stages 1-2: the parameters whose gradients and optimizer state live in bucket slices (every trainable
        one); stage 0: none."""
        return [p for b in self.buckets for p in b.params] if self.stage else []

    def slice_places(self) -> list[tuple[nn.Parameter, SlicePlace]]:
        """Stages 1-2: ``(parameter, where its optimizer state lives)`` in bucket order (the order checkpoints
        save and load them in)."""
        return [
            (p, SlicePlace(b.shard, offset, b.lo, b.hi, b.padded, b.group))
            for b in self.buckets if self.stage for p, offset in zip(b.params, b.offsets)
        ]

    def gradient_buffers(self) -> list[Tensor]:
        """The flat gradient buffers the buckets hold now (of which the ``.grad`` are views) and the slices'
        gradients: what gradients occupy beyond the ``.grad`` themselves."""
        held = [t for b in self.buckets for t in (b.grad, b.shard_grad, b.shard.grad if b.stage else None)]
        return [t for t in held if t is not None]

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, buckets={len(self.buckets)}, {self.optimizer!r})"


class _InPlaceAllGather(AllGather):
    """FSDP2's parameter all-gather on gloo, whose ``all_gather_single`` fills a temporary as large as its output
    (one gathered layer) inside the call: as `_Bucket.gather_parameters`, one in-place broadcast per rank of its
    slot of ``output_tensor`` (copies: the same result bit for bit). FSDP2 writes this rank's shards straight into
    its slot (``input_tensor`` is a view of it).

    It returns the ``Work`` of the last broadcast (the others are waited for here), even when FSDP2 asks for a
    synchronous all-gather: FSDP2 waits for it before copying the layer's parameters out of ``output_tensor``,
    and, the all-gather being asynchronous, frees ``output_tensor`` right after that copy. After a synchronous
    all-gather in forward it would keep ``output_tensor`` until the next layer's parameters have been copied out
    (so that, on a GPU, that copy overlaps the next all-gather on its stream): on CPU, a second gathered layer at
    every layer's gather, with the activations of the whole forward -- the peak of a ZeRO-3 step."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work:
        n, rank = input_tensor.numel(), dist.get_rank(group)
        mine = output_tensor.narrow(0, rank * n, n)
        if input_tensor.data_ptr() != mine.data_ptr():
            mine.copy_(input_tensor)
        works = [dist.broadcast(output_tensor.narrow(0, r * n, n), group_src=r, group=group, async_op=True)
                 for r in range(dist.get_world_size(group))]
        for work in works[:-1]:
            work.wait()
        return works[-1]


class _InPlaceReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter on gloo, whose ``reduce_scatter_single`` all-reduces a clone of its input
    (one layer's gradients) inside the call: that all-reduce, in place in ``input_tensor`` (FSDP2's flat copy of
    the layer's gradients, which it does not read again), then this rank's part copied out. The same op FSDP2
    asks for (``AVG`` for float32), the same sums, bit for bit (tests/test_zero.py compares them)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        n = output_tensor.numel()
        output_tensor.copy_(input_tensor.narrow(0, dist.get_rank(group) * n, n))


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, parts: bool = True,
               tied: frozenset[int] | set[int] = frozenset()) -> list[nn.Module]:
    """ZeRO-3: ``fully_shard`` every layer of ``module`` (the elements of its ``nn.ModuleList``s), then each of
    its children that holds parameters (the elements of a child that is a container without ``forward``,
    such as an ``nn.ModuleList`` held by the LightningModule itself). Returns those children: the FSDP roots.

    Parameters held directly by ``module`` itself cannot be sharded this way and are an error, as is a parameter
    shared by two roots (``tied``: ids of the shared parameters, `lightning_hybrid.tied`): each root would shard
    its own copy and the tie would break.
    """
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"zero_stage=3 shards parameters per submodule, but {type(module).__name__} holds {direct} directly."
            " Move them into a submodule (e.g. an nn.Module attribute)."
        )
    layers = [layer for sub in module.modules() if isinstance(sub, nn.ModuleList) for layer in sub]
    roots = _fsdp_roots(module)
    names = {id(m): n for n, m in module.named_modules()}
    for p_id in tied:
        holding = [names[id(root)] for root in roots if any(id(p) == p_id for p in root.parameters())]
        if len(holding) > 1:
            raise ValueError(
                f"zero_stage=3 shards each of {type(module).__name__}'s children that hold parameters as an FSDP root"
                f" of its own, and {holding} share one parameter (tied weights, e.g. an LM head tied to the"
                " embedding): each root would shard its own copy and the tie would break. Hold the modules that share"
                " it in one submodule (e.g. self.model), or use zero_stage 0-2."
            )
    return [apply_fsdp_units([layer for layer in layers if layer is not root and _holds(layer, root)], root, dp_mesh,
                             parts, tied) for root in roots]


def _fsdp_roots(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` that hold parameters; a container that has no ``forward`` of its own (FSDP2
    cannot wrap it) is replaced by its own children."""
    out = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).forward is nn.Module.forward:
            out.extend(_fsdp_roots(child))
        else:
            out.append(child)
    return out


def apply_fsdp_units(units: list[nn.Module], root: nn.Module, dp_mesh: DeviceMesh, parts: bool = True,
                     tied: frozenset[int] | set[int] = frozenset()) -> nn.Module:
    """``fully_shard`` each unit that has parameters (gathered one at a time), then ``root`` (the rest); with
    ``parts`` (not under ``torch.compile``, whose layer graphs FSDP2's hooks inside a layer would break) a unit's
    children that hold parameters (its attention, its MLP, its norms) are units of their own, gathered one at a
    time: a unit's gather holds it twice for a moment (FSDP2's flat buffer and the parameters copied out of it),
    and a part is a fraction of a layer. Every element's sum over the ranks is the same. A unit or part holding a
    parameter that other modules share (``tied``: their ids) is left to ``root``, which then shards it once for all
    of them. On gloo (`_COPYING_COLLECTIVES`) each also gets the in-place collectives and no backward prefetch
    (`_fsdp_on_gloo`)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def shardable(module: nn.Module) -> bool:
        held = [id(p) for p in module.parameters()]
        return bool(held) and not any(p in tied for p in held)

    sharded = []
    for unit in units:
        if not shardable(unit):
            continue
        if parts:
            sharded += [fully_shard(child, mesh=dp_mesh, reshard_after_forward=True) for child in unit.children()
                        if not isinstance(child, FSDPModule) and type(child).forward is not nn.Module.forward
                        and shardable(child)]
        sharded.append(fully_shard(unit, mesh=dp_mesh, reshard_after_forward=True))
    sharded.append(fully_shard(root, mesh=dp_mesh, reshard_after_forward=True))
    if dp_mesh.ndim == 1 and dist.get_backend(dp_mesh.get_group()) in _COPYING_COLLECTIVES:
        for module in sharded:
            _fsdp_on_gloo(module)
    return root


def apply_fsdp_experts(experts: list[nn.Module], edp_mesh: DeviceMesh, dp: int) -> None:
    """ZeRO-3 of expert-parallel experts modules (`lightning_hybrid.expert_parallel`): each is ``fully_shard``-ed
    over its own data-parallel mesh -- the ``dp / ep`` ranks holding the same experts -- before the layers that
    hold it are sharded over DP (FSDP2 then leaves its parameters to it, as TorchTitan does). Their gradients,
    summed over that mesh, are divided by the whole ``dp`` as every other gradient is: they met the tokens of the
    whole expert-parallel group."""
    from torch.distributed.fsdp import fully_shard

    backend = dist.get_backend(edp_mesh.get_group())
    for module in experts:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=True)
        module.set_gradient_divide_factor(float(dp))
        # A divide factor is NCCL's PREMUL_SUM otherwise, which gloo does not have. Not on one rank: there
        # FSDP2 (torch 2.13) divides by the factor while copying, and would then post-divide by it again.
        if backend != "nccl" and edp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
        if backend in _COPYING_COLLECTIVES:
            _fsdp_on_gloo(module)


def _fsdp_on_gloo(module: nn.Module) -> None:
    """FSDP2 on gloo (CPU): its all-gather and reduce-scatter become `_InPlaceAllGather` and
    `_InPlaceReduceScatter`, and it prefetches nothing in backward.

    FSDP2's default backward prefetch gathers the next layer (in backward order) as soon as a layer's backward
    starts, so that the all-gather runs on its own stream while this layer computes. Gloo on CPU has no streams:
    the all-gather runs then and there, before the layer's backward, and the only effect is that two layers are
    gathered at once -- the running one (with its unsharded gradients) and the next: one more layer of memory at
    the peak, for no overlap. FSDP2 has no switch to turn it off (an empty list of modules to prefetch means "the
    default"), so each FSDP module is told to prefetch only itself: FSDP2 takes the explicit list instead of its
    default prefetch, and ``unshard`` of a module whose ``pre_backward`` has just gathered it returns at once.
    On NCCL none of this is done: there the prefetch overlaps communication with compute, and NCCL's collectives
    write in place.
    """
    module.set_custom_all_gather(_InPlaceAllGather())
    module.set_custom_reduce_scatter(_InPlaceReduceScatter())
    module.set_modules_to_backward_prefetch([module])


def _holds(module: nn.Module, root: nn.Module) -> bool:
    return any(module is sub for sub in root.modules())


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
