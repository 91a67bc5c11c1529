"""FP8 training (``HybridStrategy(fp8=...)``, torchao's float8 recipes, emulated on the CPU) reproduces the one-device
FP8 run: torchao's own conversion of the same linears on one device, reading each pipeline micro-batch as one
forward (`tests.parity.Float8GPT`).

A split layer scales its operands by the unsplit tensors' amaxes (MAX-reduced over the groups that split them):
checked layer by layer at fp32 noise, on inputs whose halves have different amaxes (the same layers scaled by
their own pieces are far off). Whole runs are held to `FP8_STEPS` steps of plain SGD at the suite's fp32 tolerances
(`FP8_TOLERANCES`: a tensor's gradient norm within 1e-5, measured 1.7e-6; runs whose casts scale each rank's piece
alone are 1.6e-2 to 4.5e-2 off): where a value sits at a float8 rounding boundary, an ulp of difference in the
weights (a sum in another order) moves it by a whole float8 step, and every further step compounds it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.parallel.float8 import (
    Float8Groups,
    apply_float8,
    convert_to_float8,
    float8_config,
    float8_filter,
)
from tests.helpers import run_distributed
from tests.parity import FP8_COMPILED_TOLERANCES, FP8_STEPS, FP8_TOLERANCES, check_world, float8_gpt

pytest.importorskip("torchao")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32, bias=False), nn.Linear(32, 8))


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_device_float8_layers_compute_what_torchao_computes(recipe):
    from torchao.float8 import convert_to_float8_training

    model = _model()
    reference = copy.deepcopy(model)
    config = float8_config(recipe, torch.device("cpu"))
    assert config.emulate  # no float8 GEMM off CUDA: float8 values, fp32 products
    convert_to_float8_training(reference, config=config, module_filter_fn=float8_filter())
    report = convert_to_float8(model, recipe)
    assert report.converted == ["0", "2"] and report.kept == ["3"]  # 8 output features: no float8 GEMM
    x = torch.randn(4, 5, 32)
    y, y_ref = model(x), reference(x)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.equal(y, y_ref)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_conv1d_in_float8_computes_what_the_same_linear_computes():
    """transformers' Conv1D (GPT-2: weight ``[in, out]``), which torchao does not convert, is converted as the
    nn.Linear of the transposed weight is by torchao."""
    from torchao.float8 import convert_to_float8_training
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # 32 -> 48
    nn.init.normal_(conv.bias)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    conv_model, linear_model = nn.Sequential(conv), nn.Sequential(linear)
    assert convert_to_float8(conv_model, "tensorwise").converted == ["0"]
    convert_to_float8_training(linear_model, config=float8_config("tensorwise", torch.device("cpu")))
    x = torch.randn(3, 7, 32)
    y, y_ref = conv_model(x), linear_model(x)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(conv.weight.grad, linear.weight.grad.t()) and torch.equal(conv.bias.grad, linear.bias.grad)


def _split_layers(recipe: str, reduce: bool) -> tuple[float, float, float]:
    """A column layer and a row layer over two ranks against torchao's unsplit pair: (output, input gradient, weight
    gradient) deviations, relative to their largest elements."""
    from torchao.float8 import convert_to_float8_training

    from lightning_hybrid.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    first, second = nn.Linear(64, 128, bias=False), nn.Linear(128, 64)
    reference = nn.Sequential(copy.deepcopy(first), nn.GELU(), copy.deepcopy(second))
    config = float8_config(recipe, torch.device("cpu"))
    convert_to_float8_training(reference, config=config, module_filter_fn=float8_filter())
    group = dist.group.WORLD
    column, row = ColumnParallelLinear(first, group, False, ()), RowParallelLinear(second, group, True)
    groups = Float8Groups(stage=group, tp=group, together=group) if reduce else Float8Groups()
    apply_float8(column, config, groups)
    apply_float8(row, config, groups)
    # Features of very different scales: each rank's half of a split operand has its own amax.
    x = (torch.randn(16, 64) * torch.logspace(-2, 2, 64)).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = row(nn.functional.gelu(column(x))), reference(x_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    piece = reference[0].weight.grad.chunk(2)[dist.get_rank()]

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    return rel(y, y_ref), rel(x.grad, x_ref.grad), rel(column.weight.grad, piece)


def _split_layers_per_recipe() -> dict:
    dist.init_process_group("gloo")
    return {(recipe, reduce): _split_layers(recipe, reduce) for recipe in ("tensorwise", "rowwise")
            for reduce in (True, False)}


def test_split_float8_layers_scale_as_the_unsplit_ones():
    for per_rank in run_distributed(_split_layers_per_recipe, 2):
        for recipe in ("tensorwise", "rowwise"):
            assert max(per_rank[recipe, True]) < 1e-6, (recipe, per_rank[recipe, True])
        # The check can fail: each rank's own amax scales another tensor.
        assert max(per_rank["tensorwise", False]) > 1e-2, per_rank["tensorwise", False]
        assert max(per_rank["rowwise", False]) > 2e-7, per_rank["rowwise", False]


def test_float8_layouts_match_one_device_float8():
    """tp2 + SP (rowwise; tensorwise in the 3D run), pp2 with two micro-batches (each scaled on its own, as one
    device running them) and activation checkpointing (the recomputed casts reduce again), dp2 ZeRO-3 compiled with
    activation checkpointing (whole graphs)."""
    two_steps = {"max_steps": FP8_STEPS}
    check_world(2, {
        "fp8-rowwise-tp2-sp": (dict(tp=2, sequence_parallel=True, fp8="rowwise"), float8_gpt(recipe="rowwise"),
                               two_steps, FP8_TOLERANCES),
        "fp8-pp2-ac": (dict(pp=2, micro_batches=2, activation_checkpointing=True, fp8="tensorwise"),
                       float8_gpt(micro_batches=2), two_steps, FP8_TOLERANCES),
        # Compiled with full activation checkpointing: the layers still compile to whole graphs.
        "fp8-dp2-zero3-compile-ac": (dict(dp=2, zero_stage=3, compile=True, activation_checkpointing=True,
                                          fp8="tensorwise"), float8_gpt(dp=2), two_steps, FP8_COMPILED_TOLERANCES),
        # The weights gathered in float8, each shard cast with the whole weight's scale (no biases: the attention's
        # and the MLP's FSDP units hold float8 weights alone, gathered as float8 bytes).
        "fp8-dp2-zero3-float8-all-gather": (dict(dp=2, zero_stage=3, fp8="tensorwise", fp8_all_gather=True),
                                            float8_gpt(dp=2, bias=False), two_steps, FP8_TOLERANCES),
    })
    # dp2 x tp2 x pp2: tests/strategy/test_strategy_parity.py's world of 8 ranks.


def test_torchaos_float8_all_gather_flag_is_the_strategys_option():
    """A ``Float8LinearConfig`` asking for FSDP's float8 all-gather is ``fp8_all_gather=True``: ZeRO-3 only, and
    tensorwise weight casts only (each shard is cast with the one scale of the whole weight)."""
    from torchao.float8 import Float8LinearConfig

    from lightning_hybrid import HybridStrategy

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    assert HybridStrategy(dp=2, zero_stage=3, fp8=config).options.fp8_all_gather
    assert not HybridStrategy(dp=2, zero_stage=3, fp8="tensorwise").options.fp8_all_gather
    with pytest.raises(ValueError, match=r"enable_fsdp_float8_all_gather=True gathers ZeRO-3's sharded weights"):
        HybridStrategy(dp=2, zero_stage=1, fp8=config)
