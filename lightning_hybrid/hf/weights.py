"""Weights in and out of a `CausalLM`: the tensors of a local pretrained folder, read whole or one TP slice at a
time (`_Safetensors`), and `export_pretrained` / `ExportPretrained`, which write a trained run back to a folder
that ``AutoModelForCausalLM.from_pretrained`` loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

__all__ = ["ExportPretrained", "export_pretrained"]


class _Safetensors:
    """The tensors of a local Hugging Face folder (``model.safetensors`` or an index): their shapes (from the
    headers), and each read on its own, whole or a slice along one dimension."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").exists():
            with safe_open(folder / "model.safetensors", "pt") as f:
                self.files = {k: folder / "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{folder} holds no model.safetensors (nor its index): save it with save_pretrained."
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in dict.fromkeys(self.files.values()):
            with safe_open(file, "pt") as f:
                self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: int = 0) -> Tensor:
        """The tensor ``key``, or with ``dim`` only its ``[start, start + length)`` along ``dim`` (only those bytes
        are read)."""
        from safetensors import safe_open

        if key not in self.files:
            raise KeyError(key)
        with safe_open(self.files[key], "pt") as f:
            if dim is None:
                return f.get_tensor(key)
            return f.get_slice(key)[(slice(None),) * dim + (slice(start, start + length),)]

    def _per_expert_hint(self, name: str) -> str:
        """Why a packed experts tensor may be missing: the folder stores one tensor per expert (the checkpoint
        format transformers' save_pretrained writes for MoE models and its loader converts)."""
        prefix = name.rpartition(".")[0]
        if not any(key.startswith(prefix + ".0.") for key in self.shapes):
            return ""
        return (f" The folder stores {prefix} one tensor per expert ({prefix}.0. ...), the checkpoint format"
                " transformers writes for mixture-of-experts models and converts when it loads them; CausalLM reads"
                " the model's own (packed) tensors only. Convert the folder once: AutoModelForCausalLM.from_pretrained"
                " it and save its state_dict() with safetensors.torch.save_file next to its config.json.")

    def check(self, model: nn.Module) -> None:
        """``KeyError`` / ``ValueError`` unless the folder holds every parameter of ``model`` (but tied copies) with
        the model's shape: raised on every rank at ``configure_model``, before any collective."""
        tied = set(_tied_keys(model))
        for name, p in model.named_parameters(remove_duplicate=False):
            if name not in self.shapes:
                if name in tied:
                    continue
                raise KeyError(f"{self.folder} holds no tensor {name!r} (a parameter of {type(model).__name__})."
                               + self._per_expert_hint(name))
            if self.shapes[name] != tuple(p.shape):
                raise ValueError(f"{name}: the folder's tensor is {self.shapes[name]}, the model's {tuple(p.shape)}.")


# ---------------------------------------------------------------------------------------------- export
def export_pretrained(trainer: "L.Trainer", folder: Union[str, os.PathLike], max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the trained `CausalLM` of ``trainer`` to ``folder`` as ``save_pretrained`` does (``config.json`` and
    safetensors, names as ``transformers`` writes them; shards of at most ``max_shard_bytes`` with their index
    when the model is larger), from any layout. Every rank calls it. The weights go through a sharded
    checkpoint (each tensor unsplit once, by one rank); rank 0 then reads it back part by part, so it holds
    one shard at a time, never the whole model. The source folder's tokenizer files are copied along."""
    from safetensors.torch import save_file

    from lightning_hybrid.checkpoint import model_parts
    from lightning_hybrid.hf.module import CausalLM  # here: module.py imports this file

    module = trainer.lightning_module
    if not isinstance(module, CausalLM) or module.model is None:
        raise TypeError("export_pretrained exports a trained lightning_hybrid.hf.CausalLM")
    folder = Path(folder)
    staging = folder / ".export-checkpoint"
    trainer.save_checkpoint(staging, weights_only=True)  # the weights only: no optimizer state
    if trainer.is_global_zero:
        tied = set(_tied_keys(module.model))
        shard: dict[str, Tensor] = {}
        written: list[tuple[Path, list[str]]] = []  # (file, its tensors)
        total = 0

        def flush() -> None:
            path = folder / f".shard-{len(written)}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard.clear()

        parts = model_parts(staging) if staging.is_dir() else [torch.load(staging, map_location="cpu")["state_dict"]]
        held = 0
        for part in parts:
            for key, value in part.items():
                name = key[len("model."):]
                if not key.startswith("model.") or name in tied:
                    continue
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
        shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)
    trainer.strategy.barrier("export_pretrained")
    return folder


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


def _tied_keys(model: nn.Module) -> list[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    return [f"{names[id(head)]}.weight"] if head is not None and id(head) in names else []


class ExportPretrained(L.Callback):
    """At the end of training, `export_pretrained` the trained `CausalLM` to ``folder`` (the fine-tuning recipe's
    last step; every rank takes part)."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = str(folder)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        export_pretrained(trainer, self.folder)
        # Lightning's logger: on the console, and in a recipe's log file too.
        rank_zero_info(f"exported the trained model to {self.folder} (AutoModelForCausalLM.from_pretrained loads it)")
