"""Loading: `load_sharded` reads a checkpoint written under any layout into the live (parallelised) model and its
optimizers, part by part, each rank taking its own pieces and slices (`_read_parts` reads the parts).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from lightning_hybrid.checkpoint.folders import CheckpointError, _part_dir, read_meta, verify_files
from lightning_hybrid.checkpoint.tensors import _own, _param_names, _slices_state
from lightning_hybrid.core.devices import local_tensor
from lightning_hybrid.core.protocol import checkpoint_excludes
from lightning_hybrid.parallel.tensor_parallel.layers import (
    load_full_state_dict,
    local_piece,
    tp_shard_specs,
    unsplit_shape,
)


def check_model_fits(saved: dict[str, list[int]], expected: dict[str, list[int]],
                     rebuilt: frozenset[str] = frozenset()) -> None:
    """Compare the checkpoint's tensors with the model's (unsplit names and shapes; those in ``rebuilt`` the model
    gives itself: a checkpoint may lack them); ``CheckpointError``."""
    missing = sorted(set(expected) - set(saved) - rebuilt)
    unexpected = sorted(set(saved) - set(expected))
    mis_shaped = {k: (saved[k], expected[k]) for k in sorted(set(saved) & set(expected))
                  if list(saved[k]) != list(expected[k])}
    if missing or unexpected or mis_shaped:
        details = []
        if missing:
            details.append(f"missing keys {missing[:10]}")
        if unexpected:
            details.append(f"unexpected keys {unexpected[:10]}")
        if mis_shaped:
            details.append("mis-shaped keys " + ", ".join(f"{k}: checkpoint {a} vs model {b}"
                                                          for k, (a, b) in list(mis_shaped.items())[:10]))
        raise CheckpointError("The checkpoint is of another model: " + "; ".join(details) + ".")


def _read_parts(path: Path, meta: dict, keys: Iterable[str], no_dist: bool = False):
    """Read ``keys`` part by part: yields ``{key: tensor}`` for each part of the checkpoint (possibly empty;
    every rank goes through every part, as DCP's load is collective)."""
    tensors = meta["lightning_hybrid"]["tensors"]
    parts = 1 + max((part for part, _, _ in tensors.values()), default=-1)
    by_part: dict[int, list[str]] = {}
    for key in keys:
        by_part.setdefault(tensors[key][0], []).append(key)
    for part in range(parts):
        wanted = {key: torch.empty(tensors[key][1], dtype=tensors[key][2], device="cpu")
                  for key in by_part.get(part, [])}
        dcp.load(wanted, checkpoint_id=str(_part_dir(path, part)),
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=no_dist)
        yield wanted


def load_sharded(path: str | Path, module: nn.Module, optimizers: list) -> dict[str, Any]:
    """Load a checkpoint written under any layout into the live (parallelised) ``module`` and its ``optimizers``,
    one part at a time. Returns the Lightning checkpoint dict (loops, schedulers, ...). Collective over every
    rank; ``path`` must be the same on every rank."""
    path = Path(path)
    meta = read_meta(path, collective=True)
    verify_files(path, meta, collective=True)
    specs = tp_shard_specs(module)
    saved_shapes = meta["lightning_hybrid"]["model_shapes"]

    # The model's unsplit names and shapes, over every pipeline stage (what it rebuilds itself may be absent).
    state = module.state_dict(keep_vars=True)
    targets = {n: t for n, t in state.items() if n in saved_shapes}
    everyone: list[Any] = [None] * dist.get_world_size()
    shapes = {name: unsplit_shape(name, t, specs) for name, t in state.items()}
    dist.all_gather_object(everyone, (shapes, checkpoint_excludes(module)))
    check_model_fits(saved_shapes, {k: v for part, _ in everyone for k, v in part.items()},
                     frozenset().union(*(names for _, names in everyone)))

    saved_optimizers = meta["lightning_hybrid"]["optimizers"]
    if saved_optimizers and optimizers and len(saved_optimizers) != len(optimizers):
        raise CheckpointError(f"The checkpoint has {len(saved_optimizers)} optimizers, the module configures"
                              f" {len(optimizers)}.")
    optimizers = list(optimizers) if saved_optimizers else []  # none in a weights-only checkpoint
    places: dict[str, tuple] = {}  # key -> (optimizer, parameter name, parameter, state key, SlicePlace or None)
    saved = meta["lightning_hybrid"]["tensors"]
    for index, optimizer in enumerate(optimizers):
        for group, settings in zip(optimizer.param_groups, saved_optimizers[index]["param_groups"]):
            group.update(settings)
        for name, param, place in _optimizer_params(optimizer, module):
            prefix = f"optim/{index}/{name}/"
            for key in saved:
                if key.startswith(prefix) and "/" not in key[len(prefix):]:
                    places[key] = (optimizer, name, param, key[len(prefix):], place)
    model_keys = [f"model/{n}" for n in targets]
    for loaded in _read_parts(path, meta, [*model_keys, *places]):
        load_full_state_dict(module, {k[len("model/"):]: v for k, v in loaded.items() if k.startswith("model/")},
                             strict=False)
        for key, value in loaded.items():
            if key in places:
                _place_state(*places[key], value, specs)
    return meta


def _optimizer_params(optimizer, module: nn.Module) -> list[tuple[str, nn.Parameter, Any]]:
    """``(parameter name, model parameter, ZeRO-1/2 SlicePlace or None)`` for every parameter of ``optimizer``."""
    names = _param_names(module)
    if _slices_state(optimizer):
        return [(names[id(p)], p, place) for p, place in optimizer.slice_places()]
    return [(names[id(p)], p, None) for group in optimizer.param_groups for p in group["params"]]


def _place_state(optimizer, name: str, param: Tensor, state_key: str, place, full: Tensor, specs: dict) -> None:
    """Put one unsplit optimizer-state tensor where ``param``'s state lives on this rank: its TP (and ZeRO-3)
    piece, or for ZeRO-1/2 the part of it inside this rank's slice ``[lo, hi)`` of the bucket (``place``)."""
    if place is None:
        optimizer.state[param][state_key] = _place(name, full, param, specs)
        return
    shard = place.shard
    state = optimizer.state[shard]
    if full.dim() == 0:  # a scalar (Adam's step) shared by the bucket
        state[state_key] = full.clone().to(shard.device)
        return
    if state_key not in state:
        state[state_key] = torch.zeros(place.hi - place.lo, dtype=shard.dtype, device=shard.device)
    start = place.start
    lo, hi = max(start, place.lo), min(start + param.numel(), place.hi)
    if lo < hi:
        piece = local_piece(name, full, param, specs).reshape(-1)
        state[state_key][lo - place.lo : hi - place.lo] = piece[lo - start : hi - start].to(state[state_key].device)


def _place(name: str, full: Tensor, param: Tensor, specs: dict) -> Tensor:
    """Unsplit optimizer state -> the layout of ``param`` (scalars stay as they are)."""
    if full.dim() == 0:
        return full.to(local_tensor(param).device)
    piece = local_piece(name, full, param, specs).to(device=local_tensor(param).device, dtype=local_tensor(param).dtype)
    piece = _own(piece.contiguous())  # not a view that keeps the unsplit tensor alive with the state
    if hasattr(param, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(piece, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return piece
