"""Export a trained `CausalLM` back to a folder ``AutoModelForCausalLM.from_pretrained`` loads
(`export_pretrained`, and `ExportPretrained`, the callback that does it at the end of training)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_hybrid.core.dims import rank_zero_verdict
from lightning_hybrid.hf.lora import adapter_merges, adapter_state, base_name, inject_lora, merged_weight
from lightning_hybrid.hf.module import CausalLM
from lightning_hybrid.hf.weights import tied_keys


def export_pretrained(trainer: "L.Trainer", folder: Union[str, os.PathLike], max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the trained `CausalLM` of ``trainer`` to ``folder`` as ``save_pretrained`` does (``config.json`` and
    safetensors, names as ``transformers`` writes them; shards of at most ``max_shard_bytes`` with their index
    when the model is larger), from any layout. Every rank calls it. The weights go through a sharded
    checkpoint (each tensor unsplit once, by one rank); rank 0 then reads it back part by part, so it holds
    one shard at a time, never the whole model. The source folder's tokenizer files are copied along. A model
    trained with LoRA (``CausalLM(lora=...)``) is written merged -- each adapted weight ``W + s B A``, under the
    model's own names -- and, into ``folder/adapter``, as the adapter alone (`export_adapter`)."""
    from safetensors.torch import save_file

    module = trainer.lightning_module
    if not isinstance(module, CausalLM) or module.model is None:
        raise TypeError("export_pretrained exports a trained lightning_hybrid.hf.CausalLM")
    folder = Path(folder)
    with _staged(trainer, folder, "export_pretrained") as parts:
        if parts is None:  # not rank 0
            return folder
        tied = set(tied_keys(module.model))
        shard: dict[str, Tensor] = {}
        written: list[tuple[Path, list[str]]] = []  # (file, its tensors)
        total = 0

        def flush() -> None:
            path = folder / f".shard-{len(written)}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard.clear()

        adapters = _adapters(parts(_is_adapter)) if module.lora is not None else {}
        merges = _merges(module) if module.lora is not None else {}
        held = 0
        for part in parts():
            for key, value in part.items():
                name = key[len("model."):]
                if not key.startswith("model.") or name in tied or _is_adapter(name):
                    continue
                name = base_name(name) or name  # an adapted layer's weight, bias: under transformers' names
                if name in merges:  # an adapted weight: merged
                    value = merged_weight(value, *adapters[merges[name].wrapper], merges[name])
                size = value.numel() * value.element_size()
                if shard and held + size > max_shard_bytes:
                    flush()
                    held = 0
                shard[name] = value.contiguous()
                held += size
                total += size
        flush()
        _name_shards(folder, written, total)
        module.model.config.save_pretrained(folder)
        if module.folder is not None:  # the tokenizer and generation settings of the folder it came from
            for f in module.folder.iterdir():
                own = f.name.endswith(".safetensors") or f.name in ("config.json", "model.safetensors.index.json")
                if f.is_file() and not own:
                    shutil.copy2(f, folder / f.name)
        if module.lora is not None:
            _write_adapter(module, adapters, folder / "adapter")
    return folder


def export_adapter(trainer: "L.Trainer", folder: Union[str, os.PathLike]) -> Path:
    """Write the LoRA adapter of the trained `CausalLM` of ``trainer`` (``CausalLM(lora=...)``) to ``folder`` as
    peft's ``save_pretrained`` does (``adapter_config.json``, ``adapter_model.safetensors``): ``PeftModel.
    from_pretrained(base, folder)`` puts it on the base model. Every rank calls it."""
    module = trainer.lightning_module
    if not isinstance(module, CausalLM) or module.model is None or module.lora is None:
        raise TypeError("export_adapter exports the adapter of a lightning_hybrid.hf.CausalLM trained with lora=...")
    folder = Path(folder)
    with _staged(trainer, folder, "export_adapter") as parts:
        if parts is not None:
            _write_adapter(module, _adapters(parts(_is_adapter)), folder)
    return folder


@contextlib.contextmanager
def _staged(trainer: "L.Trainer", folder: Path, name: str) -> Iterator[Optional[Callable[..., Any]]]:
    """The trained weights through a sharded checkpoint in ``folder/.export-checkpoint`` (the weights only; each
    tensor unsplit once, by one rank): on rank 0 a function giving its model parts one at a time (each call reads
    them again; ``select``: only the tensors whose key it accepts), ``None`` on the others; then the checkpoint
    removed and every rank met: where rank 0's writing raised, every rank raises (`rank_zero_verdict`), none waits
    for it."""
    from lightning_hybrid.checkpoint import model_parts

    staging = folder / ".export-checkpoint"
    module = trainer.lightning_module
    whole, module.checkpoint_frozen = module.checkpoint_frozen, True  # the frozen base too
    try:
        trainer.save_checkpoint(staging, weights_only=True)  # no optimizer state
    finally:
        module.checkpoint_frozen = whole
    error: Optional[Exception] = None
    if trainer.is_global_zero:
        try:
            yield lambda select=None: (model_parts(staging, select) if staging.is_dir()
                                       else [torch.load(staging, map_location="cpu")["state_dict"]])
        except Exception as e:  # told to every rank, then raised here
            error = e
        finally:
            shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)
    else:
        yield None
    if dist.is_initialized():
        rank_zero_verdict(trainer.strategy.root_device, name, error)
    elif error is not None:
        raise error


def _merges(module: CausalLM) -> dict:
    """`lightning_hybrid.hf.lora.adapter_merges` of the module's model, read from a copy built on the meta device
    (rank 0 may hold some of its layers only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(module.hf_config, dtype=torch.float32)
    inject_lora(skeleton, module.lora)
    return adapter_merges(skeleton)


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _adapters(parts) -> dict[str, tuple[Tensor, Tensor]]:
    """Adapted layer (transformers name) -> its ``(A, B)``, from a checkpoint's model parts."""
    found: dict[str, dict[str, Tensor]] = {}
    for part in parts:
        for key, value in part.items():
            name = key[len("model."):]
            for kind in ("lora_A", "lora_B"):
                if f".{kind}." in name:
                    found.setdefault(name.split(f".{kind}.")[0], {})[kind] = value
    return {layer: (pair["lora_A"], pair["lora_B"]) for layer, pair in found.items()}


def _write_adapter(module: CausalLM, adapters: dict[str, tuple[Tensor, Tensor]], folder: Path) -> None:
    """peft's adapter folder of ``adapters`` (`_adapters`) and the module's LoRA config."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer, (a, b) in adapters.items():
        tensors.update(adapter_state({f"{layer}.lora_A.default.weight": a, f"{layer}.lora_B.default.weight": b}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = copy.deepcopy(module.lora)
    config.base_model_name_or_path = str(module.folder) if module.folder is not None else None
    config.save_pretrained(str(folder))


def _name_shards(folder: Path, written: list[tuple[Path, list[str]]], total: int) -> None:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``."""
    if len(written) == 1:
        written[0][0].rename(folder / "model.safetensors")
        return
    weight_map = {}
    for k, (path, keys) in enumerate(written, start=1):
        name = f"model-{k:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class ExportPretrained(L.Callback):
    """At the end of training, `export_pretrained` the trained `CausalLM` to ``folder`` (the fine-tuning recipe's
    last step; every rank takes part)."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = str(folder)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        export_pretrained(trainer, self.folder)
        # Lightning's logger: on the console, and in a recipe's log file too.
        rank_zero_info(f"exported the trained model to {self.folder} (AutoModelForCausalLM.from_pretrained loads it)")
