"""FP8 training through torchao's float8 recipes, with every scale the one a single device computes.

torchao (``convert_to_float8_training``) casts each operand of a linear layer's three GEMMs to float8 with a scale
from its amax: of the whole tensor (tensorwise) or of each row or column (axiswise, "rowwise"), the forward's
input and weight, the backward's output gradient, and both again for the weight gradient. Here those operands are
split: a batch over the data-parallel and context-parallel ranks, a sequence over the TP group under SP, features
over the TP group in a split layer. An amax taken on a piece would scale the piece differently from the whole, so
each cast says which group splits each dimension of its operand and reduces its amax with MAX over the groups of
the dimensions it reduces over (`Float8Layout`):

- tokens (dim 0 of an input or output gradient, flattened): split over the stage's data-parallel, context-parallel
  and -- where features are whole, since SP may cut the sequence there -- TP ranks; a replicated operand's MAX
  over its identical copies is the same amax;
- features: split over the TP group where the layer splits them (a column layer's output features, a row layer's
  input features); a weight's amax over them is the unsplit weight's.

A float8 GEMM computes what the unsplit one computes, with the same float8 values and scales: under TP up to the
order of the fp32 sums, as every TP product. The scales are those of the tensors one forward call sees, so a
pipeline's micro-batch is scaled as the same micro-batch on one device (one device accumulating the same
micro-batches is the reference), and the amaxes of every data-parallel rank's share of it meet (tensorwise: one
small all-reduce in a layer's forward, one in its backward). A forward without gradients (validation, generation)
is scaled over one data-parallel rank's rows (`Float8Layout.rows_here`): a forward one rank runs alone never waits
for the others.

`apply_float8` converts the module's linears (``nn.Linear``, transformers' ``Conv1D``, and the TP layers) by
`float8_filter`: both unsplit dimensions multiples of 16, as float8 GEMM kernels require, and no name matching an
``exclude`` glob. One device reproduces the run with `convert_to_float8` -- for ``nn.Linear`` torchao's own
``convert_to_float8_training(model, config=float8_config(fp8, device), module_filter_fn=float8_filter())``, which
leaves transformers' ``Conv1D`` in high precision where the strategy converts it too.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.core.collectives import all_reduce
from lightning_hybrid.core.linears import linear_shape, lora_wrapper

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
INSTALL_HINT = "pip install 'lightning-hybrid[fp8]' (torchao)"
MULTIPLE = 16  # float8 GEMM kernels (torch._scaled_mm) need both dimensions of each operand divisible by 16

Float8 = Union[None, str, Any]  # None, a recipe name, or a torchao Float8LinearConfig


@contextlib.contextmanager
def float8_off(module: nn.Module) -> Iterator[None]:
    """``module``'s float8 layers compute their GEMMs in the operands' precision inside this context (the first
    step's probe compares the model's own code in fp32). An attribute of each layer's `Float8Matmul`, not a
    context variable: ``torch.compile`` guards on it (a compiled layer recompiles once for it)."""
    matmuls = [m.float8 for m in module.modules() if getattr(m, "float8", None) is not None]
    states = [m.enabled for m in matmuls]
    for matmul in matmuls:
        matmul.enabled = False
    try:
        yield
    finally:
        for matmul, state in zip(matmuls, states):
            matmul.enabled = state


def _torchao():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(f"fp8 training uses torchao's float8: {INSTALL_HINT}.") from e
    return float8


def validate_float8(fp8: Float8) -> None:
    """``ValueError`` naming ``fp8`` unless it is ``None``, a recipe name (`RECIPES`) or a ``Float8LinearConfig``;
    ``ImportError`` when torchao is missing."""
    if fp8 is None:
        return
    if isinstance(fp8, str):
        if fp8 not in RECIPES:
            raise ValueError(f"fp8={fp8!r} is invalid: use one of torchao's recipes {list(RECIPES)}, a"
                             " torchao.float8.Float8LinearConfig, or None (no FP8).")
        _torchao()
        return
    float8 = _torchao()
    if not isinstance(fp8, float8.Float8LinearConfig):
        raise ValueError(f"fp8={fp8!r} is invalid: use one of torchao's recipes {list(RECIPES)}, a"
                         " torchao.float8.Float8LinearConfig, or None (no FP8).")


def validate_float8_all_gather(fp8: Float8, option: bool, zero_stage: int) -> bool:
    """Whether ZeRO-3 gathers the float8 linears' weights in float8 (`lightning_hybrid.parallel.float8_all_gather`):
    asked by ``option`` (the strategy's ``fp8_all_gather``) or by a config's ``enable_fsdp_float8_all_gather``.
    ``ValueError`` naming what would be valid where it is asked without fp8, without ZeRO-3, or with weights that
    are not scaled tensorwise (a shard can only be cast with the one scale of the whole weight)."""
    if option not in (True, False):
        raise ValueError(f"fp8_all_gather={option!r} is invalid: use True or False.")
    asked = option or (fp8 is not None and not isinstance(fp8, str) and fp8.enable_fsdp_float8_all_gather)
    if not asked:
        return False
    name = "fp8_all_gather=True" if option else "enable_fsdp_float8_all_gather=True"
    if fp8 is None:
        raise ValueError(f"{name} gathers the float8 linears' weights in float8, but fp8=None trains none in FP8; set"
                         " fp8='tensorwise', or leave the float8 all-gather off.")
    if zero_stage != 3:
        raise ValueError(f"{name} gathers ZeRO-3's sharded weights in float8; zero_stage={zero_stage} gathers no"
                         " weights. Use zero_stage=3, or leave the float8 all-gather off.")
    from torchao.float8.config import ScalingGranularity

    config = _torchao().Float8LinearConfig.from_recipe_name(fp8) if isinstance(fp8, str) else fp8
    weight = (config.cast_config_weight, config.cast_config_weight_for_grad_input)
    if any(c.scaling_granularity is not ScalingGranularity.TENSORWISE for c in weight) or weight[0] != weight[1]:
        raise ValueError(f"{name} casts each weight shard with the one scale of the whole weight: it needs"
                         f" tensorwise weight casts (fp8='tensorwise'), not fp8={fp8!r}. Use fp8='tensorwise', or"
                         " leave the float8 all-gather off.")
    return True


def float8_config(fp8: Float8, device: torch.device):
    """torchao's ``Float8LinearConfig`` for ``fp8`` on ``device``: a recipe's config, emulated (float8 values,
    fp32 GEMMs) off CUDA, where no float8 GEMM exists. Float8 GEMMs asked for off CUDA, or on a GPU older than
    compute capability 8.9, are a ``ValueError`` (at setup, before anything trains)."""
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(fp8) if isinstance(fp8, str) else fp8
    if device.type == "cuda" and not config.emulate and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"fp8={fp8!r}: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has"
                         " no float8 GEMMs (they need 8.9 or later: Ada, Hopper, Blackwell); train in bf16 there, or"
                         " pass a Float8LinearConfig with emulate=True (float8 numerics, not faster).")
    if device.type != "cuda":
        if isinstance(fp8, str):
            config = replace(config, emulate=True)
        elif not config.emulate:
            raise ValueError(f"fp8: the Float8LinearConfig asks for float8 GEMMs (emulate=False) on {device.type},"
                             " where only CUDA has them; use emulate=True there (float8 values, fp32 GEMMs), or a"
                             " recipe name, which emulates off CUDA.")
    return config


def float8_filter(exclude: Sequence[str] = ()):
    """The ``module_filter_fn`` of the conversion (torchao's signature ``(module, fqn) -> bool``): a linear whose
    unsplit in and out features are multiples of 16 and whose name matches none of the ``exclude`` globs."""

    def keep(module: nn.Module, fqn: str) -> bool:
        shape = _shape(module)
        return (shape is not None and shape[0] % MULTIPLE == 0 and shape[1] % MULTIPLE == 0
                and not any(fnmatch.fnmatchcase(fqn, pattern) for pattern in exclude))

    return keep


def _shape(module: nn.Module) -> Optional[tuple[int, int]]:
    """Unsplit (in, out) features of a linear-like module or of a TP layer (one that declares ``float8_split``)."""
    if _split_features(module) is not None:
        return module.in_features, module.out_features
    shape = linear_shape(module)
    return None if shape is None else (shape.in_features, shape.out_features)


def _split_features(module: nn.Module) -> Optional[str]:
    """``"in"`` or ``"out"`` for a TP layer (it declares which features it splits and takes a `Float8Matmul` as
    ``float8``: `lightning_hybrid.parallel.tensor_parallel.layers`), else ``None``."""
    return getattr(type(module), "float8_split", None)


# ------------------------------------------------------------------------------------------------ the GEMMs
@dataclass(frozen=True)
class Float8Layout:
    """Which groups split a linear layer's operands (``None``: whole here). ``tokens``: the tokens of its input and
    output gradient (the stage's data-parallel x context-parallel x TP ranks); as it holds every TP piece and every
    copy of each operand, a tensorwise amax is reduced over it. ``tokens_of_split``: the same for an operand whose
    features TP splits (data-parallel x context-parallel: inside a split layer the sequence is whole);
    ``in_features`` / ``out_features``: the TP group where the layer splits them."""

    tokens: Optional[dist.ProcessGroup] = None
    tokens_of_split: Optional[dist.ProcessGroup] = None
    in_features: Optional[dist.ProcessGroup] = None
    out_features: Optional[dist.ProcessGroup] = None

    def groups(self, features: Optional[dist.ProcessGroup]) -> tuple:
        """(dim 0, dim 1) groups of an activation ``[tokens, features]`` whose features ``features`` splits."""
        return (self.tokens if features is None else self.tokens_of_split), features

    def rows_here(self, together: Optional[dist.ProcessGroup], cp: Optional[dist.ProcessGroup]) -> "Float8Layout":
        """The layout of a forward without gradients (validation, generation): scaled over this data-parallel
        rank's rows, with the ranks that run every forward together (``together``: context-parallel x TP, which
        hold the rest of its sequence under CP and SP; ``cp`` for an operand whose features TP splits), so that a
        forward one data-parallel rank runs alone does not wait for the others."""
        return replace(self, tokens=together, tokens_of_split=cp)


class Float8Matmul:
    """One layer's float8 GEMMs: torchao's config, its GEMM configs (``LinearMMConfig``) and the layer's
    `Float8Layout`."""

    def __init__(self, config, layout: Float8Layout, without_grad: Optional[Float8Layout] = None):
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config, self.layout, self.layout_without_grad = config, layout, without_grad or layout
        self.enabled = True  # False inside `float8_off`
        self.mm_config = LinearMMConfig(*(
            ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
            for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        ))

    def __call__(self, x: Tensor, weight_t: Tensor) -> Tensor:
        """``x @ weight_t`` (``x [..., in]``, ``weight_t [in, out]``) in float8, output in ``x``'s dtype (the
        autocast dtype under autocast, as torchao's ``Float8Linear``)."""
        if not self.enabled:  # a weight ZeRO-3 gathered in float8 in its float8 values
            return torch.matmul(x, weight_t.to_original_precision() if _is_float8(weight_t) else weight_t)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        layout = self.layout if torch.is_grad_enabled() else self.layout_without_grad
        with torch.autocast(x.device.type, enabled=False):
            # 2-D in and out: the function's output is its own tensor (a row layer reduces it in place), not a view
            y = _Float8MM.apply(x.reshape(-1, x.size(-1)), weight_t, self, layout)
        return y.view(*x.shape[:-1], y.size(-1))

    def __repr__(self) -> str:
        c = self.config
        granularity = c.cast_config_input.scaling_granularity.value
        return f"float8({granularity}{', emulated' if c.emulate else ''})"


def _scales(casts: list[tuple], whole: Optional[dist.ProcessGroup], config) -> list[Optional[Tensor]]:
    """The scales of ``casts`` (``(tensor, cast config, axis, groups)``; ``None`` for a disabled one), each from its
    amax reduced over the groups that split the dimensions it is taken over: the whole tensor's (tensorwise: over
    ``whole``, which holds every piece and copy -- all of them in one all-reduce) or along ``axis`` (axiswise: over
    ``groups[axis]``). torchao's ``tensor_to_scale`` otherwise (its amax in float64 from the tensor's own dtype: the
    float32 stack of the tensorwise ones holds every bf16 or fp32 value exactly)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_utils import amax_to_scale

    amaxes: list[Optional[Tensor]] = [None] * len(casts)
    tensorwise = []  # reduced together
    with torch.no_grad():
        for i, (t, cast, axis, groups) in enumerate(casts):
            if cast.scaling_type is ScalingType.DISABLED:
                continue
            if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
                amaxes[i] = torch.max(torch.abs(t)).float()
                tensorwise.append(i)
            else:
                amaxes[i] = torch.amax(torch.abs(t), dim=axis, keepdim=True)
                if groups[axis] is not None:
                    amaxes[i] = all_reduce(amaxes[i].contiguous(), groups[axis], "max")
        if tensorwise and whole is not None:
            reduced = all_reduce(torch.stack([amaxes[i] for i in tensorwise]), whole, "max")
            for k, i in enumerate(tensorwise):
                amaxes[i] = reduced[k]
        return [None if a is None else amax_to_scale(a, cast.target_dtype, config.round_scales_to_power_of_2)
                for a, (_, cast, _, _) in zip(amaxes, casts)]


def _is_float8(t: Tensor) -> bool:
    """Whether ``t`` is already torchao's float8 tensor: a weight ZeRO-3 gathered in float8
    (`lightning_hybrid.parallel.float8_all_gather`), cast with the whole weight's tensorwise scale."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(t, Float8TrainingTensor)


def _to_float8(t: Tensor, scale: Optional[Tensor], cast, axis: int, matmul: Float8Matmul, role):
    """``t`` as torchao's float8 tensor of ``scale`` (``t`` itself where the cast is disabled or ``t`` is one)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    if scale is None or _is_float8(t):
        return t
    axiswise = cast.scaling_granularity is not ScalingGranularity.TENSORWISE
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, matmul.mm_config, role,
                                         axis if axiswise else None)


def _same_scale(cast, other) -> bool:
    """Whether a tensor cast by ``other`` has the scale it has by ``cast``: the same tensorwise config (torchao
    computes it again from the same tensor; an axiswise scale depends on the axis too)."""
    from torchao.float8.config import ScalingGranularity

    return cast == other and cast.scaling_granularity is ScalingGranularity.TENSORWISE


class _Float8MM(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` with split-aware amaxes (`_scales`): the same casts, axes, scales
    and GEMMs, so that an unsplit layer computes exactly what torchao's ``Float8Linear`` computes. Collectives: one
    all-reduce of the forward's tensorwise amaxes (input and weight), one of the backward's (the output gradient;
    a scale torchao computes again from the same tensor and config -- the weight's, the input's, the output
    gradient's second cast -- is reused), plus one per axiswise cast of a split axis."""

    @staticmethod
    def forward(ctx, x2: Tensor, weight_t: Tensor, matmul: Float8Matmul, layout: Float8Layout) -> Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.matmul, ctx.layout = matmul, layout
        c = matmul.config
        x_groups = layout.groups(layout.in_features)
        w_groups = (layout.in_features, layout.out_features)
        casts = [(x2, c.cast_config_input, -1, x_groups)]
        if not _is_float8(weight_t):  # else gathered in float8 with its scale (tensorwise)
            casts.append((weight_t, c.cast_config_weight, 0, w_groups))
        x_scale, *w_scale = _scales(casts, layout.tokens, c)
        w_scale = w_scale[0] if w_scale else weight_t._scale
        ctx.save_for_backward(x2, weight_t, x_scale, w_scale)
        xq = _to_float8(x2, x_scale, c.cast_config_input, -1, matmul, GemmInputRole.INPUT)
        wq = _to_float8(weight_t, w_scale, c.cast_config_weight, 0, matmul, GemmInputRole.WEIGHT)
        return torch.mm(xq, wq)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from torchao.float8.float8_training_tensor import GemmInputRole

        (x2, weight_t, x_scale, w_scale), g2 = ctx.saved_tensors, grad
        matmul: Float8Matmul = ctx.matmul
        c, layout = matmul.config, ctx.layout
        g_groups = layout.groups(layout.out_features)
        x_groups = layout.groups(layout.in_features)
        w_groups = (layout.in_features, layout.out_features)
        # The casts this backward needs (alike on every rank of the groups: the same layers need the same
        # gradients), each computed here or reused.
        wanted = {}
        if ctx.needs_input_grad[0]:
            wanted["g"] = (g2, c.cast_config_grad_output, -1, g_groups)
            if not _same_scale(c.cast_config_weight_for_grad_input, c.cast_config_weight):
                wanted["w"] = (weight_t, c.cast_config_weight_for_grad_input, -1, w_groups)
        if ctx.needs_input_grad[1]:
            if not (ctx.needs_input_grad[0]
                    and _same_scale(c.cast_config_grad_output_for_grad_weight, c.cast_config_grad_output)):
                wanted["g_w"] = (g2, c.cast_config_grad_output_for_grad_weight, 0, g_groups)
            if not _same_scale(c.cast_config_input_for_grad_weight, c.cast_config_input):
                wanted["x"] = (x2, c.cast_config_input_for_grad_weight, 0, x_groups)
        scales = dict(zip(wanted, _scales(list(wanted.values()), layout.tokens, c)))
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = _to_float8(g2, scales["g"], c.cast_config_grad_output, -1, matmul, GemmInputRole.GRAD_OUTPUT)
            wq = _to_float8(weight_t, scales.get("w", w_scale), c.cast_config_weight_for_grad_input, -1, matmul,
                            GemmInputRole.WEIGHT)
            grad_x = torch.mm(gq, wq.t())
        if ctx.needs_input_grad[1]:
            gq = _to_float8(g2, scales.get("g_w", scales.get("g")), c.cast_config_grad_output_for_grad_weight, 0,
                            matmul, GemmInputRole.GRAD_OUTPUT)
            xq = _to_float8(x2, scales.get("x", x_scale), c.cast_config_input_for_grad_weight, 0, matmul,
                            GemmInputRole.INPUT)
            grad_w = torch.mm(gq.t(), xq).t()
        return grad_x, grad_w, None, None


class Float8Linear(nn.Module):
    """A linear layer (``nn.Linear``, or transformers' ``Conv1D`` with ``transposed``) whose GEMMs run in float8
    (`Float8Matmul`). Built from the module it replaces, keeping its parameters (same names, same tensors)."""

    def __init__(self, linear: nn.Module, matmul: Float8Matmul, transposed: bool):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.transposed, self.float8 = transposed, matmul
        self.in_features, self.out_features = _shape(linear)

    def forward(self, x: Tensor) -> Tensor:
        y = self.float8(x, self.weight if self.transposed else self.weight.t())
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.float8!r}"


# ------------------------------------------------------------------------------------------------ the conversion
@dataclass
class Float8Report:
    """What `apply_float8` did on this rank: qualified names of the linears in float8 and of those kept, and the
    ``exclude`` patterns that matched a linear here."""

    converted: list[str]
    kept: list[str]
    matched: set[str]

    def summary(self) -> str:
        kept = f"; kept in training precision: {', '.join(self.kept)}" if self.kept else ""
        return f"fp8: {len(self.converted)} linear layers of this rank in float8{kept}"


@dataclass(frozen=True)
class Float8Groups:
    """The process groups of this rank's `Float8Layout`s (``None`` where of one rank): ``stage``, the
    data-parallel x context-parallel x TP ranks of its pipeline stage; ``dp_cp``; ``tp``; ``together``, the
    context-parallel x TP ranks of its data-parallel rank; ``cp``."""

    stage: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None
    tp: Optional[dist.ProcessGroup] = None
    together: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None

    def matmul(self, config, in_split: bool = False, out_split: bool = False) -> Float8Matmul:
        layout = Float8Layout(tokens=self.stage, tokens_of_split=self.dp_cp,
                              in_features=self.tp if in_split else None, out_features=self.tp if out_split else None)
        return Float8Matmul(config, layout, layout.rows_here(self.together, self.cp))


def _refuse_partial_operands(module: nn.Module, keep) -> None:
    """``ValueError`` for a linear whose GEMM operand would be a per-rank part of a sum: the ``A`` adapters of a
    LoRA-adapted column-split layer under sequence parallelism. Their output gradient is each TP rank's part (its
    share of ``B``'s output features), summed only after their weight gradients; a float8 cast of a part is not the
    cast of the whole (a sum of rounded parts is not the rounded sum)."""
    found = [f"{name}.lora_A.{key}" for name, child in module.named_modules()
             if lora_wrapper(child) and _split_features(child.base_layer) == "out"
             and getattr(child.base_layer, "sequence_parallel", False)
             for key, a in child.lora_A.items() if keep(a, f"{name}.lora_A.{key}")]
    if found:
        raise ValueError(
            f"fp8 with sequence parallelism: the LoRA A adapters of column-split layers ({found[:3]}"
            f"{f' and {len(found) - 3} more' if len(found) > 3 else ''}) get their output gradient as each TP rank's"
            " part of it, and a float8 cast of a part is not the cast of the whole gradient one device makes. Keep"
            " them in the training precision, fp8_exclude=['*.lora_A.*'] (one device's FP8 run with the same"
            " exclusion, as without sequence parallelism), or train with sequence_parallel=False.")


def convert_to_float8(module: nn.Module, fp8: Float8 = "tensorwise", device: Optional[torch.device] = None,
                      exclude: Sequence[str] = ()) -> Float8Report:
    """The one-device FP8 model of ``HybridStrategy(fp8=fp8, fp8_exclude=exclude)``: ``module``'s linears converted
    in place, on ``device`` (default: the module's). For ``nn.Linear`` it computes what torchao's
    ``convert_to_float8_training(module, config=float8_config(fp8, device), module_filter_fn=float8_filter(exclude))``
    computes, bit for bit; transformers' ``Conv1D`` (GPT-2), which torchao leaves in high precision, it converts
    too, as the strategy does."""
    validate_float8(fp8)
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return apply_float8(module, float8_config(fp8, device), Float8Groups(), exclude)


def apply_float8(module: nn.Module, config, groups: Float8Groups, exclude: Sequence[str] = ()) -> Float8Report:
    """Convert ``module``'s linears in place (see the module docstring) that `float8_filter` keeps: a TP layer gets
    the `Float8Matmul` of its split (``layer.float8``), an ``nn.Linear`` or ``Conv1D`` becomes a `Float8Linear`.
    With float8 GEMMs (not emulated) a TP layer's local piece must be a multiple of 16 too: ``ValueError``."""
    keep = float8_filter(exclude)
    report = Float8Report([], [], set())
    _refuse_partial_operands(module, keep)
    for name, child in list(module.named_modules()):
        split = _split_features(child)  # "in" / "out" for a TP layer
        shape = None if split or isinstance(child, Float8Linear) else linear_shape(child)
        if not split and shape is None:
            continue
        report.matched.update(p for p in exclude if fnmatch.fnmatchcase(name, p))
        if not keep(child, name):
            report.kept.append(name)
            continue
        if split:
            row = split == "in"
            local = child.weight.shape
            if not config.emulate and any(size % MULTIPLE for size in local):
                raise ValueError(f"fp8: {name}'s TP piece of weight is {list(local)}, and float8 GEMMs need"
                                 f" multiples of {MULTIPLE}; use a tp that keeps them so, or fp8_exclude={[name]!r}.")
            child.float8 = groups.matmul(config, in_split=row, out_split=not row)
        elif name == "":
            raise ValueError("fp8: the module is itself a linear layer; wrap it in a module.")
        else:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, Float8Linear(child, groups.matmul(config), shape.transposed))
        report.converted.append(name)
    return report
