"""Which modules tensor parallelism splits, and how.

Each linear-like module (``nn.Linear``, transformers' ``Conv1D``) and embedding gets a style from the first of:
1. the user's ``tp_plan``: glob patterns over module names -> ``"colwise" | "rowwise" | "replicate"`` (or a
   transformers style name), or a dict pinning more (``{"style": "colwise", "part_sizes": [64, 32, 32],
   "gather_output": False}``); first matching pattern wins;
2. the model's own plan (`model_plans.py`: every transformers model ships one);
3. the auto heuristic: among the linear-like children of one module, those that read the module's input (the
   first one's input size) are column-parallel (``q/k/v``, fused ``qkv``, ``gate/up``, ``fc1`` ...) and those
   that write it back from another size are row-parallel (``down_proj``, ``fc2``); of the square ones, the
   output projection (``o_proj``, ``c_proj``, ``dense`` ..., else the last registered) is row-parallel too. An
   attention and an MLP held by one module form one unit. The token embedding becomes vocabulary-parallel and
   an LM head of the vocabulary's size column-parallel with its logits gathered.

Split modules are grouped into units: column and row siblings form one unit (their parent: an attention or
MLP module), any other split module is a unit of its own. Each unit gets its candidate variants
(`variants.py`); which one is applied is decided by numerical verification at setup (`verify.py`). Planning
needs no process group, so every rank raises the same error before any collective could hang.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from lightning_hybrid.core.linears import lora_base, lora_wrapper
from lightning_hybrid.parallel.tensor_parallel.layers import split_shape
from lightning_hybrid.parallel.tensor_parallel.model_plans import MODEL_STYLES, model_tp_plan
from lightning_hybrid.parallel.tensor_parallel.variants import LayerPlan, Variant, unit_variants

STYLES = ("colwise", "rowwise", "replicate")
PIN_FIELDS = ("part_sizes", "gather_output", "input_is_parallel")
_OUTPUT_NAMES = (
    "o_proj", "out_proj", "c_proj", "wo", "w2", "down_proj", "fc2", "dense_4h_to_h", "proj", "dense", "out"
)


@dataclass
class Unit:
    """Modules split together. ``layers``: name relative to the unit -> (style, pinned fields); units of one
    ``kind`` are split the same way (one of them is verified)."""

    name: str
    kind: tuple
    source: str  # "tp_plan", "model plan" or "auto"
    layers: dict[str, tuple[str, dict]]
    variants: list[Variant]

    @property
    def explicit(self) -> bool:
        return self.source == "tp_plan"

    @property
    def paired(self) -> bool:
        """A column/row pair inside a module (an attention or MLP), not a lone split module."""
        return any(rel for rel in self.layers)


@dataclass
class TPPlan:
    """The resolved plan: units to split (with their candidate variants) and replicated modules (with why)."""

    units: dict[str, Unit] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)

    @property
    def layers(self) -> dict[str, LayerPlan]:
        """Absolute module name -> plan of each unit's first (preferred) variant."""
        out = {}
        for unit in self.units.values():
            for rel, plan in unit.variants[0].layers:
                out[_join(unit.name, rel)] = plan
        return out

    def summary(self) -> str:
        kinds: dict[tuple, list[str]] = {}
        for unit in self.units.values():
            kinds.setdefault(unit.kind, []).append(unit.name)
        split = "; ".join(
            f"{names[0]}{f' (+{len(names) - 1} alike)' if len(names) > 1 else ''}" for names in kinds.values()
        )
        kept = ", ".join(f"{name} ({why})" for name, why in self.replicated.items())
        return f"tensor parallel units: [{split or 'nothing'}]; replicated: [{kept or 'nothing'}]"


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _join(unit: str, rel: str) -> str:
    return f"{unit}.{rel}" if unit and rel else unit or rel


def _auto_styles(modules: dict[str, nn.Module], splittable: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Heuristic styles of the splittable modules, and why each other one stays replicated."""
    linears = {n: split_shape(modules[n]) for n in splittable if split_shape(modules[n]) is not None}
    styles: dict[str, str] = {}
    by_parent: dict[str, list[str]] = {}
    for name in linears:
        by_parent.setdefault(_parent(name), []).append(name)
    for names in by_parent.values():
        model_dim = linears[names[0]].in_features  # what the first layer reads: the block's input
        rows = [n for n in names if linears[n].out_features == model_dim and linears[n].in_features != model_dim]
        squares = [n for n in names if linears[n].out_features == model_dim == linears[n].in_features]
        if squares:  # square projections: the output one is told by its name, else it is the last registered
            rows.append(([n for n in squares if _leaf(n) in _OUTPUT_NAMES] or squares[-1:])[0])
        cols = [n for n in names if n not in rows and linears[n].in_features == model_dim]
        if rows and cols:
            styles.update({n: "rowwise" for n in rows})
            styles.update({n: "colwise" for n in cols})
    reasons: dict[str, str] = {}
    for name in splittable:
        emb = modules[name]
        if not isinstance(emb, nn.Embedding):
            continue
        unsupported = _unsupported_embedding_options(emb)
        heads = [
            n for n, s in linears.items()
            if n not in styles and s.out_features == emb.num_embeddings and s.in_features == emb.embedding_dim
        ]
        if unsupported:
            reasons[name] = f"{unsupported} not supported by a vocabulary-parallel embedding"
        elif heads or any(k in _leaf(name).lower() for k in ("tok", "word", "wte", "embed_tokens", "embed_in")):
            styles[name] = "rowwise"
            styles.update({h: "colwise" for h in heads})
        else:
            reasons[name] = "not the token embedding"
    reasons.update({n: "no column/row pair found" for n in splittable if n not in styles and n not in reasons})
    return styles, reasons


def _parse_style(pattern: str, value) -> tuple[str, dict]:
    if isinstance(value, str):
        if value in STYLES:
            return value, {}
        if value in MODEL_STYLES:
            return MODEL_STYLES[value]
    elif (isinstance(value, dict) and value.get("style") in ("colwise", "rowwise")
          and set(value) <= {"style", *PIN_FIELDS}):
        pins = {k: (tuple(v) if k == "part_sizes" else bool(v)) for k, v in value.items() if k != "style"}
        return value["style"], pins
    raise ValueError(
        f"tp_plan[{pattern!r}] = {value!r} is invalid: valid styles are {list(STYLES)} (or a transformers style"
        f" such as 'colwise_gather_output'), or a dict"
        f" {{'style': 'colwise' | 'rowwise', {', '.join(repr(f) + ': ...' for f in PIN_FIELDS)}}}."
    )


def _overlay(splittable: list[str], patterns: dict, styles: dict, sources: dict, reasons: dict, source: str,
             strict: bool) -> None:
    decided: set[str] = set()
    for pattern, value in patterns.items():
        style, pins = (
            _parse_style(pattern, value) if strict else MODEL_STYLES.get(value, ("replicate", {"unsupported": value}))
        )
        matches = [n for n in splittable if fnmatch.fnmatchcase(n, pattern)]
        if strict and not matches:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no nn.Linear, Conv1D or nn.Embedding module."
                f" Module names look like: {splittable[:8]}"
            )
        for name in (n for n in matches if n not in decided):
            decided.add(name)
            sources[name] = source
            if style == "replicate":
                styles.pop(name, None)
                reasons[name] = f"{source} {pattern!r}" + (
                    f": style {pins['unsupported']!r} not supported" if "unsupported" in pins else ""
                )
            else:
                styles[name] = (style, {} if source == "model plan" else pins)
                reasons.pop(name, None)


def resolve_tp_plan(
    model: nn.Module,
    tp: int,
    tp_plan: str | dict = "auto",
    *,
    pipeline_layers: tuple[str, ...] = (),
) -> TPPlan:
    """Decide how to split ``model`` over ``tp`` ranks. ``pipeline_layers``: names of the modules that pipeline
    stages are cut between (no unit spans two of them). Raises ``ValueError`` for a bad explicit plan."""
    if not (tp_plan == "auto" or isinstance(tp_plan, dict)):
        raise ValueError(f"tp_plan={tp_plan!r} is invalid: use 'auto' or a dict of glob pattern -> {list(STYLES)}.")
    modules = dict(model.named_modules())
    # A LoRA wrapper is split as its base layer (with its adapters); what it wraps is not a module of the plan.
    wrapped = tuple(f"{n}." for n, m in modules.items() if n and lora_wrapper(m))
    splittable = [n for n, m in modules.items() if n and not n.startswith(wrapped)
                  and (split_shape(m) is not None or isinstance(m, nn.Embedding))]
    auto, reasons = _auto_styles(modules, splittable)
    styles: dict[str, tuple[str, dict]] = {n: (s, {}) for n, s in auto.items()}
    sources = {n: "auto" for n in styles}
    _overlay(splittable, model_tp_plan(model), styles, sources, reasons, "model plan", strict=False)
    if isinstance(tp_plan, dict):
        _overlay(splittable, dict(tp_plan), styles, sources, reasons, "tp_plan", strict=True)
    plan = TPPlan(replicated=reasons)
    for unit_name, layers in _group_units(modules, styles, pipeline_layers).items():
        unit = modules[unit_name]
        _check_explicit(unit_name, layers, modules, sources, tp)
        variants = unit_variants(unit, layers, tp)
        source = max((sources[_join(unit_name, rel)] for rel in layers), key=("auto", "model plan", "tp_plan").index)
        if not variants:
            for rel in layers:
                plan.replicated[_join(unit_name, rel)] = f"tp={tp} does not divide its sizes"
            continue
        kind = (type(unit), tuple(sorted(
            (rel, type(modules[_join(unit_name, rel)]), _shape(modules[_join(unit_name, rel)]), str(layers[rel]))
            for rel in layers
        )))
        plan.units[unit_name] = Unit(unit_name, kind, source, layers, variants)
        _check_adapter_dropout(unit_name, layers, modules, tp)
    return plan


def _check_adapter_dropout(unit: str, layers: dict, modules: dict[str, nn.Module], tp: int) -> None:
    """``ValueError`` for a LoRA wrapper TP would split whose adapter drops its input out: a row-split layer's
    adapter would draw its mask for its piece of the input, not one device's mask for the whole."""
    for rel in layers:
        module = modules[_join(unit, rel)]
        dropouts = getattr(module, "lora_dropout", {}).values() if lora_wrapper(module) else ()
        if any(getattr(d, "p", 0) for d in dropouts):
            raise ValueError(f"{_join(unit, rel)} has LoRA dropout and tp={tp} would split it: a split adapter cannot"
                             " draw the mask one device draws for its whole input; set lora_dropout=0 under tp > 1.")


def _shape(module: nn.Module) -> tuple[int, ...]:
    module = lora_base(module) or module
    return tuple(module.weight.shape) if getattr(module, "weight", None) is not None else ()


def _group_units(modules: dict[str, nn.Module], styles: dict[str, tuple[str, dict]],
                 pipeline_layers: tuple[str, ...]) -> dict[str, dict]:
    """Unit name -> {name relative to the unit: (style, pins)}. Column and row linear-like siblings share their
    parent as unit, unless that parent is the root or holds pipeline layers (which may sit on other ranks)."""
    by_parent: dict[str, list[str]] = {}
    for name in styles:
        by_parent.setdefault(_parent(name), []).append(name)
    units: dict[str, dict] = {}
    for parent, names in by_parent.items():
        linear = [n for n in names if split_shape(modules[n]) is not None]
        kinds = {styles[n][0] for n in linear}
        holds_stages = parent == "" or any(p.startswith(parent + ".") for p in pipeline_layers)
        paired = kinds == {"colwise", "rowwise"} and not holds_stages
        for name in names:
            if paired and name in linear:
                units.setdefault(parent, {})[_leaf(name)] = styles[name]
            else:
                units[name] = {"": styles[name]}
    return units


def _check_explicit(unit: str, layers: dict, modules: dict[str, nn.Module], sources: dict, tp: int) -> None:
    """Errors for what an explicit plan asks and cannot be done, naming the module."""
    for rel, (style, pins) in layers.items():
        name = _join(unit, rel)
        if sources[name] != "tp_plan":
            continue
        module = modules[name]
        if isinstance(module, nn.Embedding):
            if style != "rowwise":
                raise ValueError(
                    f"tp_plan gives embedding {name!r} the style {style!r}: embeddings can be 'rowwise'"
                    " (vocabulary split) or 'replicate'."
                )
            if _unsupported_embedding_options(module):
                raise ValueError(
                    f"Embedding {name!r} uses {_unsupported_embedding_options(module)}, which the vocabulary-parallel"
                    " embedding does not support: mark it 'replicate' in tp_plan."
                )
            _check_divides(name, "num_embeddings (vocabulary)", module.num_embeddings, tp)
            continue
        shape = split_shape(module)
        if style == "colwise":
            parts = pins.get("part_sizes") or (shape.out_features,)
            if sum(parts) != shape.out_features:
                raise ValueError(
                    f"tp_plan part_sizes {list(parts)} of {name!r} do not add up to its"
                    f" out_features = {shape.out_features}."
                )
            for size in parts:
                _check_divides(name, "out_features" if len(parts) == 1 else f"fused part of size {size}", size, tp)
        else:
            _check_divides(name, "in_features", shape.in_features, tp)


def _unsupported_embedding_options(embedding: nn.Embedding) -> str:
    return ", ".join(opt for opt in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(embedding, opt))


def _check_divides(module: str, what: str, size: int, tp: int) -> None:
    if size % tp != 0:
        raise ValueError(
            f"tp={tp} does not divide {what} = {size} of module {module!r}. Choose a tp that divides {size}"
            f" (or mark the module 'replicate' in tp_plan)."
        )


def block_of(name: str, modules: dict[str, nn.Module], pipeline_layers: tuple[str, ...]) -> str:
    """The block verified for unit ``name``: the nearest enclosing element of an ``nn.ModuleList`` or pipeline
    layer, else the unit itself."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        parent = ".".join(parts[: i - 1])
        if candidate in pipeline_layers or isinstance(modules.get(parent), nn.ModuleList):
            return candidate
    return name
