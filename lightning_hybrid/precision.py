"""The precision plugin `HybridStrategy` provides: the one the Trainer chose, clipping by the global norm.

Lightning picks a precision plugin from ``Trainer(precision=...)`` (``Precision`` for ``32-true``,
``MixedPrecision`` for ``16-mixed``/``bf16-mixed``, ``HalfPrecision`` for ``16-true``/``bf16-true``, ...) and
hands it to the strategy's ``precision_plugin`` setter: the seam through which Lightning's own FSDP and XLA
strategies insist on plugins of their own. A stock plugin's ``clip_grad_by_norm`` clips by the norm of this
rank's gradients; under TP, ZeRO and PP every rank holds a different piece of them. So `HybridStrategy`'s
setter keeps the chosen plugin -- its state (e.g. the fp16 grad scaler) and its class, which callers such as
Lightning's ``ThroughputMonitor`` inspect with ``isinstance`` -- as an instance of a subclass whose
``clip_grad_by_norm`` clips by the norm over all shards and stages.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

__all__ = ["GlobalNormClipping", "with_global_norm_clipping"]


class GlobalNormClipping:
    """Mixin for a Lightning precision plugin: ``gradient_clip_val`` clips by the global gradient norm.

    ``clip_by_global_norm(optimizer, max_norm)`` computes the norm over every rank's gradients (collective over
    the TP, DP and PP groups) and scales the local gradients by ``min(1, max_norm / norm)``. ``prepare_gradients()``
    runs before any clipping (manual optimization's deferred reduction); ``settle_gradients()`` is the context of
    Lightning's ``on_after_backward``, entered after each backward (the window's reduction first: the hook sees the
    gradients one device's hook would, or placeholders that refuse use, never a reduction still in flight);
    ``watch_gradients()`` is the context in which the hooks between the backward and the optimizer step run
    (`lightning_hybrid.checks.gradient_guard.LocalGradients`), ``on_after_backward`` included.
    """

    clip_by_global_norm: Callable[[Optimizer, float], None]
    prepare_gradients: Callable[[], None]
    settle_gradients: Callable[[], ContextManager[Any]]
    watch_gradients: Callable[[], ContextManager[Any]]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.clip_by_global_norm(optimizer, float(clip_val))

    def clip_gradients(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        self.prepare_gradients()
        super().clip_gradients(optimizer, *args, **kwargs)  # type: ignore[misc]

    def post_backward(self, tensor: Any, module: Any) -> Any:
        with self.settle_gradients(), self.watch_gradients():
            return super().post_backward(tensor, module)  # type: ignore[misc]

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        with self.watch_gradients():
            super()._after_closure(model, optimizer)  # type: ignore[misc]


@functools.cache
def _with_global_norm(cls: type[Precision]) -> type[Precision]:
    # Same name and qualified name as the chosen class: Lightning stores a plugin's state in checkpoints under
    # its `__qualname__`, so checkpoints stay interchangeable with the stock plugin's.
    return type(cls.__name__, (GlobalNormClipping, cls), {"__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def with_global_norm_clipping(
    plugin: Precision, clip_by_global_norm: Callable[[Optimizer, float], None],
    prepare_gradients: Callable[[], None] = lambda: None,
    watch_gradients: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    settle_gradients: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> Precision:
    """``plugin`` (its state, its class's behaviour) with ``clip_grad_by_norm`` delegating to
    ``clip_by_global_norm`` (`GlobalNormClipping`). A new object: the Trainer's plugin itself is left as it is."""
    cls = type(plugin) if isinstance(plugin, GlobalNormClipping) else _with_global_norm(type(plugin))
    adapted = object.__new__(cls)
    adapted.__dict__.update(vars(plugin))
    adapted.clip_by_global_norm = clip_by_global_norm
    adapted.prepare_gradients, adapted.watch_gradients = prepare_gradients, watch_gradients
    adapted.settle_gradients = settle_gradients
    return adapted
