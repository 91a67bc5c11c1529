"""LoRA on a `CausalLM` through ``peft`` (``CausalLM(..., lora={...})``): adapters injected into the model, the base
frozen, and exports of the adapter (a folder ``PeftModel.from_pretrained`` loads) and of the merged model.

`inject_lora` runs ``peft.inject_adapter_in_model`` on the model as built, on the meta device, before any layout
touches it; the layers are then materialised as without LoRA (the frozen weights read from a pretrained folder under
their own names, `base_name`, or drawn by the model's init as without adapters) and each adapter tensor gets its
value from `adapter_value`: peft's init, drawn from the module's ``init_seed`` and the tensor's name, the same on
every rank and under every layout. Only the adapters train: frozen weights get no gradient, no ZeRO bucket and no
optimizer state. Every layout takes it: tensor parallelism splits an adapted linear with its adapters
(`lightning_hybrid.parallel.tensor_parallel.layers.split_adapted`, verified with the block), pipeline stages build
their layers with them, and expert parallelism cuts the adapters of packed experts with the experts. Plain LoRA
only: DoRA, per-module ranks or alphas, inits computed from the weights and other peft tuners are refused at
construction (`lora_config`), adapter dropout under TP by `check_lora_layout`."""

from __future__ import annotations

import enum
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid.core.linears import lora_base, lora_wrapper

__all__ = ["INSTALL_HINT", "Merge", "adapter_merges", "adapter_modules", "adapter_state", "adapter_tensors",
           "adapter_value", "base_name", "check_lora_layout", "init_adapters", "inject_lora",
           "lora_config", "lora_hparams", "merged_weight"]

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
    if config.init_lora_weights not in (True, False, "gaussian"):
        raise ValueError(f"lora: init_lora_weights={config.init_lora_weights!r} is not supported: True (peft's"
                         " default: A as nn.Linear's init, B zero), 'gaussian' or False (both random); the inits"
                         " computed from the base weights or data (PiSSA, OLoRA, LoftQ, EVA, ...) are not.")
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


def check_lora_layout(tp: int, config) -> None:
    """``ValueError`` for what a layout cannot train exactly: adapter dropout under TP (a row-split layer's
    adapter would drop other elements of its input piece than one device drops of the whole)."""
    if tp > 1 and config.lora_dropout:
        raise ValueError(f"lora_dropout={config.lora_dropout} with tp={tp}: a TP-split layer's adapter cannot draw"
                         " the dropout mask one device draws for its whole input; set lora_dropout=0 under tp > 1.")


def inject_lora(model: nn.Module, config) -> list[str]:
    """Adapters into ``model`` (built, on any device; on the meta device they are made there too) as ``config`` says;
    peft leaves only them trainable. Their values are set where the layers are materialised (`adapter_value`).
    Returns the adapted modules' names; ``ValueError`` when ``target_modules`` matches none."""
    peft = _peft()
    try:
        peft.inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    except ValueError as e:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"lora: target_modules={config.target_modules!r} matches no module of the model (peft:"
                         f" {e}); its linear layers are named {leaves}.") from e
    return [name for name, module in model.named_modules() if lora_wrapper(module)]


def adapter_modules(layer: nn.Module) -> set[int]:
    """``id`` of every module of ``layer`` that belongs to an adapter (its linears, dropouts and their containers):
    the modules a model's own init leaves alone, so that the frozen weights get the values they get without LoRA."""
    out: set[int] = set()
    for module in layer.modules():
        if lora_wrapper(module):
            for name, child in module.named_children():
                if name != "base_layer":
                    out.update(id(m) for m in child.modules())
    return out


def adapter_tensors(layer: nn.Module) -> Iterator[tuple[str, str, int]]:
    """``(name in layer, kind, rank)`` of every adapter tensor of ``layer`` (kind: ``lora_A``, ``lora_B``, or an
    adapted embedding's ``lora_embedding_A`` / ``lora_embedding_B``)."""
    for name, module in layer.named_modules():
        if not lora_wrapper(module):
            continue
        for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            for adapter in getattr(module, kind, {}):
                local = f"{name}.{kind}.{adapter}" + ("" if "embedding" in kind else ".weight")
                yield local.lstrip("."), kind, module.r[adapter]


def adapter_value(name: str, kind: str, r: int, shape: Sequence[int], seed: int, config) -> Tensor:
    """The unsplit value of the adapter tensor ``name`` (its name in the model; ``kind`` and rank ``r`` as
    `adapter_tensors` gives them) as peft draws it at init (``init_lora_weights``: ``True`` A as ``nn.Linear``'s
    init, B zero; ``"gaussian"`` A normal with std 1/r; ``False`` both as ``nn.Linear``'s; embeddings as peft's), on
    the CPU, from a generator seeded by ``seed`` and ``name`` -- so a tensor gets the same value under every layout,
    whichever rank builds it and whichever of its pieces it keeps."""
    how = config.init_lora_weights
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    value = torch.empty(tuple(shape), device=generator.device)
    with torch.no_grad():
        if kind.startswith("lora_embedding"):  # peft's lora.Embedding: A zero and B normal, or (False) both normal
            value.zero_() if (how is not False and kind.endswith("A")) else value.normal_(generator=generator)
        elif kind == "lora_B" and how is not False:
            value.zero_()
        elif kind == "lora_A" and how == "gaussian":
            value.normal_(std=1 / r, generator=generator)
        else:
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return value


@torch.no_grad()
def init_adapters(layer: nn.Module, prefix: str, seed: int, config) -> None:
    """Every adapter tensor of ``layer`` (the model's module ``prefix``; split by TP or whole) set to its
    `adapter_value`, or to this rank's piece of it."""
    from lightning_hybrid.parallel.tensor_parallel.layers import local_piece, tp_shard_specs, unsplit_shape

    specs = tp_shard_specs(layer)
    for name, kind, r in adapter_tensors(layer):
        target = layer.get_parameter(name)
        value = adapter_value(f"{prefix}.{name}", kind, r, unsplit_shape(name, target, specs), seed, config)
        target.copy_(local_piece(name, value, target, specs).to(target.device))


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors of a model state (names of the transformers model) under the names of peft's
    ``adapter_model.safetensors`` (``base_model.model.`` + the module's name + ``.lora_A.weight``)."""
    out = {}
    for name, value in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            module, kind, _adapter, leaf = name.rsplit(".", 3)
            out[f"{PEFT_PREFIX}{module}.{kind}.{leaf}"] = value
    return out


class Merge(NamedTuple):
    """How one adapter merges into the weight it adapts (`adapter_merges`): the adapter's wrapper (its module's name),
    the scale ``s`` and, for an adapter on packed expert parameters (peft's ``ParamWrapper``), the experts' count
    and whether the parameter is stored ``(experts, out, in)``; ``fan_in_fan_out``: a ``Conv1D``'s ``(in, out)``."""

    wrapper: str
    scale: float
    experts: int = 1
    out_first: bool = False
    fan_in_fan_out: bool = False


def adapter_merges(model: nn.Module, adapter: str = "default") -> dict[str, Merge]:
    """``{name of an adapted weight, as transformers names it: its Merge}`` of ``model`` as peft injected it (on the
    meta device is enough: only the wrappers' settings are read)."""
    out = {}
    for name, module in model.named_modules():
        if not (lora_wrapper(module) and adapter in module.lora_A):
            continue
        scale = float(module.scaling[adapter])
        parameter = getattr(module, "parameter_name", None)
        if parameter:  # peft's ParamWrapper: the parameter of the innermost base module
            full = f"{name}.{parameter}"  # (its transformers name: the wrappers' base_layer steps dropped)
            out[base_name(full) or full] = Merge(
                name, scale, int(getattr(module, "num_experts", 1)), bool(module._did_swap_in_out_features))
        elif lora_base(module) is not None:
            out[f"{name}.weight"] = Merge(name, scale, fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)))
    return out


def merged_weight(weight: Tensor, a: Tensor, b: Tensor, merge: Merge) -> Tensor:
    """``weight`` with its adapter ``(a, b)`` merged in, as peft merges it, computed in float32: ``W + s B A``
    (transposed for a ``fan_in_fan_out`` layer such as GPT-2's ``Conv1D``); for packed experts each expert's own
    ``s B_e A_e`` (A's rows and B's columns hold the experts' ranks: peft's ``ParamWrapper.get_delta_weight``)."""
    a, b = a.float(), b.float()
    if merge.experts == 1:
        delta = b @ a
        delta = delta.t() if merge.fan_in_fan_out else delta
    else:
        a = a.reshape(merge.experts, -1, a.shape[-1])  # experts x rank x in
        b = b.reshape(b.shape[0], -1, merge.experts)  # out x rank x experts
        delta = torch.einsum("o r e, e r i -> e o i" if merge.out_first else "o r e, e r i -> e i o", b, a)
    return (weight.float() + delta * merge.scale).to(weight.dtype)


def base_name(name: str) -> Optional[str]:
    """The transformers name of an adapted layer's base weight or bias (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``), ``None`` for another tensor."""
    if ".base_layer." not in name:
        return None
    return re.sub(r"(\.base_layer)+\.", ".", name)  # (peft nests wrappers: an experts module's two parameters)
