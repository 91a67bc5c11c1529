"""The tensors of a checkpoint, in the one order that saving and loading share.

Keys are unsplit (``model/<name>``, ``optim/<i>/<name>/<state>``); `owner_of` picks the one replica that writes
a key. `_save_plan` lists a rank's tensors with their unsplit shapes and `_unsplit_tensors` yields them one at a
time (gathering TP pieces, ZeRO-3 shards and ZeRO-1/2 bucket slices); `_parts` cuts them into parts of at most a
budget of bytes.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.core.protocol import checkpoint_excludes
from lightning_hybrid.parallel.tensor_parallel.layers import unsplit, unsplit_shape


def owner_of(key: str, holders: int) -> int:
    """Which of ``holders`` replicas writes ``key`` (stable across processes and Python runs)."""
    return zlib.crc32(key.encode()) % holders


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


# Saving and loading go through the tensors in one order that every rank holding them shares (the model's
# state dict, then each optimizer's state: ZeRO-1/2 bucket by bucket), in parts of at most ``budget`` unsplit
# bytes: a rank holds the rank's own state plus one part (and the one tensor being gathered) at any time.
def _optimizer_entries(optimizer, module: nn.Module) -> list[tuple[str, nn.Parameter, list[str], Any]]:
    """``(parameter name, model parameter, state keys, SlicePlace or None)`` for each parameter of ``optimizer``
    that has state, in bucket order for ZeRO-1/2 (whose state is per bucket slice: `ZeroOptimizer.slice_places`)."""
    names = _param_names(module)
    if _slices_state(optimizer):
        return [
            (names[id(p)], p, sorted(optimizer.state.get(place.shard, {})), place)
            for p, place in optimizer.slice_places() if optimizer.state.get(place.shard)
        ]
    return [
        (names[id(p)], p, sorted(optimizer.state[p]), None)
        for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)
    ]


def _slices_state(optimizer) -> bool:
    from lightning_hybrid.parallel.zero import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state


def model_state(module: nn.Module) -> dict[str, Tensor]:
    """The model tensors a checkpoint of ``module`` holds: its state dict but what it rebuilds itself
    (`lightning_hybrid.core.protocol.RebuiltInCheckpoints`)."""
    skip = checkpoint_excludes(module)
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in skip}


def _save_plan(module: nn.Module, optimizers: list, specs: dict) -> list[tuple[str, list[int], torch.dtype]]:
    """``(key, unsplit shape, dtype)`` of every tensor this rank saves, in the shared order (no communication)."""
    out = [(f"model/{n}", unsplit_shape(n, t, specs), t.dtype) for n, t in model_state(module).items()]
    for index, optimizer in enumerate(optimizers):
        for name, param, keys, place in _optimizer_entries(optimizer, module):
            state = optimizer.state[place.shard if place is not None else param]
            for key in keys:
                value = state[key]
                if torch.is_tensor(value):
                    shape = unsplit_shape(name, param, specs) if value.dim() > 0 else []
                    out.append((f"optim/{index}/{name}/{key}", shape, value.dtype))
    return out


def _unsplit_tensors(module: nn.Module, optimizers: list, specs: dict):
    """The unsplit tensors of `_save_plan`, in its order, one at a time (collective over the ranks that hold
    them: TP gathers, ZeRO-3 full tensors, ZeRO-1/2 bucket state gathered over DP one bucket at a time)."""
    for name, tensor in model_state(module).items():
        yield unsplit(name, tensor, specs)
    for optimizer in optimizers:
        gathered_shard, gathered = None, {}
        for name, param, keys, place in _optimizer_entries(optimizer, module):
            if place is None:
                state = optimizer.state[param]
                for key in keys:
                    if torch.is_tensor(state[key]):
                        # scalars (step) are not split
                        yield unsplit(name, state[key], specs if state[key].dim() > 0 else {})
                continue
            state = optimizer.state[place.shard]
            if place.shard is not gathered_shard:  # this bucket's slices of every rank, once per bucket
                gathered_shard, gathered = place.shard, {}
                for key, value in state.items():
                    if torch.is_tensor(value) and value.shape == place.shard.shape:
                        flat = value.new_empty(place.size)
                        dist.all_gather_single(flat, value.contiguous(), group=place.group)
                        gathered[key] = flat
            for key in keys:
                value = state[key]
                if not torch.is_tensor(value):
                    continue
                if key in gathered:
                    value = gathered[key][place.start : place.start + param.numel()].view_as(param)
                yield unsplit(name, value, specs if value.dim() > 0 else {})


def _parts(plan: list[tuple[str, list[int], torch.dtype]], budget: int) -> dict[str, int]:
    """Cut the ordered tensors into consecutive parts of at most ``budget`` bytes (a larger tensor alone)."""
    part_of, part, size = {}, 0, 0
    for key, shape, dtype in plan:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if size and size + nbytes > budget:
            part, size = part + 1, 0
        part_of[key] = part
        size += nbytes
    return part_of


def _param_of(key: str) -> str:
    """``model/<name>`` and ``optim/<i>/<name>/<state>`` -> ``<name>``."""
    return key[len("model/"):] if key.startswith("model/") else key.split("/", 2)[2].rsplit("/", 1)[0]


def _own(tensor: Tensor) -> Tensor:
    """``tensor`` with a storage of its own (not a view that would keep a larger buffer alive)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


def _group_settings(optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
