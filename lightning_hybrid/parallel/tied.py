"""Parameters shared by several modules (an LM head tied to the token embedding), found by identity and kept tied
under every layout.

`shared_parameters` lists every Parameter that ``named_parameters(remove_duplicate=False)`` names more than once,
before any dimension is applied. What each dimension then does with them:

* TP splits the modules of a group alike and points them at one split Parameter
  (`lightning_hybrid.parallel.tensor_parallel.apply`), or refuses by name;
* PP: where a group's modules land on different pipeline stages, each rank holding one gets its own copy
  (`TiedAcrossStages`). The copies start equal (`broadcast_tied`, from the first holder) and stay so: after the
  schedule's backward, each copy's gradient is the sum over the holders (`sum_tied_grads`, before the DP
  reduction: both are sums), so every holder steps the same update -- one device's, whose single parameter
  collects the gradient of both uses. Norms count it once (the first holder's), under its first name;
* ZeRO-3: a group must lie in one FSDP unit (`lightning_hybrid.parallel.zero.apply_fsdp`): units that hold part of a
  group are left to their root, and roots that would split a group are refused by name;
* ZeRO 0-2 put the one Parameter in one bucket (the optimizer sees it once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["TiedAcrossStages", "broadcast_tied", "shared_parameters", "sum_tied_grads", "ties_across_stages"]


def shared_parameters(module: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names of one Parameter, each in ``named_parameters`` order (its first name is the one
    ``named_parameters()`` gives, and one device's ``parameter_grad_norms`` with it)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


@dataclass(frozen=True)
class TiedAcrossStages:
    """One group of `shared_parameters` whose modules lie on different pipeline ranks. ``holders``: those PP ranks
    (ascending); ``local``: this rank's name of its copy (``None``: it holds none); ``shape``/``dtype``: the
    parameter's."""

    names: tuple[str, ...]
    holders: tuple[int, ...]
    local: Optional[str]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        """The name one device gives it (its first)."""
        return self.names[0]

    def counted_here(self, pp_rank: int) -> bool:
        """Whether this rank's copy counts in norms (the first holder's)."""
        return pp_rank == self.holders[0]


def ties_across_stages(
    module: nn.Module, groups: Sequence[tuple[str, ...]], layer_names: Sequence[str], owner_of_layer: Sequence[int],
    pp_rank: int,
) -> list[TiedAcrossStages]:
    """The groups whose names lie in pipeline layers of different PP ranks (``layer_names[i]``: layer ``i``'s name in
    the module tree, held by PP rank ``owner_of_layer[i]``), read before the cut (``module`` still names every
    parameter). A name outside every layer is left to the pipeline's own check (every parameter in one layer)."""
    ties = []
    for names in groups:
        ranks = {}
        for name in names:
            layer = next((i for i, prefix in enumerate(layer_names) if name.startswith(prefix + ".")), None)
            if layer is not None:
                ranks[name] = owner_of_layer[layer]
        holders = tuple(sorted(set(ranks.values())))
        if len(holders) > 1:
            p = module.get_parameter(names[0])
            local = next((n for n in names if ranks.get(n) == pp_rank), None)
            ties.append(TiedAcrossStages(tuple(names), holders, local, tuple(p.shape), p.dtype))
    return ties


def _buffer(tie: TiedAcrossStages, module: nn.Module, device: torch.device,
            grad_of: Optional[Callable[[nn.Parameter], Optional[Tensor]]]) -> tuple[Tensor, bool]:
    """This rank's copy (or with ``grad_of`` its gradient's local part), or zeros of its shape where it holds none or
    no gradient; and whether it is this rank's own tensor."""
    if tie.local is not None:
        p = module.get_parameter(tie.local)
        t = grad_of(p) if grad_of is not None else p.data
        if t is not None:
            t = getattr(t, "_local_tensor", t)
            return t, True
        shape = getattr(p, "_local_tensor", p).shape
        return torch.zeros(shape, dtype=tie.dtype, device=device), False
    return torch.zeros(tie.shape, dtype=tie.dtype, device=device), False


def broadcast_tied(ties: Sequence[TiedAcrossStages], module: nn.Module, pp_group: dist.ProcessGroup,
                   device: torch.device) -> None:
    """Every holder's copy set to the first holder's (collective over the PP group, before any sharding)."""
    for tie in ties:
        value, _ = _buffer(tie, module, device, None)
        dist.broadcast(value, group_src=tie.holders[0], group=pp_group)


def sum_tied_grads(ties: Sequence[TiedAcrossStages], module: nn.Module, pp_group: dist.ProcessGroup,
                   device: torch.device, grad_of: Callable[[nn.Parameter], Optional[Tensor]] = lambda p: p.grad,
                   ) -> None:
    """Each copy's gradient -- where ``grad_of`` finds it: the ``.grad``, or a gradient bucket's view -- becomes the
    sum of every holder's (collective over the PP group; every rank takes part, with zeros where it holds no copy).
    A copy without a gradient gets one where any holder has one."""
    for tie in ties:
        grad, own = _buffer(tie, module, device, grad_of)
        dist.all_reduce(grad, group=pp_group)
        if tie.local is not None and not own:
            p = module.get_parameter(tie.local)
            if not hasattr(p, "_local_tensor"):
                p.grad = grad
