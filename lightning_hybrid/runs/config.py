"""The schemas of the recipe configs (``configs/``): structured configs, so a typo'd field fails at composition.

Every node that builds an object names it with ``_target_`` (Hydra's ``instantiate``), and its schema is derived
from that object's own signature -- one parameter list, here and in the class:

* ``parallel`` -- `ParallelConfig`: the arguments of `HybridStrategy` (those Lightning fills in itself --
  accelerator, devices, cluster environment, checkpoint IO, precision plugin -- left out, and those whose default
  a config cannot hold, such as the ``timeout`` timedelta). ``HybridStrategy(**cfg.parallel)``: a new strategy
  argument appears here without an edit. Typed at the top level, so a layout YAML states only what differs.
* ``trainer`` -- `TrainerConfig`: the arguments of ``lightning.Trainer`` but those the run function sets
  (strategy, logger, callbacks, plugins); ``devices: null`` means ``dp * tp * pp / num_nodes``.
* ``model`` and ``data`` hold any LightningModule / LightningDataModule. Each option of their groups names its
  schema in its defaults list: ``model/gpt`` (`GPTModuleConfig`: `GPTLightningModule`'s arguments and
  `GPTConfig`'s fields) and ``data/byte_corpus`` (`ByteCorpusConfig`) are typed; ``model/custom`` and
  ``data/custom`` are open nodes for your own classes (``model=custom model._target_=pkg.Module
  model.width=128``), whose arguments the run function checks against the class's signature before any process
  starts (`lightning_hybrid.runs.recipe.check_arguments`).
* ``callbacks`` -- extra Lightning callbacks by name, each a ``_target_`` node (a recipe's "export at the end").

`RecipeConfig` is the top-level schema every recipe's YAML starts from (``recipe_schema`` in its defaults list).
"""

from __future__ import annotations

import copy
import inspect
import typing
from dataclasses import MISSING as DATACLASS_MISSING
from dataclasses import field, fields, make_dataclass
from typing import Any, Callable, Dict, Iterable, Optional

import lightning as L
from hydra.core.config_store import ConfigStore
from lightning.pytorch.strategies import ParallelStrategy
from omegaconf import MISSING, OmegaConf, open_dict

from lightning_hybrid.data.corpus import ByteCorpusDataModule, TokenCorpusDataModule
from lightning_hybrid.data.sft import SFTDataModule
from lightning_hybrid.data.shards import ShardsDataModule
from lightning_hybrid.hf import CausalLM
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.planner.auto import AutoLayoutConfig
from lightning_hybrid.strategy import HybridStrategy

__all__ = [
    "ByteCorpusConfig",
    "CausalLMConfig",
    "GPTModuleConfig",
    "ParallelConfig",
    "RecipeConfig",
    "SFTConfig",
    "ShardsConfig",
    "TokenCorpusConfig",
    "TrainerConfig",
    "register_configs",
    "schema_from_signature",
]


# ---------------------------------------------------------------------------------------------- derivation
def _config_type(annotation: Any, default: Any, namespace: dict) -> Any:
    """The annotation if a structured config can hold it with this default, else ``Any``; ``None`` when not even
    ``Any`` can (the default is no config value)."""
    if isinstance(annotation, str):  # `from __future__ import annotations`
        try:
            annotation = eval(annotation, namespace)  # what typing.get_type_hints does, parameter by parameter
        except Exception:
            annotation = Any
    if annotation is inspect.Parameter.empty:
        annotation = Any
    for candidate in (annotation, Any):
        try:
            OmegaConf.structured(make_dataclass("Probe", [("value", candidate, _field(default))]))
            return candidate
        except Exception:
            continue
    return None


def _field(default: Any) -> Any:
    if default is inspect.Parameter.empty:
        return field(default=MISSING)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default))
    return field(default=default)


def schema_from_signature(
    name: str,
    target: Callable,
    target_path: str,
    *,
    exclude: Iterable[str] = (),
    defaults: Optional[Dict[str, Any]] = None,
    extra_fields: Iterable[tuple] = (),
) -> type:
    """A dataclass with ``_target_ = target_path`` and one field per named parameter of ``target`` (a class: its
    ``__init__``) -- type and default from the signature -- but ``exclude``, ``*args``/``**kwargs`` and
    parameters whose default a config cannot hold. ``defaults`` replaces signature defaults; ``extra_fields``
    (``(name, type, dataclass field)``) come before the signature's (e.g. what ``**kwargs`` accepts)."""
    init = target.__init__ if inspect.isclass(target) else target
    namespace = getattr(init, "__globals__", {})
    defaults = defaults or {}
    specs = [("_target_", str, field(default=target_path)), *extra_fields]
    taken = {spec[0] for spec in specs}
    for param in inspect.signature(target).parameters.values():
        if param.name in taken or param.name in exclude or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = defaults.get(param.name, param.default)
        type_ = _config_type(param.annotation, default, namespace)
        if type_ is not None:
            specs.append((param.name, type_, _field(default)))
    return make_dataclass(name, specs)


def _fields_of(config_class: type) -> list[tuple]:
    """``(name, type, field)`` of a dataclass, without its ``__post_init__`` (which would fill derived values
    such as ``GPTConfig.n_kv_head`` at schema time, before the overrides are applied)."""
    hints = typing.get_type_hints(config_class)
    out = []
    for f in fields(config_class):
        default = f.default if f.default is not DATACLASS_MISSING else inspect.Parameter.empty
        out.append((f.name, hints[f.name], _field(default)))
    return out


# ---------------------------------------------------------------------------------------------- schemas
#: ``HybridStrategy(**cfg.parallel)``: the strategy's own arguments, but those Lightning fills in.
ParallelConfig = schema_from_signature(
    "ParallelConfig", HybridStrategy, "lightning_hybrid.HybridStrategy",
    exclude=inspect.signature(ParallelStrategy.__init__).parameters,
)

#: ``lightning.Trainer`` arguments; the run function sets ``strategy``, ``logger``, ``callbacks`` and ``plugins``.
TrainerConfig = schema_from_signature(
    "TrainerConfig", L.Trainer, "lightning.Trainer",
    exclude=("strategy", "logger", "callbacks", "plugins"),
    defaults={"devices": None},  # null: dp * tp * pp / num_nodes of the layout
)

#: `GPTLightningModule`: its own arguments and, through ``**config_overrides``, `GPTConfig`'s fields.
GPTModuleConfig = schema_from_signature(
    "GPTModuleConfig", GPTLightningModule, "lightning_hybrid.models.GPTLightningModule",
    exclude=("config",), extra_fields=_fields_of(GPTConfig),
)

#: `ByteCorpusDataModule`. ``paths`` has no default here (``data/stdlib`` sets it to null: the standard
#: library's sources) so that ``data/text`` can require it: merging ``???`` onto a value keeps the value.
ByteCorpusConfig = schema_from_signature(
    "ByteCorpusConfig", ByteCorpusDataModule, "lightning_hybrid.data.corpus.ByteCorpusDataModule",
    defaults={"paths": inspect.Parameter.empty},
)


#: `lightning_hybrid.hf.CausalLM`: a Hugging Face causal LM (``model``: a local pretrained folder or a model type).
CausalLMConfig = schema_from_signature(
    "CausalLMConfig", CausalLM, "lightning_hybrid.hf.CausalLM", defaults={"model": inspect.Parameter.empty},
)

#: `TokenCorpusDataModule`: the byte corpus tokenised with the tokenizer of a local folder (bytes without one).
TokenCorpusConfig = schema_from_signature(
    "TokenCorpusConfig", TokenCorpusDataModule, "lightning_hybrid.data.corpus.TokenCorpusDataModule",
)

#: `lightning_hybrid.data.sft.SFTDataModule`: chat / instruction JSONL for fine-tuning, packed or padded dict batches.
SFTConfig = schema_from_signature("SFTConfig", SFTDataModule, "lightning_hybrid.data.sft.SFTDataModule")

#: `lightning_hybrid.data.shards.ShardsDataModule`: pretraining on the token shards ``python -m
#: lightning_hybrid.data.prepare`` writes, streamed, split by the data-parallel rank. ``path`` is required.
ShardsConfig = schema_from_signature("ShardsConfig", ShardsDataModule, "lightning_hybrid.data.shards.ShardsDataModule")


def _recipe_config() -> type:
    return make_dataclass("RecipeConfig", [
        ("model", Any, field(default=MISSING)),
        ("data", Any, field(default=MISSING)),
        ("parallel", ParallelConfig, field(default_factory=ParallelConfig)),
        ("trainer", TrainerConfig, field(default_factory=TrainerConfig)),
        ("callbacks", Dict[str, Any], field(default_factory=dict)),
        ("loggers", Dict[str, Any], field(default_factory=dict)),
        ("planner", Optional[AutoLayoutConfig], field(default=None)),
        ("seed", int, field(default=0)),
        ("max_steps", int, field(default=100)),
        ("ckpt_path", Optional[str], field(default=None)),
        ("checkpoint_every", int, field(default=0)),
        ("peft", Optional[Dict[str, Any]], field(default=None)),
    ])


def fold_peft(cfg: Any) -> Any:
    """``peft=lora`` (``configs/peft/lora.yaml``: the fields of peft's ``LoraConfig``, ``peft.r=16``): a copy of
    ``cfg`` whose model gets them as its ``lora`` argument (`lightning_hybrid.hf.CausalLM`'s); ``cfg`` itself
    without ``peft``. ``ValueError`` for a model that takes no ``lora``, or one that is given it both ways."""
    peft = cfg.get("peft")
    if peft is None:
        return cfg
    model = cfg.model
    if OmegaConf.is_struct(model) and "lora" not in model:
        raise ValueError(f"peft: the model ({model.get('_target_')}) takes no lora argument; LoRA adapters train a"
                         " Hugging Face model: model=hf (lightning_hybrid.hf.CausalLM).")
    if model.get("lora") is not None:
        raise ValueError("peft and model.lora both give the model adapters: set one of them.")
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.model.lora = cfg.peft
        cfg.peft = None
    return cfg


#: The top level of every recipe: ``model``, ``data`` (any ``_target_``), ``parallel``, ``trainer``, extra
#: ``callbacks`` and ``loggers`` by name (each a ``_target_`` node), ``planner`` (set by ``parallel=auto``: the
#: planner chooses the layout, `lightning_hybrid.planner.auto`), ``seed`` (``seed_everything`` before anything is
#: built), ``max_steps``, ``ckpt_path`` (``last`` or a checkpoint / run folder to resume,
#: `lightning_hybrid.runs.resume`), ``checkpoint_every`` (save ``last.ckpt`` every that many optimizer steps; 0:
#: after validations only) and ``peft`` (LoRA adapters for the model, `fold_peft`).
RecipeConfig = _recipe_config()


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent; done on import of this module):
    ``recipe_schema``, ``model/gpt``, ``model/hf_causal_lm``, ``model/custom``, ``data/byte_corpus``,
    ``data/token_corpus``, ``data/sft_jsonl`` (`SFTConfig`), ``data/token_shards`` (`ShardsConfig`),
    ``data/custom``."""
    store = ConfigStore.instance()
    store.store(name="recipe_schema", node=RecipeConfig)
    store.store(group="model", name="gpt", node=GPTModuleConfig)
    store.store(group="data", name="byte_corpus", node=ByteCorpusConfig)
    store.store(group="model", name="hf_causal_lm", node=CausalLMConfig)
    store.store(group="data", name="token_corpus", node=TokenCorpusConfig)
    store.store(group="data", name="sft_jsonl", node=SFTConfig)
    store.store(group="data", name="token_shards", node=ShardsConfig)
    for group in ("model", "data"):
        # Open to any argument without Hydra's `+` prefix: the target's signature checks them before launch.
        store.store(group=group, name="custom", node=OmegaConf.create({"_target_": MISSING}, flags={"struct": False}))


register_configs()
