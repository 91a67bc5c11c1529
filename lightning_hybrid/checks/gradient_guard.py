"""Gradients users touch: a norm of the parameters' gradients that a rank computes alone is refused where a rank
holds pieces of them.

Under TP a rank's gradient of a split weight is its shard, under PP a rank holds its stages' parameters, under EP
its experts: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)`` in ``on_before_optimizer_step`` (or in
``configure_gradient_clipping``) would clip by this rank's norm -- every rank by another factor, none by one
device's -- with exit code 0. `LocalGradientNorms` watches the code Lightning runs between the backward and the
optimizer step (the ``on_before_optimizer_step`` hooks and gradient clipping) during the first `WATCHED_STEPS`
optimizer steps and raises where a norm (``torch._foreach_norm``, ``torch.linalg.vector_norm``, ``Tensor.norm``,
...) takes a parameter's gradient, naming what is exact instead: ``Trainer(gradient_clip_val=...)`` or
``self.clip_gradients(...)`` (the strategy clips by the global norm) and ``trainer.strategy.parameter_grad_norms()``.
The strategy's own norms run with the watch suspended. Under ZeRO 1-2 the parameters' ``.grad`` are placeholders
that refuse any use (`lightning_hybrid.parallel.zero.ShardedGradient`); where the gradients a rank holds are whole (DP,
CP, ZeRO-3 alone, whose DTensor gradients torch's clipping reduces itself) nothing is watched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["WATCHED_STEPS", "LocalGradientNorms"]

#: Optimizer steps whose hooks are watched (the code of a step is the same at every step).
WATCHED_STEPS = 3
_NORMS = frozenset({
    torch._foreach_norm, torch.linalg.vector_norm, torch.linalg.norm, torch.linalg.matrix_norm, torch.norm,
    torch.Tensor.norm, torch.nn.functional.normalize,
})


class LocalGradientNorms(TorchFunctionMode):
    """While active, a norm over any of ``parameters``' current gradients is a ``RuntimeError`` explaining that
    under ``layout`` (e.g. "tp=2") a rank holds pieces of them; `suspended` lets the strategy's own norms through."""

    def __init__(self, parameters: Iterable[nn.Parameter], layout: str) -> None:
        super().__init__()
        self.grads = {id(p.grad) for p in parameters if p.grad is not None}
        self.layout = layout
        self._suspended = 0

    @contextmanager
    def suspended(self) -> Iterator[None]:
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[Mapping] = None):
        kwargs = kwargs or {}
        if (not self._suspended and func in _NORMS
                and any(id(t) in self.grads for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))):
            raise RuntimeError(
                f"a norm of parameters' gradients computed on this rank alone ({func.__name__}, e.g."
                f" torch.nn.utils.clip_grad_norm_ in on_before_optimizer_step): under {self.layout} a rank holds"
                " pieces of the gradients (TP shards, its pipeline stages, its experts), so its norm is not the"
                " model's and clipping by it trains another model than one device. Clip with"
                " Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, gradient_clip_val=...,"
                " gradient_clip_algorithm='norm'), which clip by the global norm, and read each parameter's"
                " whole-gradient norm with trainer.strategy.parameter_grad_norms()."
            )
        return func(*args, **kwargs)
