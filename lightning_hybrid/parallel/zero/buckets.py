"""ZeRO 0-2's gradient buckets and their reduction over the data-parallel group.

`_layout` cuts a param group's trainable parameters into size-capped buckets (``DEFAULT_BUCKET_CAP_MB``; stage 2
also at `stage2_cap` of the group) in backward order; a `_Bucket` holds the flat gradient buffer its parameters'
``.grad`` are views of and runs its reduction (stage 0: all-reduce; stages 1-2: reduce-scatter into this rank's
slice, on gloo an in-place all-reduce: `_COPYING_COLLECTIVES`). `GradientBuckets` starts each bucket's reduction
from post-accumulate-grad hooks as soon as backward has filled it and waits for them before the step; under stages
1-2 a parameter's ``.grad`` is then a `ShardedGradient` placeholder until the step (no rank holds the whole reduced
gradient).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.parallel.zero.sharded_gradient import ShardedGradient

DEFAULT_BUCKET_CAP_MB = 25.0
# Backends whose reduce-scatter may write into its own input at ``input[rank * n : (rank + 1) * n]`` (NCCL
# documents it).
_IN_PLACE_REDUCE_SCATTER = ("nccl",)
# Backends whose collectives copy the whole buffer inside the call, out of the live-tensor tracker's sight: gloo's
# reduce-scatter all-reduces a clone of its input, its all-gather fills a temporary as large as its output (+1x
# the bucket of resident memory per call, measured; under stage 1 every bucket of a backward is in flight at once).
# There a bucket all-reduces its buffer in place -- the all-reduce gloo's reduce-scatter runs, so the same sums,
# bit for bit, at any dp -- and its slices are gathered by one in-place broadcast per rank (copies): both allocate
# no more than a fixed ~2 MiB (tests/zero/test_zero.py measures both).
_COPYING_COLLECTIVES = ("gloo",)
MAX_IN_FLIGHT = 1  # stage 2: reductions running while backward fills the next bucket
STAGE2_MIN_BUCKETS = 32  # stage 2 cuts a param group into at least this many buckets (`stage2_cap`) ...
STAGE2_MIN_BUCKET_BYTES = 2**20  # ... of at least this size


def stage2_cap(cap_bytes: int, grad_bytes: int) -> int:
    """Stage 2's bucket cap for a param group of ``grad_bytes`` of gradients: ``cap_bytes``, and at most
    ``grad_bytes / STAGE2_MIN_BUCKETS`` (not under ``STAGE2_MIN_BUCKET_BYTES``).

    Beside its 1/dp slices stage 2 holds full buffers -- the bucket backward is filling and up to ``MAX_IN_FLIGHT``
    being reduced, and at the start of backward the first bucket beside all the activations -- so its saving over
    stage 0 falls short of the formula's by about two buckets. With the default 25 MiB cap that is ~50 MiB: the
    whole gradient saving (Psi - Psi/dp) of a 25M-parameter GPT at dp=2, where ZeRO-2 saved 74% of the formula's
    promise at its peak (live tensors; the resident set with freed blocks unmapped alike) against 94% once its
    buckets are cut at 1/32 of the gradients. A model of over 32 caps of gradients (~210M fp32 parameters at
    25 MiB) keeps ``cap_bytes``. Where the cut moves a bucket's ends, dp > 2 sums each gradient in another order
    (last-bit differences, as with any other ``bucket_cap_mb``); at dp = 2 the bits are the same."""
    return min(cap_bytes, max(STAGE2_MIN_BUCKET_BYTES, grad_bytes // STAGE2_MIN_BUCKETS))


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
        # Stage 2: where `allocate` takes its full buffer from (`GradientBuckets` sets it; None: a new one each time).
        self.buffers: _FlatBuffers | None = None
        if stage < 2:
            self.allocate()
        self.work = None  # the running reduction
        self.scattered: Tensor | None = None  # stages 1-2: where the reduction leaves this rank's slice

    def offset(self, param: nn.Parameter) -> int:
        """Where ``param`` starts in the bucket's flat buffers."""
        return self.offsets[next(i for i, p in enumerate(self.params) if p is param)]

    def allocate(self) -> None:
        """The flat gradient buffer (zeros) and the parameters' views of it."""
        if self.buffers is not None:
            self.grad = self.buffers.take(self.padded, self.params[0].dtype, self.params[0].device)
        else:
            self.grad = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views = [self.grad[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def release(self) -> None:
        """Stage 2: drop the full gradient buffer (the slice has been reduced out of it)."""
        for p in self.params:
            p.grad = None
        if self.buffers is not None and self.grad is not None:
            self.buffers.give(self.grad)
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
        self.start_gather()()

    @torch.no_grad()
    def start_gather(self) -> Callable[[], None]:
        """Start `gather_parameters` asynchronously; returns what waits for it (``flat`` must not be read before).
        """
        sources: list[Tensor] = []  # kept alive until the wait: the gather reads them
        if dist.get_backend(self.group) in _COPYING_COLLECTIVES:  # rank r's slice, from rank r, in place
            size = self.hi - self.lo
            works = [dist.broadcast(self.flat[r * size : (r + 1) * size], group_src=r, group=self.group,
                                    async_op=True) for r in range(dist.get_world_size(self.group))]
        else:
            sources.append(self.shard.detach().clone())
            works = [dist.all_gather_single(self.flat, sources[0], group=self.group, async_op=True)]

        def wait() -> None:
            for work in works:
                work.wait()
            sources.clear()

        return wait


class _FlatBuffers:
    """Stage 2's full gradient buffers of one dtype and device, reused from bucket to bucket within a window.

    A new buffer per bucket, freed after its reduction, came from glibc's heap (its mmap threshold rises to up to
    32 MiB once a large block is freed) between the activations and gradients backward allocates and frees: the
    next bucket often found no hole left that fitted and grew the heap, which keeps what is freed resident (the
    33.9M-parameter GPT of benchmarks/bench_memory.py at dp=2 ended with 158 MiB free in its heap against stage
    0's 84). So the buckets take up to ``keep`` buffers of ``numel`` elements (the largest bucket; ``keep = 1 +
    MAX_IN_FLIGHT``, as many as are alive at once), made as first needed and handed on as each is freed, and
    let them go at the end of the window (`drop`): nothing stays between steps. A bucket under half of ``numel``
    (such as the head's, filled first, beside all the activations) gets a buffer of its own size, as does one
    that finds none free (accumulation and pipelines hold every bucket until the reduction): lent a whole one it
    would hold more than twice its size. `take` zeroes the part a bucket uses, as a fresh buffer would be."""

    def __init__(self, numel: int, keep: int) -> None:
        self.numel, self.keep = numel, keep
        self.free: list[Tensor] = []
        self.made = 0  # buffers of ``numel`` made in this window

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A zero-filled ``[n]`` buffer: the start of a free one, of a new one of ``numel``, or a new one of ``n``."""
        if 2 * n <= self.numel or not (self.free or self.made < self.keep):
            return torch.zeros(n, dtype=dtype, device=device)
        if self.free:
            buffer = self.free.pop()
        else:
            self.made += 1
            buffer = torch.empty(self.numel, dtype=dtype, device=device)
        return buffer[:n].zero_()

    def give(self, grad: Tensor) -> None:
        """``grad`` (from `take`) is no longer used: its buffer is kept for the next bucket if it is one of ours."""
        base = grad if grad._base is None else grad._base
        if base.numel() == self.numel and len(self.free) < self.keep and all(b is not base for b in self.free):
            self.free.append(base)

    def drop(self) -> None:
        """The window is over: let the buffers go."""
        self.free, self.made = [], 0


def _layout(params: list[nn.Parameter], cap_bytes: int, key, stage: int = 0) -> list[list[nn.Parameter]]:
    """Parameters grouped by ``key`` and cut into buckets of at most ``cap_bytes`` (a larger parameter gets a
    bucket of its own), in backward order: the reverse of registration, as DDP does. Under ``stage`` 2 the cap is
    also `stage2_cap` of all of ``params`` (the param group)."""
    if stage == 2:
        cap_bytes = stage2_cap(cap_bytes, sum(p.numel() * p.element_size() for p in params))
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
    backward passes with ``sync = False``) starts and waits for all of them. Under a pipeline each stage's last
    backward of a window runs `eager` (`lightning_hybrid.grad_sync.GradientSync.pipeline_step`): a bucket that
    backward completes starts its reduction then, the others wait for `reduce` (another stage of this rank may
    still add to them). Collective over the DP ``group``.
    """

    def __init__(
        self, buckets: list[_Bucket], group: dist.ProcessGroup, stage: int, names: dict[int, str] | None = None,
        stepped: Callable[[], list[Tensor]] | None = None,
    ) -> None:
        self.buckets, self.group, self.stage = buckets, group, stage
        self.names = names or {}  # id(parameter) -> its name, for errors
        self.stepped = stepped or list  # what the optimizer steps now, each once: one in no bucket is checked
        # What the buckets hold (their parameters and, stages 1-2, their slices: both made once, at setup)
        self._bucketed = {id(t) for b in buckets for t in [*b.params, getattr(b, "shard", None)] if t is not None}
        self.sync = True
        self.partial = False  # with ``sync``: only the buckets this backward completes start (`eager`)
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._seen: set[int] = set()  # parameters whose gradient is in their bucket in this window
        self._fired: dict[int, int] = defaultdict(int)  # bucket -> gradients completed in this backward
        self._in_backward = False
        self._launched: set[int] = set()  # buckets whose reduction of this window has started
        self._pending: list[_Bucket] = []  # started, not yet finished
        self._buffers: dict[tuple, _FlatBuffers] = {}  # stage 2: its buckets' full buffers, by dtype and device
        if stage == 2:
            by_kind: dict[tuple, list[_Bucket]] = defaultdict(list)
            for b in buckets:
                by_kind[b.params[0].dtype, b.params[0].device].append(b)
            for kind, group in by_kind.items():
                self._buffers[kind] = _FlatBuffers(max(b.padded for b in group), 1 + MAX_IN_FLIGHT)
                for b in group:
                    b.buffers = self._buffers[kind]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in buckets for p in b.params]

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        bucket, i = self._where[id(p)]
        if id(bucket) in self._launched:
            raise RuntimeError(
                f"{self.names.get(id(p), 'a parameter')} got a gradient after its bucket's reduction had started:"
                " its gradient of this window was complete (a pipeline stage's last backward) but another backward"
                " added to it. Parameters shared between stages must be tied (lightning_hybrid.parallel.tied).")
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
        if self.sync and not self.partial:
            self._launch_rest()

    @contextmanager
    def eager(self) -> Iterator[None]:
        """A backward during which a bucket starts its reduction as soon as this backward has given each of its
        parameters its last gradient of the window (a pipeline stage's last backward); nothing else starts."""
        sync, partial = self.sync, self.partial
        self.sync, self.partial = True, True
        try:
            yield
        finally:
            self.sync, self.partial = sync, partial

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
        for buffers in self._buffers.values():
            buffers.drop()
        self._presence()
        self._seen.clear()
        self._launched.clear()
        if self.stage:  # the reduced gradient is in the slices: p.grad says so until the step (`ShardedGradient`)
            for bucket in self.buckets:
                for p in bucket.params:
                    p.grad = ShardedGradient(p, self._name(p), self.stage)

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

    def started(self, bucket: _Bucket) -> bool:
        """Whether ``bucket``'s reduction of this window has started (under a pipeline: during a stage's last
        backward, before Lightning's ``zero_grad``; under stage 2 it may have finished, its slice's gradient set)."""
        return id(bucket) in self._launched

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
        rank alike). A trainable parameter the optimizer steps that is in no bucket (frozen at setup and unfrozen
        since, or added to the optimizer since: Lightning's ``BackboneFinetuning``) would be stepped with each rank's
        own gradient: under stage 0 its gradient is averaged here, as a bucket's would be (`_reduce_unbucketed`);
        stages 1-2, whose optimizer steps the slices laid out at setup, raise ``RuntimeError`` on every rank."""
        params = [p for b in self.buckets for p in b.params]
        # The same list on every rank (what requires a gradient, not what got one here)
        unbucketed = [p for p in self._unbucketed() if p.requires_grad]
        seen = torch.tensor([id(p) in self._seen for p in params] + [p.grad is not None for p in unbucketed],
                            dtype=torch.int32, device=self.buckets[0].params[0].device)
        dist.all_reduce(seen, group=self.group)
        everywhere = seen.tolist()
        counts, stray_counts = everywhere[:len(params)], everywhere[len(params):]
        strays = [p for p, count in zip(unbucketed, stray_counts) if count]
        if strays and self.stage:
            names = [self._name(p) for p in strays]
            raise RuntimeError(
                f"zero_stage={self.stage}: {names} got a gradient but was not trainable in the optimizer when training"
                " started (unfrozen since, or added to the optimizer since: BackboneFinetuning's add_param_group):"
                " the gradient buckets that reduce each gradient over the data-parallel ranks, and the slices the"
                " optimizer steps, are laid out then, so its gradient would stay each rank's own and every rank would"
                " step another model. Make it trainable and give it to the optimizer before trainer.fit (with"
                " zero_stage 0 or 3 unfreezing later is exact)."
            )
        if strays:
            self._reduce_unbucketed(strays)
        if self.stage == 0:
            views = [v for b in self.buckets for v in b.views]
            for p, view, count in zip(params, views, counts):
                p.grad = view if count else None
            return
        absent = [self._name(p) for p, count in zip(params, counts) if not count]
        if absent:
            raise RuntimeError(
                f"zero_stage={self.stage}: {absent} got no gradient on any data-parallel rank in this step. One device"
                " would skip them; ZeRO-1/2 step flat slices and would update them with a zero gradient (weight decay,"
                " moments): another model. Freeze them (requires_grad=False), leave them out of the optimizer, or use"
                " zero_stage 0 or 3."
            )

    def _reduce_unbucketed(self, params: list[nn.Parameter]) -> None:
        """Stage 0: the gradients of ``params`` (in no bucket; a rank without one contributes zeros) averaged over
        the group in one all-reduce, as a bucket's."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        for p, piece in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = piece.view_as(p)

    def clear(self) -> None:
        """Gradients to ``None`` (``zero_grad``); the buffers keep their memory and are written fresh by the
        next window. Under a pipeline, Lightning's ``zero_grad`` comes after the schedule's backward passes:
        the gradients of the window are kept in the buckets."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        for p in self._unbucketed():  # as the optimizer's own zero_grad would
            p.grad = None

    def refuse_assigned(self) -> None:
        """Stages 1-2, before the step: a ``p.grad`` that is no longer the placeholder `wait` left (assigned in a
        hook: ``p.grad = ...``) would be ignored by the step of the slices: ``RuntimeError`` naming it."""
        assigned = [self._name(p) for b in self.buckets for p in b.params
                    if p.grad is not None and not isinstance(p.grad, ShardedGradient)]
        if assigned:
            raise RuntimeError(
                f"zero_stage={self.stage}: p.grad of {assigned} was assigned after the gradients were reduced; the"
                " optimizer steps the reduced slices, so the assigned gradient would be ignored: another model than"
                " one device. Change gradients element-wise in on_after_backward before the window's last backward"
                " is reduced, or use zero_stage 0 or 3, where p.grad is what the optimizer steps."
            )

    def _name(self, p: Tensor) -> str:
        """``p``'s name, for errors."""
        return self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")

    def _unbucketed(self) -> list[Tensor]:
        """What the optimizer steps that no bucket holds (stages 1-2: besides the slices)."""
        return [p for p in self.stepped() if id(p) not in self._bucketed]

    def remove(self) -> None:
        """Detach the hooks from the parameters (the optimizer is done with)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
