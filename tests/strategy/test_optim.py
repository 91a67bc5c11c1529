"""`lightning_hybrid.optim`: the LightningModules' AdamW, decay on matrices only, fused where the parameters are on
a device with a fused kernel (CUDA); the CPU keeps torch's default implementation."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hybrid.optim import FUSED_DEVICE_TYPES, adamw, uses_fused


def test_decay_on_matrices_only_and_the_default_implementation_on_the_cpu():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].weight.requires_grad_(False)  # frozen: not optimised
    optimizer = adamw(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decay, no_decay = optimizer.param_groups
    assert decay["params"] == [model[0].weight] and decay["weight_decay"] == 0.1
    assert no_decay["params"] == [model[0].bias, model[1].bias] and no_decay["weight_decay"] == 0.0
    assert not optimizer.defaults["fused"]


def test_fused_only_where_every_parameter_is_on_a_fused_device():
    cpu = [torch.zeros(2, device="cpu")]
    meta = [torch.zeros(2, device="meta")]
    assert FUSED_DEVICE_TYPES == ("cuda", "xpu")
    assert not uses_fused(cpu) and not uses_fused(meta) and not uses_fused([])
    if torch.cuda.is_available():
        cuda = [torch.zeros(2, device="cuda")]
        assert uses_fused(cuda) and not uses_fused(cuda + cpu)
        assert adamw(nn.Linear(2, 2, device="cuda"), 1e-3, 0.0, (0.9, 0.95)).defaults["fused"]
