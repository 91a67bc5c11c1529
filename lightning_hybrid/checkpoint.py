"""Sharded, reshardable, crash-safe checkpoints (torch.distributed.checkpoint).

A checkpoint is a folder:
  * DCP shards (one file per rank) holding every tensor in *unsplit* coordinates: ``model/<name>`` for the
    model's parameters and buffers, ``optim/<i>/<name>/<state>`` for optimizer state (Adam's moments ...)
    keyed by parameter name. Each tensor is written once, by one rank of those that hold it (chosen by a
    hash of its name), so the writing is spread over the ranks and nothing is written twice.
  * ``meta.pt`` (rank 0): Lightning's checkpoint dict without weights (loops, LR schedulers, callbacks,
    data module state, hyper-parameters), the optimizers' param-group settings, and the saving layout.

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
from torch.distributed.checkpoint import FileSystemReader

from lightning_hybrid.tensor_parallel.layers import load_full_state_dict, local_piece, tp_shard_specs, unsplit, unsplit_shape

META_FILE = "meta.pt"
PARTIAL_MARK = ".partial-"


class CheckpointError(ValueError):
    """A path that is not a whole lightning_hybrid checkpoint, or one of another model."""


# ----------------------------------------------------------------------------------------------- helpers
def _local(t: Tensor) -> Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def owner_of(key: str, holders: int) -> int:
    """Which of ``holders`` replicas writes ``key`` (stable across processes and Python runs)."""
    return zlib.crc32(key.encode()) % holders


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------------------------------- optimizer state
def _optimizer_params(optimizer, module: nn.Module) -> list[tuple[str, nn.Parameter, dict[str, Tensor]]]:
    """``(parameter name, model parameter, {state key: TP-local tensor})`` for each parameter of ``optimizer``,
    the ZeRO-1/2 flat slices re-assembled per parameter (collective over the DP group)."""
    from lightning_hybrid.zero import ZeroOptimizer

    names = _param_names(module)
    out = []
    if isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state:
        for bucket in optimizer.buckets:
            state = optimizer.state.get(bucket.shard, {})
            gathered = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == bucket.shard.shape:
                    flat = value.new_empty(bucket.flat.numel())
                    dist.all_gather_single(flat, value.contiguous(), group=bucket.group)
                    gathered[key] = flat
            offset = 0
            for p in bucket.params:
                n = p.numel()
                per_param = {k: v[offset : offset + n].view_as(p) for k, v in gathered.items()}
                per_param.update({k: v for k, v in state.items() if k not in gathered})
                out.append((names[id(p)], p, per_param))
                offset += n
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append((names[id(p)], p, dict(optimizer.state.get(p, {}))))
    return out


def _group_settings(optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


# ----------------------------------------------------------------------------------------------- save
def save_sharded(path: str | Path, strategy, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` (Lightning's dict; weights and optimizer state are taken from the live model)
    to the folder ``path``, atomically. Collective over every rank."""
    module = strategy.lightning_module
    dims = strategy.parallel_dims
    path = Path(path)
    token = strategy.broadcast(uuid.uuid4().hex[:12] if strategy.is_global_zero else None)
    partial = path.parent / f".{path.name}{PARTIAL_MARK}{token}"
    mesh = strategy.device_mesh
    # Replicas of a tensor across (dp, tp) of one pipeline rank: the holder that writes it.
    holders = dims.dp * dims.tp
    me = mesh["dp"].get_local_rank() * dims.tp + mesh["tp"].get_local_rank()
    specs = tp_shard_specs(module)

    state: dict[str, Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        full = unsplit(name, tensor, specs)
        shapes[name] = list(full.shape)
        if owner_of(name, holders) == me:
            state[f"model/{name}"] = full.cpu()
    optimizers = []
    # `trainer.save_checkpoint(weights_only=True)` leaves "optimizer_states" out of Lightning's dict.
    for index, optimizer in enumerate(strategy.optimizers if "optimizer_states" in checkpoint else []):
        for name, param, param_state in _optimizer_params(optimizer, module):
            for key, value in param_state.items():
                if not torch.is_tensor(value):
                    continue
                value = unsplit(name, value, specs if value.dim() > 0 else {})  # scalars (step) are not split
                if owner_of(name, holders) == me:
                    state[f"optim/{index}/{name}/{key}"] = value.cpu()
        optimizers.append({"param_groups": _group_settings(optimizer)})
    all_shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(all_shapes, shapes)

    if strategy.is_global_zero:
        partial.mkdir(parents=True)
    strategy.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    if strategy.is_global_zero:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["lightning_hybrid"] = {
            "model_shapes": {k: v for part in all_shapes for k, v in part.items()},
            "optimizers": optimizers,
            "layout": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "zero_stage": strategy.zero_stage},
        }
        torch.save(meta, partial / META_FILE)
    strategy.barrier()
    if strategy.is_global_zero:
        commit(partial, path, token)
    strategy.barrier()


def commit(partial: Path, path: Path, token: str) -> None:
    """Make the fully written ``partial`` folder the checkpoint ``path`` (replacing an older one)."""
    old = path.parent / f".{path.name}.old-{token}"
    if path.exists():
        path.rename(old)
    partial.rename(path)  # the moment the new checkpoint becomes whole
    if old.exists():
        remove(old)


# ----------------------------------------------------------------------------------------------- load
def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.pt`` of a whole checkpoint; ``CheckpointError`` naming the path for anything else."""
    path = Path(path)
    if PARTIAL_MARK in path.name:
        raise CheckpointError(f"{path} is a checkpoint whose save did not finish; it cannot be loaded.")
    if not (path.is_dir() and (path / META_FILE).is_file()):
        raise CheckpointError(
            f"{path} is not a lightning_hybrid checkpoint: expected a folder written by HybridStrategy"
            f" holding {META_FILE} and DCP shards."
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    if "lightning_hybrid" not in meta:
        raise CheckpointError(f"{path / META_FILE} was not written by lightning_hybrid.")
    return meta


def check_model_fits(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    """Compare the checkpoint's tensors with the model's (unsplit names and shapes); ``CheckpointError``."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mis_shaped = {k: (saved[k], expected[k]) for k in sorted(set(saved) & set(expected)) if list(saved[k]) != list(expected[k])}
    if missing or unexpected or mis_shaped:
        details = []
        if missing:
            details.append(f"missing keys {missing[:10]}")
        if unexpected:
            details.append(f"unexpected keys {unexpected[:10]}")
        if mis_shaped:
            details.append("mis-shaped keys " + ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in list(mis_shaped.items())[:10]))
        raise CheckpointError("The checkpoint is of another model: " + "; ".join(details) + ".")


def _read(path: Path, wanted: dict[str, Tensor]) -> dict[str, Tensor]:
    if wanted:
        dcp.load(wanted, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return wanted


def load_sharded(path: str | Path, strategy) -> dict[str, Any]:
    """Load a checkpoint written under any layout into the live (parallelised) model and optimizers.
    Returns the Lightning checkpoint dict (loops, schedulers, ...). Collective over every rank."""
    from lightning_hybrid.zero import ZeroOptimizer

    path = Path(path)
    meta = read_meta(path)
    module = strategy.lightning_module
    specs = tp_shard_specs(module)
    saved_shapes = meta["lightning_hybrid"]["model_shapes"]

    # The model's unsplit names and shapes, over every pipeline stage.
    targets = module.state_dict(keep_vars=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: unsplit_shape(name, t, specs) for name, t in targets.items()})
    check_model_fits(saved_shapes, {k: v for part in everyone for k, v in part.items()})

    full = _read(path, {f"model/{n}": torch.empty(saved_shapes[n], dtype=t.dtype) for n, t in targets.items()})
    load_full_state_dict(module, {n: full[f"model/{n}"] for n in targets})

    saved_optimizers = meta["lightning_hybrid"]["optimizers"]
    if not saved_optimizers:  # a weights-only checkpoint
        return meta
    if strategy.optimizers and len(saved_optimizers) != len(strategy.optimizers):
        raise CheckpointError(f"The checkpoint has {len(saved_optimizers)} optimizers, the module configures {len(strategy.optimizers)}.")
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for index, optimizer in enumerate(strategy.optimizers):
        for group, settings in zip(optimizer.param_groups, saved_optimizers[index]["param_groups"]):
            group.update(settings)
        entries = _optimizer_params(optimizer, module)
        wanted = {}
        for name, param, _ in entries:
            prefix = f"optim/{index}/{name}/"
            for key in metadata:
                if key.startswith(prefix):
                    md = metadata[key]
                    wanted[key] = torch.empty(md.size, dtype=md.properties.dtype)
        loaded = _read(path, wanted)
        per_param: dict[str, dict[str, Tensor]] = {}
        for key, value in loaded.items():
            name, state_key = key[len(f"optim/{index}/") :].rsplit("/", 1)
            per_param.setdefault(name, {})[state_key] = value
        if isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state:
            _load_zero_state(optimizer, module, per_param, specs)
        else:
            for name, param, _ in entries:
                if name in per_param:
                    optimizer.state[param] = {
                        k: _place(name, v, param, specs) for k, v in per_param[name].items()
                    }
    return meta


def _place(name: str, full: Tensor, param: Tensor, specs: dict) -> Tensor:
    """Unsplit optimizer state -> the layout of ``param`` (scalars stay as they are)."""
    if full.dim() == 0:
        return full.to(_local(param).device)
    piece = local_piece(name, full, param, specs).to(device=_local(param).device, dtype=_local(param).dtype)
    if hasattr(param, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(piece.contiguous(), param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return piece.contiguous()


def _load_zero_state(optimizer, module: nn.Module, per_param: dict[str, dict[str, Tensor]], specs: dict) -> None:
    names = _param_names(module)
    for bucket in optimizer.buckets:
        keys = {k for p in bucket.params for k in per_param.get(names[id(p)], {})}
        state: dict[str, Tensor] = {}
        for key in keys:
            values = [per_param.get(names[id(p)], {}).get(key) for p in bucket.params]
            if all(v is not None and v.dim() == 0 for v in values):
                state[key] = values[0].clone()
                continue
            flat = torch.zeros(bucket.flat.numel(), dtype=bucket.flat.dtype)
            offset = 0
            for p, v in zip(bucket.params, values):
                if v is not None:
                    flat[offset : offset + p.numel()] = local_piece(names[id(p)], v, p, specs).reshape(-1)
                offset += p.numel()
            state[key] = flat[bucket.lo : bucket.hi].to(bucket.flat.device).clone()
        if state:
            optimizer.state[bucket.shard] = state


# ----------------------------------------------------------------------------------------------- consolidation
def consolidated_state_dict(checkpoint: str | Path) -> dict[str, Tensor]:
    """The model's unsplit ``state_dict`` (LightningModule keys) of a checkpoint. Runs on one process, no
    process group."""
    path = Path(checkpoint)
    shapes = read_meta(path)["lightning_hybrid"]["model_shapes"]
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {f"model/{k}": torch.empty(shape, dtype=metadata[f"model/{k}"].properties.dtype) for k, shape in shapes.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k[len("model/") :]: v for k, v in state.items()}


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
