"""ZeRO over the data-parallel dimension.

* stage 0 (`allreduce_gradients`): DDP semantics; one all-reduce of all gradients per optimizer step.
* stages 1 and 2 (`ZeroOptimizer`): the parameters of each optimizer param group are laid out in one flat
  buffer per (dtype, TP-sharded or not); each DP rank owns a contiguous 1/dp slice of it, and the user's
  optimizer is re-pointed at those slices, so its state (Adam's moments ...) is 1/dp per rank.
  Stage 1 all-reduces the gradients (each rank keeps the full, reduced gradients: Psi) and steps its
  slice; stage 2 reduce-scatters them into the slice and frees the full ones (Psi/dp). Both then
  all-gather the updated slices into the flat buffer, which the model's parameters are views of.
* stage 3 (`apply_fsdp`): FSDP2 (`fully_shard`) over the DP sub-mesh; parameters, gradients and optimizer
  state are all 1/dp, parameters are gathered per layer for forward and backward.

Gradients are reduced once per optimizer step: the strategy calls the reduction after the last backward
of an accumulation window. Element-wise optimizers (SGD, Adam, AdamW, ...) give exactly the one-device
update on the flat slices; an optimizer that looks across a whole tensor (LAMB, Adafactor, Shampoo) does not.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer


@torch.no_grad()
def allreduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """ZeRO-0: average ``.grad`` of ``params`` over ``group`` with one all-reduce of one flat buffer.

    A parameter that has no gradient on every rank keeps ``grad=None`` (the optimizer then skips it, as on one
    device); one with a gradient on some ranks gets the average with zeros from the others.
    """
    params = [p for p in _unique(params) if p.requires_grad]
    world = dist.get_world_size(group)
    if world == 1 or not params:
        return
    ref = next((p.grad for p in params if p.grad is not None), params[0])
    present = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(ref.dtype) for p in params] + [present])
    dist.all_reduce(flat, group=group)
    grads, present = flat[: -len(params)], flat[-len(params):]
    grads.div_(world)
    offset = 0
    for p, seen in zip(params, present.tolist()):
        n = p.numel()
        p.grad = grads[offset : offset + n].view_as(p).to(p.dtype) if seen else None
        offset += n


class _FlatBucket:
    """Parameters of one param group (one dtype, one TP category) in one flat buffer, 1/dp of it owned here.

    ``flat``: ``[padded]``, the model's parameters are views of it; ``shard``: this rank's ``[padded/dp]`` slice,
    a Parameter the user's optimizer steps.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, tp_sharded: bool):
        self.params, self.group, self.tp_sharded = params, group, tp_sharded
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        total = sum(p.numel() for p in params)
        padded = -(-total // world) * world
        self.flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            n = p.numel()
            self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + n].view_as(p)
            offset += n
        size = padded // world
        self.lo, self.hi = rank * size, (rank + 1) * size
        self.shard = nn.Parameter(self.flat[self.lo : self.hi])

    def flat_grad(self) -> Tensor:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        pad = self.flat.numel() - sum(g.numel() for g in grads)
        return torch.cat(grads + [self.flat.new_zeros(pad)])

    @torch.no_grad()
    def reduce_gradients(self, stage: int) -> None:
        world = dist.get_world_size(self.group)
        flat_grad = self.flat_grad()
        if stage == 1:
            dist.all_reduce(flat_grad, group=self.group)
            flat_grad.div_(world)
            offset = 0
            for p in self.params:
                p.grad = flat_grad[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.shard.grad = flat_grad[self.lo : self.hi]
        else:
            shard_grad = flat_grad.new_empty(self.hi - self.lo)
            dist.reduce_scatter_single(shard_grad, flat_grad, group=self.group)
            self.shard.grad = shard_grad.div_(world)
            for p in self.params:
                p.grad = None

    @torch.no_grad()
    def gather_parameters(self) -> None:
        dist.all_gather_single(self.flat, self.shard.detach().clone(), group=self.group)


class ZeroOptimizer(Optimizer):
    """Wraps the user's optimizer for ZeRO stage 1 or 2 over the DP ``group``.

    The user's optimizer object is kept (LR schedulers hold it): its param groups are re-pointed at this
    rank's flat slices and keep every hyper-parameter. ``tp_sharded`` holds the ids of parameters that are
    TP shards, which are kept apart from replicated ones so the gradient norm can count each once.
    """

    def __init__(self, optimizer: Optimizer, group: dist.ProcessGroup, stage: int, tp_sharded: set[int]):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements zero_stage 1 and 2, got {stage}.")
        if optimizer.state:
            raise ValueError("ZeroOptimizer must wrap a fresh optimizer (its state is not empty).")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.buckets: list[_FlatBucket] = []
        for param_group in optimizer.param_groups:
            by_kind: dict[tuple, list[nn.Parameter]] = defaultdict(list)
            frozen = []
            for p in _unique(param_group["params"]):
                if p.requires_grad:
                    by_kind[(p.dtype, p.device, id(p) in tp_sharded)].append(p)
                else:
                    frozen.append(p)
            group_buckets = [_FlatBucket(ps, group, kind[2]) for kind, ps in by_kind.items()]
            self.buckets.extend(group_buckets)
            param_group["params"] = [b.shard for b in group_buckets] + frozen
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    def reduce_gradients(self) -> None:
        """Reduce the accumulated gradients over DP into this rank's slices (collective over the DP group)."""
        for bucket in self.buckets:
            bucket.reduce_gradients(self.stage)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None

    def grad_shards(self) -> list[tuple[Tensor, bool]]:
        """``(slice gradient, is a TP shard)`` for each bucket that has a gradient: the slices cover the
        reduced gradient exactly once over the DP group."""
        return [(b.shard.grad, b.tp_sharded) for b in self.buckets if b.shard.grad is not None]

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, {self.optimizer!r})"


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh) -> list[nn.Module]:
    """ZeRO-3: ``fully_shard`` every layer of ``module`` (the elements of its ``nn.ModuleList``s), then each of
    its direct children that holds parameters. Returns those children: the FSDP roots.

    Parameters held directly by ``module`` itself cannot be sharded this way and are an error.
    """
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"zero_stage=3 shards parameters per submodule, but {type(module).__name__} holds {direct} directly."
            " Move them into a submodule (e.g. an nn.Module attribute)."
        )
    layers = [layer for sub in module.modules() if isinstance(sub, nn.ModuleList) for layer in sub]
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    return [apply_fsdp_units([layer for layer in layers if _holds(layer, root)], root, dp_mesh) for root in roots]


def apply_fsdp_units(units: list[nn.Module], root: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each unit that has parameters (gathered one at a time), then ``root`` (the rest)."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        if any(True for _ in unit.parameters()):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=True)
    return root


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
