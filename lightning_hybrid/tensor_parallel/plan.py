"""Which modules tensor parallelism splits, and how: the auto plan and the user's explicit plan.

The auto plan looks at every module that directly holds two or more ``nn.Linear`` children and pairs them
by shape: the one whose output size is every sibling's input size (the model dimension) is the row-parallel
output projection (``o_proj``, ``down_proj``, ``fc2``, ``c_proj`` ...), the others are column-parallel
inputs (``q/k/v``, fused ``qkv``, ``gate/up``, ``fc1`` ...). Where shapes cannot tell (square attention
projections), names and registration order decide. The token embedding becomes vocab-parallel and the LM
head column-parallel with its logits gathered, so any loss code works unchanged. Everything else stays
replicated, and the plan says why.

An explicit plan maps glob patterns over module names to ``"colwise"``, ``"rowwise"`` or ``"replicate"``
and overrides the auto plan where it matches (first matching pattern wins). Whether a column-parallel layer
gathers its output, and whether a row-parallel one receives a split input, follows from the final plan: a
column layer feeds split activations only to a row-parallel sibling.

Planning needs no process group, so every rank raises the same error before any collective can hang.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

STYLES = ("colwise", "rowwise", "replicate")
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
_FUSED_QKV = re.compile(r"(qkv|c_attn|query_key_value|in_proj)", re.IGNORECASE)
_FUSED_GATE_UP = re.compile(r"(gate_up|w13|w1_w3|fc1_fc2)", re.IGNORECASE)
_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "wo", "w2", "down_proj", "fc2", "dense_4h_to_h", "proj", "dense", "out")
_TOKEN_EMBEDDING = re.compile(r"(tok|word|wte|embed_tokens|token)", re.IGNORECASE)


@dataclass(frozen=True)
class LayerPlan:
    """How one module is split. ``part_sizes``: full sizes of fused output parts (colwise only)."""

    style: str
    gather_output: bool = False
    input_is_parallel: bool = False
    part_sizes: tuple[int, ...] = ()


@dataclass
class TPPlan:
    """The resolved plan: split modules, replicated ones (with the reason), head attributes to divide."""

    layers: dict[str, LayerPlan] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    head_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def summary(self) -> str:
        split = ", ".join(f"{name}={plan.style}{' (gathered)' if plan.gather_output else ''}" for name, plan in self.layers.items())
        kept = ", ".join(f"{name} ({why})" for name, why in self.replicated.items())
        return f"tensor parallel split: [{split or 'nothing'}]; replicated: [{kept or 'nothing'}]"


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> tuple[str, int] | None:
    for attr in names:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return attr, value
    return None


def _fused_parts(name: str, linear: nn.Linear, parent: nn.Module) -> tuple[int, ...]:
    """Full sizes of the parts of a fused projection, or ``(out_features,)`` when it is not fused."""
    out = linear.out_features
    leaf = _leaf(name)
    if _FUSED_QKV.search(leaf):
        heads, kv_heads = _int_attr(parent, HEAD_ATTRS), _int_attr(parent, KV_HEAD_ATTRS)
        head_dim = getattr(parent, "head_dim", None)
        if heads and isinstance(head_dim, int):
            kv = kv_heads[1] if kv_heads else heads[1]
            parts = (heads[1] * head_dim, kv * head_dim, kv * head_dim)
            if sum(parts) == out:
                return parts
        if out % 3 == 0:
            return (out // 3,) * 3
    if _FUSED_GATE_UP.search(leaf) and out % 2 == 0:
        return (out // 2,) * 2
    return (out,)


def _auto_styles(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Auto-plan styles for Linear/Embedding modules, and the reason each unsplit one stays replicated."""
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    styles: dict[str, str] = {}
    reasons: dict[str, str] = {}

    by_parent: dict[str, list[str]] = {}
    for name in linears:
        by_parent.setdefault(_parent(name), []).append(name)
    for parent, names in by_parent.items():
        if len(names) < 2:
            continue
        candidates = [
            n for n in names if all(linears[o].in_features == linears[n].out_features for o in names if o != n)
        ]
        if len(candidates) > 1:
            named = [n for n in candidates if _leaf(n) in _OUTPUT_NAMES]
            candidates = named[:1] or candidates[-1:]
        if not candidates:
            continue
        row = candidates[0]
        cols = [n for n in names if n != row]
        row_in = linears[row].in_features
        if not any(row_in in _fused_parts(c, linears[c], modules[parent]) for c in cols):
            continue
        styles[row] = "rowwise"
        styles.update({c: "colwise" for c in cols})

    embeddings = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding)}
    unpaired = {n: m for n, m in linears.items() if n not in styles}
    for ename, emb in embeddings.items():
        unsupported = _unsupported_embedding_options(emb)
        if unsupported:
            reasons[ename] = f"{unsupported} not supported by VocabParallelEmbedding"
            continue
        heads = [n for n, m in unpaired.items() if m.out_features == emb.num_embeddings and m.in_features == emb.embedding_dim]
        if heads or _TOKEN_EMBEDDING.search(_leaf(ename)):
            styles[ename] = "rowwise"
            styles.update({h: "colwise" for h in heads})
        else:
            reasons[ename] = "not the token embedding"
    for name in list(linears) + list(embeddings):
        if name not in styles and name not in reasons:
            reasons[name] = "no column/row pair found"
    return styles, reasons


def _apply_explicit(model: nn.Module, styles: dict[str, str], reasons: dict[str, str], explicit: dict[str, str]) -> None:
    splittable = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    decided: set[str] = set()
    for pattern, style in explicit.items():
        if style not in STYLES:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r} is invalid: valid styles are {list(STYLES)}.")
        matches = [n for n in splittable if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no nn.Linear or nn.Embedding module."
                f" Module names look like: {splittable[:8]}"
            )
        for name in matches:
            if name in decided:
                continue
            decided.add(name)
            if style == "replicate":
                styles.pop(name, None)
                reasons[name] = f"tp_plan {pattern!r}"
            else:
                styles[name] = style
                reasons.pop(name, None)


def resolve_tp_plan(model: nn.Module, tp: int, tp_plan: str | dict[str, str] = "auto") -> TPPlan:
    """Decide how to split ``model`` over ``tp`` ranks, and validate every size. Raises ``ValueError``."""
    if not (tp_plan == "auto" or isinstance(tp_plan, dict)):
        raise ValueError(f"tp_plan={tp_plan!r} is invalid: use 'auto' or a dict of glob pattern -> {list(STYLES)}.")
    styles, reasons = _auto_styles(model)
    if isinstance(tp_plan, dict):
        _apply_explicit(model, styles, reasons, dict(tp_plan))

    modules = dict(model.named_modules())
    plan = TPPlan(replicated=reasons)
    for name, style in styles.items():
        module, parent = modules[name], modules[_parent(name)]
        siblings = {n: s for n, s in styles.items() if _parent(n) == _parent(name) and n != name}
        if isinstance(module, nn.Embedding):
            if style != "rowwise":
                raise ValueError(
                    f"tp_plan gives embedding {name!r} the style {style!r}: embeddings can be 'rowwise'"
                    " (vocabulary split) or 'replicate'."
                )
            if _unsupported_embedding_options(module):
                raise ValueError(
                    f"Embedding {name!r} uses {_unsupported_embedding_options(module)}, which VocabParallelEmbedding does"
                    " not support: mark it 'replicate' in tp_plan."
                )
            _check_divides(name, "num_embeddings (vocabulary)", module.num_embeddings, tp)
            plan.layers[name] = LayerPlan("rowwise")
        elif style == "colwise":
            parts = _fused_parts(name, module, parent)
            for size in parts:
                _check_divides(name, "out_features" if len(parts) == 1 else f"fused part of size {size}", size, tp)
            paired = any(s == "rowwise" and _feeds(name, n, modules) for n, s in siblings.items())
            plan.layers[name] = LayerPlan("colwise", gather_output=not paired, part_sizes=parts)
        else:
            _check_divides(name, "in_features", module.in_features, tp)
            paired = any(s == "colwise" and _feeds(n, name, modules) for n, s in siblings.items())
            plan.layers[name] = LayerPlan("rowwise", input_is_parallel=paired)
    _plan_heads(plan, modules, tp)
    return plan


def _feeds(col: str, row: str, modules: dict[str, nn.Module]) -> bool:
    """Whether column-parallel ``col`` hands its split output to row-parallel ``row``: two Linear siblings.

    (Within one module the split activations only meet per-head or element-wise operations, e.g. attention
    between q/k/v and o_proj, or silu(gate) * up before down_proj.)
    """
    return isinstance(modules[col], nn.Linear) and isinstance(modules[row], nn.Linear)


def _plan_heads(plan: TPPlan, modules: dict[str, nn.Module], tp: int) -> None:
    """Attention modules whose projections are split keep per-rank head counts: check and record them."""
    for name, layer in plan.layers.items():
        parent_name = _parent(name)
        if layer.style != "colwise" or layer.gather_output or parent_name in plan.head_attrs:
            continue
        parent = modules[parent_name]
        attrs = []
        # Head counts on the module are divided by tp later; those on a shared `config` (Hugging Face models,
        # which reshape by -1) are only checked.
        for owner, owner_name, divide in ((parent, parent_name or "the model", True), (getattr(parent, "config", None), f"{parent_name}.config", False)):
            if owner is None:
                continue
            for names in (HEAD_ATTRS, KV_HEAD_ATTRS):
                found = _int_attr(owner, names)
                if found:
                    attr, value = found
                    if value % tp != 0:
                        raise ValueError(
                            f"tp={tp} does not divide {owner_name}.{attr} = {value}: each TP rank must hold whole"
                            f" attention heads. Valid tp sizes divide {value}: {[d for d in range(1, value + 1) if value % d == 0]}."
                        )
                    if divide:
                        attrs.append(attr)
        if attrs:
            plan.head_attrs[parent_name] = tuple(attrs)


def _unsupported_embedding_options(embedding: nn.Embedding) -> str:
    options = [opt for opt in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(embedding, opt)]
    return ", ".join(options)


def _check_divides(module: str, what: str, size: int, tp: int) -> None:
    if size % tp != 0:
        raise ValueError(
            f"tp={tp} does not divide {what} = {size} of module {module!r}. Choose a tp that divides {size}"
            f" (or mark the module 'replicate' in tp_plan)."
        )
