"""Export a trained `CausalLM` back to a folder ``AutoModelForCausalLM.from_pretrained`` loads
(`export_pretrained`, and `ExportPretrained`, the callback that does it at the end of training)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Union

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_hybrid.hf.module import CausalLM
from lightning_hybrid.hf.weights import tied_keys


def export_pretrained(trainer: "L.Trainer", folder: Union[str, os.PathLike], max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the trained `CausalLM` of ``trainer`` to ``folder`` as ``save_pretrained`` does (``config.json`` and
    safetensors, names as ``transformers`` writes them; shards of at most ``max_shard_bytes`` with their index
    when the model is larger), from any layout. Every rank calls it. The weights go through a sharded
    checkpoint (each tensor unsplit once, by one rank); rank 0 then reads it back part by part, so it holds
    one shard at a time, never the whole model. The source folder's tokenizer files are copied along."""
    from safetensors.torch import save_file

    from lightning_hybrid.checkpoint import model_parts

    module = trainer.lightning_module
    if not isinstance(module, CausalLM) or module.model is None:
        raise TypeError("export_pretrained exports a trained lightning_hybrid.hf.CausalLM")
    folder = Path(folder)
    staging = folder / ".export-checkpoint"
    trainer.save_checkpoint(staging, weights_only=True)  # the weights only: no optimizer state
    if trainer.is_global_zero:
        tied = set(tied_keys(module.model))
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


class ExportPretrained(L.Callback):
    """At the end of training, `export_pretrained` the trained `CausalLM` to ``folder`` (the fine-tuning recipe's
    last step; every rank takes part)."""

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = str(folder)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        export_pretrained(trainer, self.folder)
        # Lightning's logger: on the console, and in a recipe's log file too.
        rank_zero_info(f"exported the trained model to {self.folder} (AutoModelForCausalLM.from_pretrained loads it)")
