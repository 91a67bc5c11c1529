"""The precision plugin HybridStrategy provides: the one the Trainer chose (its class for isinstance checks, its
state, its checkpoint key), clipping by the strategy's global norm through a method of its class -- nothing
patched on an instance. Trainers are constructed, not run: no process starts."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_hybrid import HybridStrategy
from lightning_hybrid.precision import GlobalNormClipping, with_global_norm_clipping


@pytest.mark.parametrize(
    ("precision", "lightning_class", "flag", "dtype"),
    [
        ("32-true", Precision, "32-true", torch.float32),
        ("bf16-mixed", MixedPrecision, "bf16-mixed", torch.bfloat16),
        ("16-mixed", MixedPrecision, "bf16-mixed", torch.bfloat16),  # Lightning's choice on CPU
        ("bf16-true", HalfPrecision, "bf16-true", torch.bfloat16),
    ],
)
def test_the_trainers_choice_clipping_by_the_global_norm(precision, lightning_class, flag, dtype):
    strategy = HybridStrategy(tp=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, logger=False)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, lightning_class) and isinstance(plugin, GlobalNormClipping)
    assert type(plugin).__qualname__ == lightning_class.__qualname__  # Lightning's checkpoint key for its state
    assert "clip_grad_by_norm" not in vars(plugin)  # a method of its class
    assert plugin.clip_by_global_norm == strategy.clip_grad_by_norm
    assert trainer.precision == flag and _plugin_to_compute_dtype(plugin) == dtype  # what ThroughputMonitor reads


def test_clipping_by_norm_goes_to_the_global_norm_and_by_value_stays_local():
    calls = []
    plugin = with_global_norm_clipping(Precision(), lambda optimizer, max_norm: calls.append((optimizer, max_norm)))
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.tensor([3.0, -3.0])
    optimizer = torch.optim.SGD([param], lr=0.1)
    plugin.clip_gradients(optimizer, 1, "norm")
    assert calls == [(optimizer, 1.0)] and param.grad.tolist() == [3.0, -3.0]
    plugin.clip_gradients(optimizer, 1, "value")
    assert param.grad.tolist() == [1.0, -1.0] and len(calls) == 1


def test_a_plugin_given_to_the_strategy_is_adapted_too():
    scaler_free = MixedPrecision("bf16-mixed", "cpu")
    strategy = HybridStrategy(precision_plugin=scaler_free)
    assert isinstance(strategy.precision_plugin, MixedPrecision)
    assert isinstance(strategy.precision_plugin, GlobalNormClipping)
    assert strategy.precision_plugin is not scaler_free and vars(strategy.precision_plugin)["device"] == "cpu"
