"""Peak memory during training steps: the bytes of live tensors per rank, at their highest, by kind.

`LiveTensorTracker` is a ``TorchDispatchMode`` that follows every tensor storage an op creates from allocation
to release (a finalizer on the storage; ``UntypedStorage.resize_``, with which FSDP2 frees and re-allocates
its gathered parameters, is followed too) and keeps the running total per kind and the breakdown at the
highest total. `PeakMemoryMonitor` runs it, as a Lightning callback, from the strategy's setup (so what the
model's construction and the strategy allocate -- shards, gradient buckets, Lightning DDP's reducer buffers --
is known) and during the first ``steps`` training batches (the tracker costs Python time per op). The kinds:

* ``parameters``, ``buffers``: the module's (TP and ZeRO shards, pipeline stage: whatever the rank holds);
* ``gradients``: ``.grad`` tensors and the gradient buckets they are views of (a bucket counts while its
  gradients are ``None`` between steps);
* ``optimizer_state``: Adam's moments, ...;
* ``activations``: what the forward allocates (kept for backward, or in flight);
* ``temporary``: what the backward allocates beyond the above (activation gradients, communication buffers,
  gathered parameters' gradients, ...), and ``optimizer_step``: what the optimizer step allocates (clipping,
  the update's temporaries, ZeRO's parameter gather; in the first step, the optimizer's state as it is made);
* ``other``: what the strategy's setup allocated that is none of the above.

Unlike the process's resident size it is the same on CPU and CUDA and not blurred by the allocator's caches.
On CUDA, ``torch.cuda.max_memory_allocated`` over the same steps is recorded beside it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from lightning_hybrid.parallel.zero import ShardedGradient

__all__ = ["KINDS", "LiveTensorTracker", "PeakMemory", "PeakMemoryMonitor", "rank_state"]

KINDS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporary", "optimizer_step", "other")


def _storages(t: Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t`` (a wrapper subclass such as DTensor: those of its inner tensors; ZeRO 1-2's
    placeholder gradient, `lightning_hybrid.parallel.zero.ShardedGradient`: none)."""
    if isinstance(t, ShardedGradient):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names if isinstance(inner := getattr(t, name), Tensor) for s in _storages(inner)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # meta, sparse, ...: nothing allocated here
        return []


class LiveTensorTracker(TorchDispatchMode):
    """Live tensor bytes by kind while active, and the breakdown at their highest total (``peak``,
    ``peak_breakdown``; `reset_peak` starts a new window). New storages get ``kind`` (settable); `label`
    (re)names the kind of existing tensors, and follows them if they were created elsewhere."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.kind = "other"
        self.totals = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = 0
        self.peak_breakdown = dict(self.totals)
        self._live: dict[int, list] = {}  # storage address -> [bytes, kind]
        self._resize = None

    def _follow(self, storage: torch.UntypedStorage, kind: str) -> None:
        if storage.device.type != self.device_type:
            return
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            if entry[1] != kind:
                self.totals[entry[1]] -= entry[0]
                self.totals[kind] += entry[0]
                entry[1] = kind
            return
        nbytes = storage.nbytes()
        self._live[key] = entry = [nbytes, kind]
        self.totals[kind] += nbytes
        self.total += nbytes
        weakref.finalize(storage, self._release, key, entry)
        self._update_peak()

    def _release(self, key: int, entry: list) -> None:
        if self._live.get(key) is entry:
            del self._live[key]
            self.totals[entry[1]] -= entry[0]
            self.total -= entry[0]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(storage._cdata)
        if entry is not None and entry[0] != storage.nbytes():
            change = storage.nbytes() - entry[0]
            entry[0] += change
            self.totals[entry[1]] += change
            self.total += change
            self._update_peak()

    def _update_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.totals)

    def label(self, tensors: Iterable[Optional[Tensor]], kind: str) -> None:
        for t in tensors:
            if isinstance(t, Tensor):
                for storage in _storages(t):
                    self._follow(storage, kind)

    def reset_peak(self) -> None:
        self.peak, self.peak_breakdown = self.total, dict(self.totals)

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # FSDP2 frees and re-gathers parameters with it
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                for storage in _storages(t):
                    self._follow(storage, self.kind) if storage._cdata not in self._live else self._resized(storage)
        return out


@dataclass
class PeakMemory:
    """One rank's peak of live tensor bytes over the measured steps, and its breakdown (bytes, `KINDS`);
    ``step_peaks`` the peak of each measured step, ``after_step`` the live bytes by kind when the last of them
    ended (what a step leaves, beside what it needs at its peak)."""

    total: int = 0
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    cuda_max_allocated: Optional[int] = None
    steps: int = 0
    step_peaks: list[int] = field(default_factory=list)
    after_step: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def mib(self) -> dict[str, Any]:
        """The same in MiB (rounded to 0.001), flat: ``{"total": ..., "parameters": ..., ...}``."""
        out: dict[str, Any] = {"total": round(self.total / 2**20, 3)}
        out.update({k: round(v / 2**20, 3) for k, v in self.breakdown.items()})
        if self.cuda_max_allocated is not None:
            out["cuda_max_allocated"] = round(self.cuda_max_allocated / 2**20, 3)
        return out


def _gradient_buffers(optimizers: list) -> list[Tensor]:
    """The gradient buckets of the strategy's ZeRO 0-2 optimizers (views of which are the ``.grad``)."""
    from lightning_hybrid.parallel.zero import ZeroOptimizer

    return [t for o in optimizers if isinstance(o, ZeroOptimizer) for t in o.gradient_buffers()]


def _optimizer_state(optimizers: list) -> list[Tensor]:
    return [v for o in optimizers for state in o.state.values() for v in state.values() if isinstance(v, Tensor)]


def rank_state(module: torch.nn.Module, optimizers: list) -> list[Tensor]:
    """What a rank holds between steps: parameters, buffers, gradients (and their buckets), optimizer state."""
    return [
        *module.parameters(), *module.buffers(), *(p.grad for p in module.parameters() if p.grad is not None),
        *_gradient_buffers(optimizers), *_optimizer_state(optimizers),
    ]


class PeakMemoryMonitor(Callback):
    """Measures the peak bytes of live tensors per rank during the first ``steps`` training batches (each from
    its start to the end of its optimizer step). After ``fit``, ``peak`` is this rank's `PeakMemory` (the highest
    step) and ``per_rank`` every rank's (gathered; a list indexed by global rank)."""

    def __init__(self, steps: int = 3) -> None:
        if not (isinstance(steps, int) and steps >= 1):
            raise ValueError(f"steps={steps!r} is invalid: measure at least one training step.")
        self.steps = steps
        self.peak = PeakMemory()
        self.per_rank: list[PeakMemory] = []
        self._tracker: Optional[LiveTensorTracker] = None
        self._active = False
        self._hooks: list = []

    def _enter(self) -> None:
        assert self._tracker is not None
        self._tracker.__enter__()
        self._active = True

    def _exit(self) -> None:
        if self._active:
            assert self._tracker is not None
            self._tracker.__exit__(None, None, None)
            self._active = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._tracker is None:
            self._tracker = LiveTensorTracker(trainer.strategy.root_device.type)
            self._enter()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()

    def _label(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tracker = self._tracker
        assert tracker is not None
        tracker.label(pl_module.parameters(), "parameters")
        tracker.label(pl_module.buffers(), "buffers")
        tracker.label((p.grad for p in pl_module.parameters()), "gradients")
        tracker.label(_gradient_buffers(trainer.optimizers), "gradients")
        tracker.label(_optimizer_state(trainer.optimizers), "optimizer_state")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.peak.steps >= self.steps:
            return
        if self._tracker is None:
            self._tracker = LiveTensorTracker(trainer.strategy.root_device.type)
        tracker = self._tracker
        self._label(trainer, pl_module)
        # A gradient is named as soon as autograd has put it in place (after the strategy's own hooks).
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p: tracker.label([p.grad], "gradients"))
            for p in pl_module.parameters() if p.requires_grad
        ]
        tracker.kind = "activations"
        tracker.reset_peak()
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self._enter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._active and self._tracker is not None:
            self._tracker.kind = "temporary"

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._active and self._tracker is not None:
            self._tracker.label((p.grad for p in pl_module.parameters()), "gradients")
            self._tracker.kind = "optimizer_step"

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
    ) -> None:
        if not self._active:
            return
        self._exit()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        tracker = self._tracker
        assert tracker is not None
        tracker.label(_optimizer_state(trainer.optimizers), "optimizer_state")  # created by the first step
        self.peak.steps += 1
        self.peak.step_peaks.append(tracker.peak)
        self.peak.after_step = dict(tracker.totals)
        if tracker.peak > self.peak.total:
            self.peak.total, self.peak.breakdown = tracker.peak, dict(tracker.peak_breakdown)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self.peak.cuda_max_allocated = max(self.peak.cuda_max_allocated or 0,
                                               torch.cuda.max_memory_allocated(device))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, asdict(self.peak))
            self.per_rank = [PeakMemory(**g) for g in gathered]
        else:
            self.per_rank = [self.peak]
