"""LoRA on a `CausalLM` through ``peft`` (``CausalLM(..., lora={...})``): adapters injected into the loaded model,
the base frozen, and exports of the adapter (a folder ``PeftModel.from_pretrained`` loads) and of the merged model.

`inject_lora` runs ``peft.inject_adapter_in_model`` on the built and loaded model (so that a pretrained folder's
weights are read under their own names), with the adapters' random init drawn from the module's ``init_seed`` (every
rank, and one device, draw the same), and leaves only the adapters trainable: frozen weights get no gradient, no
ZeRO bucket and no optimizer state. Layouts: data parallelism with ZeRO 0-3 and context parallelism train it as one
device does; TP, PP and EP, which build the layers per rank from their unsplit names and would split the adapters
with their base layers, are refused by name (`check_lora_layout`). Plain LoRA only: DoRA, per-module ranks or
alphas and other peft tuners are refused at construction (`lora_config`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["INSTALL_HINT", "adapter_state", "base_name", "check_lora_layout", "inject_lora", "lora_config",
           "lora_hparams", "merged_weight"]

INSTALL_HINT = "pip install 'lightning-hybrid[lora]' (peft)"
#: Prefix of the adapter's tensors in a folder ``PeftModel.from_pretrained`` loads (peft's own ``save_pretrained``).
PEFT_PREFIX = "base_model.model."


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"lora uses peft's LoRA: {INSTALL_HINT}.") from e
    return peft


def lora_config(spec: Any):
    """``peft.LoraConfig`` of ``spec`` (one, or a mapping of its fields: ``r``, ``lora_alpha``, ``target_modules``,
    ``lora_dropout``, ...); ``None`` for ``None``. ``ValueError`` naming what is not supported: DoRA, per-module
    ranks or alphas (``rank_pattern``, ``alpha_pattern``), no ``target_modules``."""
    if spec is None:
        return None
    peft = _peft()
    if isinstance(spec, Mapping):
        try:
            config = peft.LoraConfig(**{str(k): _plain(v) for k, v in spec.items()})
        except TypeError as e:
            raise ValueError(f"lora={dict(spec)!r} is invalid: {e} (use the fields of peft.LoraConfig).") from e
    elif isinstance(spec, peft.LoraConfig):
        config = spec
    else:
        raise ValueError(f"lora={spec!r} is invalid: use a peft.LoraConfig or a mapping of its fields (e.g."
                         " {'r': 16, 'target_modules': ['q_proj', 'v_proj']}), or None.")
    unsupported = [name for name, value in (
        ("use_dora", config.use_dora), ("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern),
        ("modules_to_save", config.modules_to_save), ("bias", config.bias != "none"), ("lora_bias", config.lora_bias),
        ("target_parameters", config.target_parameters), ("trainable_token_indices", config.trainable_token_indices),
        ("layer_replication", config.layer_replication)) if value]
    if unsupported:
        raise ValueError(f"lora: {unsupported} are not supported: plain LoRA (one rank and alpha for every adapted"
                         " module, the adapters alone trained; no DoRA, biases or modules to save).")
    if not config.target_modules:
        raise ValueError("lora: name the modules to adapt (target_modules, e.g. ['q_proj', 'v_proj'] or"
                         " 'all-linear').")
    return config


def _plain(value: Any) -> Any:
    """``value`` in Python's own containers (a Hydra config's lists and mappings, which peft does not read as such)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def lora_hparams(config) -> dict[str, Any]:
    """``config`` (a ``peft.LoraConfig``) as the mapping of its fields that `lora_config` reads back (sets as
    sorted lists: a checkpoint's hyperparameters, YAML-safe)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if (not f.init or f.name in ("peft_type", "peft_version") or value == f.default
                or (f.default_factory is not dataclasses.MISSING and value == f.default_factory())):
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        out[f.name] = sorted(value) if isinstance(value, (set, frozenset)) else value
    return out


def check_lora_layout(tp: int, pp: int, ep: int) -> None:
    """``ValueError`` under the layouts that build layers per rank from their unsplit names (TP, PP, EP)."""
    split = {name: size for name, size in (("tp", tp), ("pp", pp), ("ep", ep)) if size > 1}
    if split:
        sizes = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"lora with {sizes}: splitting the adapters with their base layers (and pipeline stages of"
                         " an adapted model) is not implemented; train LoRA with data parallelism (ZeRO 0-3) and"
                         " context parallelism (tp = pp = ep = 1).")


def inject_lora(model: nn.Module, config, seed: int) -> list[str]:
    """Adapters into ``model`` (loaded) as ``config`` says, their init drawn from ``seed``; peft leaves only them
    trainable. Returns the adapted modules' names; ``ValueError`` when ``target_modules`` matches none."""
    peft = _peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(config, model)
        except ValueError as e:
            leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"lora: target_modules={config.target_modules!r} matches no module of the model (peft:"
                             f" {e}); its linear layers are named {leaves}.") from e
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A") and module.lora_A]
    return adapted  # (peft leaves the adapters alone trainable)


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors of a model state (names of the transformers model) under the names of peft's
    ``adapter_model.safetensors`` (``base_model.model.`` + the module's name + ``.lora_A.weight``)."""
    out = {}
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            module, kind, _adapter, leaf = name.rsplit(".", 3)
            out[f"{PEFT_PREFIX}{module}.{kind}.{leaf}"] = value
    return out


def merged_weight(weight: Tensor, a: Tensor, b: Tensor, config) -> Tensor:
    """The base layer's ``weight`` with its adapter merged in: ``W + s B A`` (``s = alpha / r``, ``alpha / sqrt(r)``
    with rsLoRA; transposed for a ``fan_in_fan_out`` layer such as GPT-2's ``Conv1D``), computed in float32."""
    r = a.shape[0]
    scale = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
    delta = (b.float() @ a.float()) * scale
    if config.fan_in_fan_out:
        delta = delta.t()
    return (weight.float() + delta).to(weight.dtype)


def base_name(name: str) -> Optional[str]:
    """The transformers name of an adapted layer's base weight or bias (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``), ``None`` for another tensor."""
    if ".base_layer." not in name:
        return None
    return name.replace(".base_layer.", ".")
