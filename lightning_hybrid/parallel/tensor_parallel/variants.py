"""The ways one unit (an attention or MLP module, an embedding, an LM head) can be split, best first.

A fused projection does not say how its output is laid out: ``[q; k; v]`` in blocks (GPT-2, Phi-3), per head
``[h0: q k v][h1: q k v]...`` (GPT-NeoX, Bloom), per key/value group (Falcon's new architecture). Model code
does not say which attributes it reads head counts and sizes from (the module, a shared ``config``, a
``split_size``), nor which of its inputs hold one entry per head (Bloom's alibi). So `unit_variants` lists the
candidate splits in order of preference, and setup-time verification (`verify.py`) applies the first that
reproduces the unsplit module exactly. The last candidates always work: column outputs gathered and row
inputs taken whole (weights split, activations not), then no split at all.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace

from torch import nn

from lightning_hybrid.parallel.tensor_parallel.layers import split_shape

HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "n_kv_heads")
HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size")
_FUSED_QKV = re.compile(r"(qkv|c_attn|query_key_value|in_proj)", re.IGNORECASE)
_HEAD_LAYOUTS = ("[q; k; v]", "per-head q/k/v", "heads")


@dataclass(frozen=True)
class LayerPlan:
    """How one module is split: ``"colwise"`` (output features; ``part_sizes``: full sizes of fused parts, each
    split on its own) or ``"rowwise"`` (input features; an embedding: its vocabulary)."""

    style: str
    gather_output: bool = False
    input_is_parallel: bool = False
    part_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Variant:
    """One way to split a unit. ``layers``: name relative to the unit (``""``: the unit itself) -> plan;
    ``divide``: integer attributes divided by tp (``config.x``: on the unit's own copy of its config);
    ``slice_heads``: inputs with one entry per head are cut to this rank's heads (which ones is found when
    the variant is verified: ``head_inputs``, ``(argument, dim)`` pairs)."""

    label: str
    layers: tuple[tuple[str, LayerPlan], ...]
    divide: tuple[str, ...] = ()
    heads: int = 0
    slice_heads: bool = False
    head_inputs: tuple[tuple[int | str, int], ...] = field(default=(), compare=False)

    def with_head_inputs(self, found: tuple[tuple[int | str, int], ...]) -> "Variant":
        return replace(self, head_inputs=found)


@dataclass(frozen=True)
class HeadInfo:
    heads: int
    kv_heads: int
    head_dim: int | None
    attrs: tuple[str, ...]  # head-count attributes, relative to the unit ("config.x": on its config)


def _int_attrs(owner: object, names: tuple[str, ...], prefix: str = "") -> list[tuple[str, int]]:
    found = []
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((prefix + name, value))
    return found


def head_info(unit: nn.Module) -> HeadInfo | None:
    """Head counts of an attention unit, from its own attributes, else from its ``config``; ``attrs`` lists
    every head-count attribute of both (the config's are divided on the unit's own copy)."""
    config = getattr(unit, "config", None)
    config = None if config is None or isinstance(config, nn.Module) else config
    own = _int_attrs(unit, HEAD_ATTRS), _int_attrs(unit, KV_HEAD_ATTRS)
    shared = (
        (_int_attrs(config, HEAD_ATTRS, "config."), _int_attrs(config, KV_HEAD_ATTRS, "config."))
        if config is not None else ([], [])
    )
    heads = own[0] or shared[0]
    if not heads:
        return None
    kv_heads = (own[1] or shared[1] or heads)[0][1]
    dims = _int_attrs(unit, HEAD_DIM_ATTRS) or (
        _int_attrs(config, ("head_dim",), "config.") if config is not None else []
    )
    attrs = tuple(name for name, _ in own[0] + own[1] + shared[0] + shared[1])
    return HeadInfo(heads[0][1], kv_heads, dims[0][1] if dims else None, attrs)


def _is_attention(unit: nn.Module) -> bool:
    """An attention module: it keeps head counts itself, or says so in its class name (Phi-3's reads them from
    its config; an MLP may see the same config)."""
    return bool(_int_attrs(unit, HEAD_ATTRS)) or bool(re.search("attention|attn", type(unit).__name__, re.IGNORECASE))


def _column_layouts(
    name: str, out: int, pins: dict, info: HeadInfo | None, row_in: set[int], tp: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Candidate part layouts of a column layer's output, most specific first; every part divides by tp.
    Head-based layouts are labelled ``heads`` / ``[q; k; v]`` / ``per-head q/k/v``."""
    if pins.get("part_sizes"):
        options = [("tp_plan parts", tuple(pins["part_sizes"]))]
    else:
        options = []
        if info is not None and info.heads % tp == 0 and info.kv_heads % tp == 0:
            groups = info.heads + 2 * info.kv_heads
            # The head size: given, or what a fused q/k/v output or a row layer's input (the heads merged) implies.
            head_dims = [info.head_dim] if info.head_dim else (
                ([out // groups] if out % groups == 0 else [])
                + sorted(r // info.heads for r in row_in if r % info.heads == 0)
            )
            for head_dim in head_dims:
                q, kv = info.heads * head_dim, info.kv_heads * head_dim
                if out == q + 2 * kv:
                    options += [("[q; k; v]", (q, kv, kv)), ("per-head q/k/v", (out,))]
                elif out in (q, kv):
                    options.append(("heads", (out,)))
        if info is None and _FUSED_QKV.search(name) and out % 3 == 0:
            options.append(("[q; k; v] thirds", (out // 3,) * 3))
        if out % 2 == 0 and out // 2 in row_in:
            options.append(("[gate; up]", (out // 2, out // 2)))
        options.append(("contiguous", (out,)))
    return [(label, parts) for label, parts in dict.fromkeys(options) if all(p % tp == 0 for p in parts)]


def _size_attrs(unit: nn.Module, sizes: set[int], exclude: tuple[str, ...]) -> list[str]:
    """Integer attributes of the unit equal to a full split size (``split_size``, ``embed_dim`` ...)."""
    return [
        name for name, value in vars(unit).items()
        if isinstance(value, int) and not isinstance(value, bool) and value in sizes and name not in exclude
        and not name.startswith("_") and name not in HEAD_DIM_ATTRS
    ]


def unit_variants(unit: nn.Module, styles: dict[str, tuple[str, dict]], tp: int) -> list[Variant]:
    """Candidate splits of ``unit`` given the base ``styles`` of its layers (relative name -> (style, pinned
    fields)), best first. Pinned fields (an explicit plan's ``part_sizes``, ``gather_output``, ...) restrict
    the candidates; without pins the list ends with the always-exact fallbacks."""
    modules = dict(unit.named_modules())
    if len(styles) == 1 and "" in styles:
        return _single_variants(unit, *styles[""], tp)
    cols = {n: s for n, s in styles.items() if s[0] == "colwise"}
    rows = {n: s for n, s in styles.items() if s[0] == "rowwise"}
    shapes = {n: split_shape(modules[n]) for n in styles}
    row_in = {shapes[n].in_features for n in rows}
    info = head_info(unit) if rows and cols and _is_attention(unit) else None
    layouts = [_column_layouts(n, shapes[n].out_features, cols[n][1], info, row_in, tp) for n in cols]
    if not any(label in _HEAD_LAYOUTS for options in layouts for label, _ in options):
        info = None  # no projection is laid out by heads
    sizes = {p for options in layouts for _, parts in options for p in (*parts, sum(parts))} | row_in
    head_attrs = info.attrs if info else ()
    own_heads = tuple(a for a in head_attrs if not a.startswith("config."))
    size_attrs = tuple(_size_attrs(unit, sizes, head_attrs)) if info else ()
    # Fewest changes first: most models reshape by -1 heads and need no attribute divided.
    attr_sets = list(dict.fromkeys([(), own_heads, head_attrs, head_attrs + size_attrs]))
    variants = []
    for combo in itertools.product(*layouts):
        split = tuple((n, LayerPlan("colwise", part_sizes=parts)) for n, (_, parts) in zip(cols, combo))
        split += tuple((n, LayerPlan("rowwise", input_is_parallel=True)) for n in rows)
        label = " + ".join(label for label, _ in combo if label != "contiguous") or "split"
        for divide, slice_heads in itertools.product(attr_sets, (False, True) if info else (False,)):
            variants.append(Variant(label, split, divide, info.heads if info else 0, slice_heads))
    gathered = tuple(
        (n, LayerPlan("colwise", gather_output=True, part_sizes=(shapes[n].out_features,))) for n in cols
    ) + tuple((n, LayerPlan("rowwise", input_is_parallel=False)) for n in rows)
    if all(shapes[n].out_features % tp == 0 for n in cols) and all(shapes[n].in_features % tp == 0 for n in rows):
        variants.append(Variant("weights split, activations gathered", gathered))
    return [v for v in variants if _fits_pins(v, styles)]


def _single_variants(module: nn.Module, style: str, pins: dict, tp: int) -> list[Variant]:
    if isinstance(module, nn.Embedding):
        return [Variant("vocabulary split", (("", LayerPlan("rowwise")),))] if module.num_embeddings % tp == 0 else []
    shape = split_shape(module)
    if style == "colwise":
        parts = tuple(pins.get("part_sizes") or (shape.out_features,))
        plan = LayerPlan("colwise", gather_output=True, part_sizes=parts)
        return [Variant("output gathered", (("", plan),))] if all(p % tp == 0 for p in parts) else []
    plan = LayerPlan("rowwise", input_is_parallel=False)
    return [Variant("input split", (("", plan),))] if shape.in_features % tp == 0 else []


def _fits_pins(variant: Variant, styles: dict[str, tuple[str, dict]]) -> bool:
    layers = dict(variant.layers)
    return all(getattr(layers[n], key) == value for n, (_, pins) in styles.items() for key, value in pins.items())
