"""`ZeroOptimizer`: the user's optimizer over ZeRO 0-2's gradient buckets (`lightning_hybrid.parallel.zero.buckets`).

Stage 0 steps the model's parameters; stages 1-2 re-point the optimizer at this rank's slice of each bucket and
all-gather the updated slices after the step (or start the gathers for the next forward to wait on:
`lightning_hybrid.parallel.zero.gather.ParameterGathers`). `SlicePlace` says where a parameter's sliced optimizer
state lives (what checkpoints save and load); `check_elementwise` keeps stages 1-2 to optimizers that update element
by element (`ELEMENTWISE_OPTIMIZERS`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid.parallel.zero.buckets import DEFAULT_BUCKET_CAP_MB, GradientBuckets, _Bucket, _layout
from lightning_hybrid.parallel.zero.gather import ParameterGathers

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


class ZeroOptimizer(Optimizer):
    """Wraps the user's optimizer for ZeRO stage 0, 1 or 2 over the DP ``group``, on gradient buckets.

    The user's optimizer object is kept (LR schedulers hold it). Stage 0 leaves its param groups as they are;
    stages 1-2 re-point them at this rank's bucket slices, keeping every hyper-parameter. ``tp_sharded`` holds
    the ids of parameters that are TP shards, kept in other buckets than replicated ones so the gradient norm
    can count each once. ``bucket_cap_mb``: the size cap of one bucket. ``names``: id(parameter) -> name, for
    errors. Stages 1-2 take element-wise optimizers only (`check_elementwise`). ``experts``: the ids of expert
    parameters (`lightning_hybrid.parallel.expert_parallel`) and their own data-parallel group: they are bucketed
    apart and reduced (stages 1-2: sharded) over that group, their sum divided by the size of ``group`` all the same.
    ``gathers``: where stages 1-2 start the all-gathers of the updated slices when it is ``deferring``
    (`lightning_hybrid.parallel.zero.gather`; else they are waited for in the step).
    """

    def __init__(
        self, optimizer: Optimizer, group: dist.ProcessGroup, stage: int, tp_sharded: set[int],
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, names: dict[int, str] | None = None,
        experts: tuple[set[int], dist.ProcessGroup] | None = None, gathers: ParameterGathers | None = None,
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
        self.gathers = gathers if gathers is not None else ParameterGathers()
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[_Bucket] = []
        for param_group in optimizer.param_groups:
            params = _unique(param_group["params"])
            trainable = [p for p in params if p.requires_grad]
            expert_ids, expert_group = experts if experts is not None else (set(), group)
            dp = dist.get_world_size(group)
            # The key is called within this iteration (by `_layout`), so it sees this group's `expert_ids`.
            group_buckets = [
                _Bucket(ps, expert_group if id(ps[0]) in expert_ids else group, stage, id(ps[0]) in tp_sharded, dp)
                for ps in _layout(trainable, cap,
                                  lambda p: (p.dtype, p.device, id(p) in tp_sharded, id(p) in expert_ids),  # noqa: B023
                                  stage)
            ]
            self.buckets.extend(group_buckets)
            if stage:
                param_group["params"] = [b.shard for b in group_buckets] + [p for p in params if not p.requires_grad]
        self.gradients = GradientBuckets(self.buckets, group, stage, names,
                                         lambda: _unique(p for g in optimizer.param_groups for p in g["params"]))
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
        if self.stage:
            self.gradients.refuse_assigned()
            self.gathers.wait_all()  # the last step's gathers read the slices this step writes
        self.optimizer.step()
        if self.stage:
            if self.gathers.deferring:  # under the next forward, the bucket it needs first (the last) first
                order = self.buckets[::-1]
                self.gathers.queue([b.start_gather for b in order], [b.params for b in order])
            else:
                for bucket in self.buckets:
                    bucket.gather_parameters()
            self.gradients.clear()  # the placeholders (`ShardedGradient`) go
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gradients.clear()
        for bucket in self.buckets:
            # Under a pipeline Lightning's zero_grad follows the schedule, whose stages' last backward passes may
            # have reduced a bucket into its slice already: that slice's gradient is this window's.
            if self.stage and not self.gradients.started(bucket):
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


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
