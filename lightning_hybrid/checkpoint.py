"""Sharded, reshardable, crash-safe checkpoints (torch.distributed.checkpoint).

A checkpoint is a folder:
  * DCP shards (one file per rank) holding every tensor in *unsplit* coordinates: ``model/<name>`` for the
    model's parameters and buffers, ``optim/<i>/<name>/<state>`` for optimizer state (Adam's moments ...)
    keyed by parameter name. Each tensor is written once, by one rank of those that hold it (chosen by a
    hash of its name), so the writing is spread over the ranks and nothing is written twice.
  * ``meta.pt`` (rank 0): Lightning's checkpoint dict without weights (loops, LR schedulers, callbacks,
    data module state, hyper-parameters), the optimizers' param-group settings, the saving layout, and the
    size and CRC-32 of every other file (the ranks share the work of computing them). A load checks them first
    (`verify_files`): a truncated, corrupted or missing file is a `CheckpointError` naming it, raised before any
    rank starts reading (by rank 0 alone; the other ranks exit quietly), not a hang or a torch error.

Because the tensors are unsplit, any layout (other dp, tp, pp, ZeRO stage) loads any checkpoint of the same
model: each rank reads only the tensors of its own layers and takes its slices. A save first writes into a
hidden ``.<name>.partial-<token>`` folder and renames it into place once every rank has finished, so a
save killed part way never looks like a checkpoint and the previous one stays as it was.

``python -m lightning_hybrid.checkpoint consolidate CKPT OUT`` writes one plain ``state_dict`` file that the
unparallelised LightningModule loads with ``load_state_dict`` on one process; `lightning_checkpoint` makes a
folder readable by ``LightningModule.load_from_checkpoint``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from lightning_hybrid.devices import local_tensor
from lightning_hybrid.mesh import barrier
from lightning_hybrid.tensor_parallel import gather_full_state_dict
from lightning_hybrid.tensor_parallel.layers import (
    load_full_state_dict,
    local_piece,
    tp_shard_specs,
    unsplit,
    unsplit_shape,
)

META_FILE = "meta.pt"
PARTIAL_MARK = ".partial-"


class CheckpointError(ValueError):
    """A path that is not a whole lightning_hybrid checkpoint, or one of another model."""


# ----------------------------------------------------------------------------------------------- helpers
def owner_of(key: str, holders: int) -> int:
    """Which of ``holders`` replicas writes ``key`` (stable across processes and Python runs)."""
    return zlib.crc32(key.encode()) % holders


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------------------------------- the tensors
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
    from lightning_hybrid.zero import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state


def _save_plan(module: nn.Module, optimizers: list, specs: dict) -> list[tuple[str, list[int], torch.dtype]]:
    """``(key, unsplit shape, dtype)`` of every tensor this rank saves, in the shared order (no communication)."""
    out = [(f"model/{n}", unsplit_shape(n, t, specs), t.dtype) for n, t in module.state_dict(keep_vars=True).items()]
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
    for name, tensor in module.state_dict(keep_vars=True).items():
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


def _part_dir(path: Path, part: int) -> Path:
    return path / f"part-{part:04d}"


def _own(tensor: Tensor) -> Tensor:
    """``tensor`` with a storage of its own (not a view that would keep a larger buffer alive)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


def _group_settings(optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


# ----------------------------------------------------------------------------------------------- save
def save_sharded(
    path: str | Path, module: nn.Module, optimizers: list, mesh, checkpoint: dict[str, Any], zero_stage: int,
    part_bytes: int, device: torch.device, ep: int = 1, cp: int = 1,
) -> None:
    """Write ``checkpoint`` (Lightning's dict; weights and optimizer state are taken from the live ``module`` and
    ``optimizers``, parallelised over the ``(pp, dp, tp)`` ``mesh``) to the folder ``path``, atomically, in parts of
    at most ``part_bytes`` of unsplit tensors. ``zero_stage``, ``ep`` and ``cp`` are recorded with the layout (the
    mesh's ``dp`` holds ``dp * cp`` ranks: CP ranks hold the same tensors, as DP ranks do); experts are
    saved whole (an experts module's ``shard_specs`` over its EP group). Collective over every
    rank; ``path`` must be the same on every rank."""
    path = Path(path)
    first = dist.get_rank() == 0
    token = _broadcast(uuid.uuid4().hex[:12] if first else None)
    partial = path.parent / f".{path.name}{PARTIAL_MARK}{token}"
    dp, tp, pp = mesh["dp"].size(), mesh["tp"].size(), mesh["pp"].size()
    # Replicas of a tensor across (dp, tp) of one pipeline rank: the holder that writes it.
    holders = dp * tp
    me = mesh["dp"].get_local_rank() * tp + mesh["tp"].get_local_rank()
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

    if first:
        for part in range(int(parts)):
            _part_dir(partial, part).mkdir(parents=True)
    barrier(device)
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
    if first:
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
    barrier(device)
    if first:
        commit(partial, path, token)
    barrier(device)


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


def commit(partial: Path, path: Path, token: str) -> None:
    """Make the fully written ``partial`` folder the checkpoint ``path`` (replacing an older one)."""
    old = path.parent / f".{path.name}.old-{token}"
    if path.exists():
        path.rename(old)
    partial.rename(path)  # the moment the new checkpoint becomes whole
    if old.exists():
        remove(old)


# ----------------------------------------------------------------------------------------------- load
def read_meta(path: str | Path, collective: bool = False) -> dict[str, Any]:
    """``meta.pt`` of a whole checkpoint; ``CheckpointError`` naming the path for anything else (``collective``:
    every rank of the process group reads it alike, and rank 0 alone raises, the others exiting quietly)."""
    path = Path(path)
    _raise = _raise_from_rank_zero if collective else _raise_here
    if PARTIAL_MARK in path.name:
        _raise(CheckpointError(f"{path} is a checkpoint whose save did not finish; it cannot be loaded."))
    if not (path.is_dir() and (path / META_FILE).is_file()):
        _raise(CheckpointError(
            f"{path} is not a lightning_hybrid checkpoint: expected a folder written by HybridStrategy"
            f" holding {META_FILE} and DCP shards."
        ))
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or overwritten: unpickling fails in many ways
        _raise(CheckpointError(f"{path / META_FILE} cannot be read ({type(e).__name__}: {e}): the checkpoint is"
                               " damaged; load an earlier one."))
    if not isinstance(meta, dict) or "lightning_hybrid" not in meta:
        _raise(CheckpointError(f"{path / META_FILE} was not written by lightning_hybrid."))
    return meta


# A file's checksum is read in pieces of this size.
_READ_BYTES = 16 * 2**20


def _shard_files(folder: Path) -> list[str]:
    """The checkpoint's files but ``meta.pt``, relative to ``folder``, sorted."""
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() and f.name != META_FILE)


def _digest(file: Path) -> tuple[int, int]:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            crc = zlib.crc32(chunk, crc)
    return file.stat().st_size, crc


def _digests(folder: Path, files: list[str], collective: bool = True) -> dict[str, tuple[int, int]]:
    """``{file: (bytes, CRC-32)}``, each rank reading its share of ``files`` (``collective``, over every rank of
    the process group), or this process all of them."""
    if not (collective and dist.is_available() and dist.is_initialized()):
        return {f: _digest(folder / f) for f in files}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f: _digest(folder / f) for i, f in enumerate(files) if i % world == rank}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {f: d for part in everyone for f, d in part.items()}


def verify_files(path: str | Path, meta: dict[str, Any], collective: bool = False) -> None:
    """``CheckpointError`` naming the first file of the checkpoint at ``path`` that is missing, or whose size or
    CRC-32 is not what the save recorded (checkpoints of before the record: nothing to check). ``collective``:
    over every rank of the process group, each reading its share, rank 0 alone raising; else this process alone."""
    path = Path(path)
    _raise = _raise_from_rank_zero if collective else _raise_here
    recorded = meta["lightning_hybrid"].get("files")
    if recorded is None:
        return
    error = None
    for name, (size, _) in recorded.items():  # cheap, and the same on every rank: before any collective
        file = path / name
        if not file.is_file():
            error = f"{file} is missing: the checkpoint {path} is damaged; load an earlier one."
        elif file.stat().st_size != size:
            error = (f"{file} holds {file.stat().st_size} bytes, its save wrote {size}: the file is truncated or"
                     f" damaged; load an earlier checkpoint than {path}.")
        if error:
            _raise(CheckpointError(error))
    found = _digests(path, sorted(recorded), collective)
    for name, digest in found.items():
        if tuple(digest) != tuple(recorded[name]):
            _raise(CheckpointError(f"{path / name} does not hold what its save wrote (CRC-32 {digest[1]:#010x},"
                                   f" recorded {recorded[name][1]:#010x}): the file is damaged; load an earlier"
                                   f" checkpoint than {path}."))


def _raise_from_rank_zero(error: BaseException) -> None:
    from lightning_hybrid.rank_zero import raise_from_rank_zero

    raise_from_rank_zero(error)


def _raise_here(error: BaseException) -> None:
    raise error


def check_model_fits(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    """Compare the checkpoint's tensors with the model's (unsplit names and shapes); ``CheckpointError``."""
    missing = sorted(set(expected) - set(saved))
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

    # The model's unsplit names and shapes, over every pipeline stage.
    targets = module.state_dict(keep_vars=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: unsplit_shape(name, t, specs) for name, t in targets.items()})
    check_model_fits(saved_shapes, {k: v for part in everyone for k, v in part.items()})

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


# ----------------------------------------------------------------------------------------------- consolidation
def model_parts(checkpoint: str | Path) -> Iterable[dict[str, Tensor]]:
    """The model's unsplit tensors (LightningModule keys) of a checkpoint, one part at a time (at most a bucket
    each, as saved). Runs on one process, no process group."""
    path = Path(checkpoint)
    meta = read_meta(path)
    verify_files(path, meta)
    keys = [f"model/{k}" for k in meta["lightning_hybrid"]["model_shapes"]]
    for part in _read_parts(path, meta, keys, no_dist=True):
        yield {k[len("model/") :]: v for k, v in part.items()}


def consolidated_state_dict(checkpoint: str | Path) -> dict[str, Tensor]:
    """The model's unsplit ``state_dict`` (LightningModule keys) of a checkpoint. Runs on one process, no
    process group."""
    return {k: v for part in model_parts(checkpoint) for k, v in part.items()}


def consolidate(checkpoint: str | Path, out: str | Path) -> dict[str, Tensor]:
    """Write the model's unsplit ``state_dict`` of a checkpoint to the file ``out`` (one process)."""
    plain = consolidated_state_dict(checkpoint)
    torch.save(plain, out)
    return plain


def lightning_checkpoint(path: Any) -> Any:
    """What ``LightningModule.load_from_checkpoint`` reads: for a checkpoint folder written by `HybridStrategy`,
    one Lightning checkpoint in memory (hyper-parameters, Lightning's state and the consolidated weights);
    anything else (a file, a URL, a stream) as it is.

        MyModule.load_from_checkpoint(lightning_checkpoint("checkpoints/last.ckpt"))
    """
    if not (isinstance(path, (str, os.PathLike)) and Path(path).is_dir()):
        return path
    meta = read_meta(path)
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_hybrid"}
    checkpoint["state_dict"] = consolidated_state_dict(path)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return buffer


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_hybrid.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="write one plain state_dict file that the unparallelised model loads")
    cons.add_argument("checkpoint")
    cons.add_argument("out")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        state = consolidate(args.checkpoint, args.out)
    except CheckpointError as err:
        print(f"error: {err}", file=os.sys.stderr)
        return 2
    print(f"wrote {len(state)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
