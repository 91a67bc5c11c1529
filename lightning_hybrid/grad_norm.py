"""The global gradient norm across TP shards and ZeRO shards, and clipping by it.

Each local gradient is tagged with whether it is a TP shard (its squares are summed over the TP group) and
whether it is a DP shard (summed over the DP group); a replicated gradient is counted once. The result is
the norm of the one-device gradient, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid.core.devices import local_tensor


def _sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """``sum(t**2)`` over ``tensors`` (one device and dtype), float32: one fused norm kernel on an accelerator; on the
    CPU an element-wise square and a sum per tensor, since the CPU's norm kernel loses precision with size (1e-5
    relative at a million elements, where the sum's cascade keeps 1e-7)."""
    if tensors[0].device.type == "cpu":
        return torch.stack([t.float().pow(2).sum() for t in tensors]).sum()
    return torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()


@torch.no_grad()
def global_grad_norm(
    grads: Sequence[tuple[Tensor, bool, bool]],
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """L2 norm of the full gradient. ``grads``: ``(grad, is_tp_shard, is_dp_shard[, is_ep_shard])``; pipeline
    stages hold disjoint parameters, so the squares are summed over ``pp_group`` too, and those of expert shards
    that are not DP shards (this rank's experts, replicated over their own DP group) over ``ep_group``.
    Collective over all the groups.
    ``device``: where the sums live and are reduced (the rank's device; default: the gradients'), so that a rank
    without gradients takes part on the right device.

    Returns a float32 scalar on ``device``, identical on every rank of the groups; no host synchronisation.
    """
    if device is None:
        device = local_tensor(grads[0][0]).device if grads else torch.device("cpu")
    # sums[tp_shard][0: replicated, 1: dp shard, 2: ep shard], by kind, device and dtype.
    sums = torch.zeros(2, 3, dtype=torch.float32, device=device)
    kinds: dict[tuple[int, int, torch.dtype, torch.device], list[Tensor]] = {}
    for grad, tp_shard, dp_shard, *ep in grads:
        local = local_tensor(grad).detach()
        column = 1 if dp_shard else (2 if ep and ep[0] else 0)
        kinds.setdefault((int(tp_shard), column, local.dtype, local.device), []).append(local)
    for (tp_shard, column, _, _), tensors in kinds.items():
        sums[tp_shard, column] += _sum_of_squares(tensors).to(device)
    for column, group in ((1, dp_group), (2, ep_group)):
        if group is not None and dist.get_world_size(group) > 1:
            sharded = sums[:, column].contiguous()
            dist.all_reduce(sharded, group=group)
            sums[:, column] = sharded
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        tp_sharded = sums[1].contiguous()
        dist.all_reduce(tp_sharded, group=tp_group)
        sums[1] = tp_sharded
    total = sums.sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(grads: Sequence[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale ``grads`` in place as ``torch.nn.utils.clip_grad_norm_`` does, given the global ``total_norm``
    (one fused multiply per device and dtype; no host synchronisation)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    kinds: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for grad in grads:
        local = local_tensor(grad)
        kinds.setdefault((local.dtype, local.device), []).append(local)
    for (dtype, device), tensors in kinds.items():
        torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))


@torch.no_grad()
def parameter_grad_norms(
    pieces: dict[str, list[Tensor]],
    tp_sharded: set[str],
    dp_sharded: set[str],
    tp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
    ep_sharded: set[str] | frozenset[str] = frozenset(),
    ep_group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """The L2 norm of each parameter's whole gradient, by name, from this rank's pieces of it (``pieces``: name ->
    local tensors; DTensors by their local shard): the squares of a TP shard are summed over ``tp_group``, of a
    DP shard (ZeRO 1-2 slices, ZeRO-3 shards) over ``dp_group``; a replicated piece is this rank's own copy, so a
    rank whose copy differs shows it. Every rank of a TP or DP group must list the same names (they hold the same
    parameters); the squares of an expert shard that is not a DP shard over ``ep_group``. Collective over the
    groups; float32 scalars on ``device``, no host synchronisation."""
    names = sorted(pieces)
    squares = torch.zeros(len(names), dtype=torch.float32, device=device)
    for i, name in enumerate(names):
        if pieces[name]:
            squares[i] = _sum_of_squares([local_tensor(t).detach() for t in pieces[name]]).to(device)
    ep_only = set(ep_sharded) - set(dp_sharded)
    for group, sharded in ((dp_group, dp_sharded), (ep_group, ep_only), (tp_group, tp_sharded)):
        if group is None or dist.get_world_size(group) == 1:
            continue
        mask = torch.tensor([n in sharded for n in names], dtype=torch.bool, device=device)
        summed = torch.where(mask, squares, torch.zeros_like(squares))
        dist.all_reduce(summed, group=group)
        squares = torch.where(mask, summed, squares)
    return dict(zip(names, squares.sqrt().unbind()))
