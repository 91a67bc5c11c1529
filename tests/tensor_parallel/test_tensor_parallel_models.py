"""Exact or refused, on models nobody here wrote: `transformers` families (random init from a config) train
under tp=2 and dp2 x tp2 with their attention and MLP split, and reproduce the one-process run (losses,
gradient norms and each tensor's gradient norm within 1e-6 relative, validation metrics, final parameters
within 1e-5)."""

from __future__ import annotations

from functools import partial

import pytest

from tests.families import FamilyLM
from tests.parity import RTOL, check_world

FAMILIES = ["gpt2", "gpt_neox", "bloom", "phi3", "falcon", "llama", "qwen2", "mistral"]
STEPS = 4
# Adam turns a gradient at the scale of its eps (a byte seen once, whose contributions cancel) into an update of
# order lr, so fp32 reordering noise in such a gradient moves one element by ~2% of lr: keep lr * 0.02 < 1e-5.
LR = 2e-4
# Measured: parameters within 3.1e-6 of one device, losses and norms within 2.6e-7 relative.
TOLERANCES = (RTOL, 1e-5)
# Attention and MLP units as each family names them.
ATTENTION = {"gpt2": "attn", "gpt_neox": "attention", "bloom": "self_attention", "falcon": "self_attention"}
MLP = {"gpt_neox": "mlp", "bloom": "mlp", "falcon": "mlp"}


def _runs(layout: dict) -> dict[str, tuple]:
    return {family: (layout, partial(FamilyLM, family, lr=LR), {}) for family in FAMILIES}


def _assert_attention_and_mlp_split(results: list[dict]) -> None:
    for per_run in results:
        for name, run in per_run.items():
            family = name
            split = run["tp_split"]
            attention = [u for u, label in split.items() if u.endswith("." + ATTENTION.get(family, "self_attn"))]
            mlp = [u for u in split if u.endswith("." + MLP.get(family, "mlp"))]
            assert attention and mlp, (name, split)
            assert all(split[u] != "weights split, activations gathered" for u in attention + mlp), (name, split)


@pytest.fixture(scope="module")
def one_device() -> dict:
    return {}  # one-device results by family, shared by both layouts


@pytest.mark.parametrize("world, layout", [(2, {"tp": 2}), (4, {"dp": 2, "tp": 2})])
def test_transformers_families_match_one_device(world, layout, one_device):
    _assert_attention_and_mlp_split(check_world(world, _runs(layout), steps=STEPS, references=one_device,
                                                tolerances=TOLERANCES))
