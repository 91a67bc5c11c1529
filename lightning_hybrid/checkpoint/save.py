"""Saving: `save_sharded` writes the live model's and optimizers' unsplit tensors into a checkpoint folder, each
tensor by one rank, part by part, and commits it atomically; `full_state_dict` gathers the whole state dict.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from lightning_hybrid.checkpoint.folders import META_FILE, PARTIAL_MARK, _digests, _part_dir, _shard_files, commit
from lightning_hybrid.checkpoint.tensors import (
    _group_settings,
    _own,
    _param_of,
    _parts,
    _save_plan,
    _unsplit_tensors,
    owner_of,
)
from lightning_hybrid.core.dims import Meshes, after_rank_zero, barrier
from lightning_hybrid.parallel.tensor_parallel import gather_full_state_dict
from lightning_hybrid.parallel.tensor_parallel.layers import tp_shard_specs


def save_sharded(
    path: str | Path, module: nn.Module, optimizers: list, meshes: Meshes, checkpoint: dict[str, Any],
    zero_stage: int, part_bytes: int, device: torch.device,
) -> None:
    """Write ``checkpoint`` (Lightning's dict; weights and optimizer state are taken from the live ``module`` and
    ``optimizers``, parallelised over ``meshes``) to the folder ``path``, atomically, in parts of at most
    ``part_bytes`` of unsplit tensors. ``zero_stage`` and every size are recorded with the layout (the ``dp * cp``
    gradient ranks hold the same tensors: CP ranks as DP ranks do); experts are
    saved whole (an experts module's ``shard_specs`` over its EP group). Collective over every
    rank; ``path`` must be the same on every rank."""
    path = Path(path)
    first = dist.get_rank() == 0
    token = _broadcast(uuid.uuid4().hex[:12] if first else None)
    partial = path.parent / f".{path.name}{PARTIAL_MARK}{token}"
    dims = meshes.dims
    dp, tp, pp, ep, cp = meshes.size("dp_cp"), dims.tp, dims.pp, dims.ep, dims.cp
    # Replicas of a tensor across (dp, tp) of one pipeline rank: the holder that writes it.
    holders = dp * tp
    me = meshes.local_rank("dp_cp") * tp + meshes.local_rank("tp")
    specs = tp_shard_specs(module)
    # `trainer.save_checkpoint(weights_only=True)` leaves "optimizer_states" out of Lightning's dict.
    optimizers = list(optimizers) if "optimizer_states" in checkpoint else []
    plan = _save_plan(module, optimizers, specs)
    part_of = _parts(plan, part_bytes)
    parts = torch.tensor(max(part_of.values(), default=-1) + 1, device=device)
    dist.all_reduce(parts, op=dist.ReduceOp.MAX)  # every rank takes part in every part's (collective) save
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {key: (part_of[key], shape, dtype) for key, shape, dtype in plan})
    tensors = {k: v for per_rank in everyone for k, v in per_rank.items()}

    after_rank_zero(device, f"making the folders of checkpoint {path}",
                    lambda: [_part_dir(partial, part).mkdir(parents=True) for part in range(int(parts))])
    current, state = 0, {}
    for (key, _, _), tensor in zip(plan, _unsplit_tensors(module, optimizers, specs)):
        while part_of[key] > current:
            dcp.save(state, checkpoint_id=str(_part_dir(partial, current)))
            current, state = current + 1, {}
        if owner_of(_param_of(key), holders) == me:  # a parameter's weight and state: one writer
            state[key] = _own(tensor.cpu())
        del tensor
    for part in range(current, int(parts)):
        dcp.save(state, checkpoint_id=str(_part_dir(partial, part)))
        state = {}
    barrier(device)  # every shard written: their sizes and checksums
    files = _digests(partial, _shard_files(partial))

    def write_meta() -> None:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["lightning_hybrid"] = {
            "model_shapes": {k[len("model/"):]: v[1] for k, v in tensors.items() if k.startswith("model/")},
            "tensors": tensors,  # key -> (part, unsplit shape, dtype)
            "optimizers": [{"param_groups": _group_settings(o)} for o in optimizers],
            "layout": {"dp": dp // cp, "tp": tp, "pp": pp, "zero_stage": zero_stage, **({"ep": ep} if ep > 1 else {}),
                       **({"cp": cp} if cp > 1 else {})},
            "files": files,  # relative path -> (bytes, CRC-32)
        }
        torch.save(meta, partial / META_FILE)

    after_rank_zero(device, f"writing checkpoint {path}", write_meta)
    after_rank_zero(device, f"committing checkpoint {path}", lambda: commit(partial, path, token))


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    objects = [obj]
    dist.broadcast_object_list(objects, 0)
    return objects[0]


def full_state_dict(module: nn.Module, pp_group: dist.ProcessGroup) -> dict[str, Tensor]:
    """The full (unsplit) state dict of a parallelised ``module`` on every rank: gathered over TP, ZeRO-3 and the
    pipeline stages (``pp_group``). Collective over the whole mesh; the plain module loads it."""
    state = gather_full_state_dict(module)
    if dist.get_world_size(pp_group) > 1:
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state
