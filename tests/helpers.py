"""Test utilities: Trainer settings for quiet runs and recorders of what a Lightning run produced (losses, grad
norms, storage bytes) for parity checks. The multi-process launcher is `lightning_hybrid.testing.run_distributed`."""

from __future__ import annotations

import lightning as L
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.testing import run_distributed  # noqa: F401  (re-exported for the tests)

# Trainer settings for tests: no files written, no console noise.
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class Recorder(L.Callback):
    """Records, per optimizer step, the synced ``train_loss``, the global gradient norm before clipping, and the
    norm of each parameter's whole gradient (this rank's parameters; `HybridStrategy.parameter_grad_norms`), so
    that an error in one tensor's gradient shows even where the optimizer would hide it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.param_grad_norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if isinstance(trainer.strategy, HybridStrategy):
            norms = trainer.strategy.parameter_grad_norms()
        else:  # one device: the plain norms are the whole gradients'
            # In float64: the reference is as exact as the data allows (the CPU's float32 norm loses precision with
            # size).
            zero = torch.zeros((), dtype=torch.float64, device="cpu")
            norms = {n: p.grad.double().norm() if p.grad is not None else zero for n, p in pl_module.named_parameters()}
            self.grad_norms.append(torch.linalg.vector_norm(torch.stack(list(norms.values()))).item())
        values = torch.stack([v.float().cpu() for v in norms.values()]).tolist()
        self.param_grad_norms.append(dict(zip(norms, values)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        strategy = trainer.strategy
        if isinstance(strategy, HybridStrategy) and strategy.last_grad_norm is not None:
            self.grad_norms.append(strategy.last_grad_norm.item())
            strategy.last_grad_norm = None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once; DTensors by their
    local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    storages = {}

    def add(t) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor, or a weight ZeRO-3 gathers in float8: its inner tensors
            for name in t.__tensor_flatten__()[0]:
                if isinstance(inner := getattr(t, name), torch.Tensor):
                    add(inner)
        else:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for t in tensors:
        if t is not None:
            add(t)
    return sum(storages.values())
