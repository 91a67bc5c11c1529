"""Gradients users touch: what a rank computes alone from gradients it holds pieces of is refused.

Under TP a rank's gradient of a split weight is its shard, under PP a rank holds its stages' parameters, under EP
its experts, and inside an accumulation window under DP (ZeRO 0-2) each rank's gradients are its own batches' part,
reduced after the window's last backward. ``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)`` in
``on_before_optimizer_step`` or ``on_after_backward`` (or in ``configure_gradient_clipping``) -- or a norm written
out by hand, ``sum((p.grad ** 2).sum() for p in self.parameters())`` -- would be this rank's norm: every rank
clips by another factor, none by one device's, with exit code 0. `LocalGradients` watches the code Lightning runs
between the backward and the optimizer step (``on_after_backward``, the ``on_before_optimizer_step`` hooks and
gradient clipping) during the first `WATCHED_STEPS` optimizer steps and raises where an op reduces a watched
gradient -- or a tensor computed element by element from one -- to fewer elements (a norm, a sum, a maximum,
``isfinite(g).all()``), and on a TP shard where it takes or writes part of it (an index, a slice: the shard's
positions are not the whole's). Element-wise changes (scaling, adding a weight-decay term, clamping by value) are
one device's and pass. The message names what is exact instead: ``Trainer(gradient_clip_val=...)`` or
``self.clip_gradients(...)`` (the strategy clips by the global norm) and
``trainer.strategy.parameter_grad_norms()``. The strategy's own norms run with the watch suspended. Under ZeRO 1-2
the parameters' ``.grad`` are placeholders that refuse any use (`lightning_hybrid.parallel.zero.ShardedGradient`);
where the gradients a rank holds are whole (DP and CP after the reduction, ZeRO-3, whose DTensor gradients
torch's ops reduce themselves) nothing is watched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Mapping, Optional

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["WATCHED_STEPS", "LocalGradients"]

#: Optimizer steps whose hooks are watched (the code of a step is the same at every step).
WATCHED_STEPS = 3
#: Ops that write some positions of a tensor: on a TP shard, positions of the whole tensor land elsewhere.
_POSITIONAL_WRITES = frozenset({"__setitem__", "index_put_", "index_fill_", "index_copy_", "index_add_", "scatter_",
                                "scatter_add_", "scatter_reduce_", "masked_scatter_", "put_"})


class LocalGradients(TorchFunctionMode):
    """While active, an op on ``parameters``' current gradients (and on tensors computed element by element from
    them) that reduces one to fewer elements is a ``RuntimeError`` explaining that under ``layout`` (e.g. "tp=2")
    a rank holds pieces of them; on those of ``shards`` (TP-split parameters) so is taking or writing a part of
    one. `suspended` lets the strategy's own norms through."""

    def __init__(self, parameters: Iterable[nn.Parameter], layout: str, shards: Iterable[nn.Parameter] = ()) -> None:
        super().__init__()
        shard_ids = {id(p) for p in shards}
        # id -> (the tensor, weakly: an id freed and reused is not mistaken for it; whether it is a TP shard's)
        self._watched: dict[int, tuple[weakref.ref, bool]] = {}
        for p in parameters:
            if p.grad is not None:
                self._watched[id(p.grad)] = (weakref.ref(p.grad), id(p) in shard_ids)
        self.layout = layout
        self._suspended = 0

    def _shard(self, t: object) -> Optional[bool]:
        """Whether ``t`` is a watched TP shard's gradient (or computed from one); ``None``: not watched."""
        ref, shard = self._watched.get(id(t), (None, False))
        return shard if ref is not None and ref() is t else None

    @contextmanager
    def suspended(self) -> Iterator[None]:
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[Mapping] = None):
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        found = [(t, kind) for t in tree_leaves((args, kwargs)) if (kind := self._shard(t)) is not None]
        if not found:
            return func(*args, **kwargs)
        sources, shard = [t for t, _ in found], any(kind for _, kind in found)
        name = getattr(func, "__name__", str(func))
        if shard and name in _POSITIONAL_WRITES:
            self._refuse(name, "writes some positions of a TP shard's gradient")
        out = func(*args, **kwargs)
        size = max(t.numel() for t in sources)
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            view = _is_view(t, sources)
            # computed element by element from a gradient (or the gradient itself), or a part of a whole one (its
            # reduction is what is refused): watched in turn
            if t.numel() >= size or (view and not shard):
                self._watched[id(t)] = (weakref.ref(t), shard)
            else:
                self._refuse(name, "takes part of a TP shard's gradient" if view else "reduces a gradient")
        return out

    def _refuse(self, name: str, what: str) -> None:
        raise RuntimeError(
            f"an op on parameters' gradients computed on this rank alone ({name}: it {what}; e.g."
            f" torch.nn.utils.clip_grad_norm_ or a norm by hand in on_after_backward or on_before_optimizer_step):"
            f" under {self.layout} a rank holds pieces of the gradients (TP shards, its pipeline stages, its experts,"
            " its own batches' part inside an accumulation window), so what it computes from them alone is not the"
            " model's, and clipping or scaling by it trains another model than one device. Clip with"
            " Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, gradient_clip_val=...,"
            " gradient_clip_algorithm='norm'), which clip by the global norm, and read each parameter's whole-gradient"
            " norm with trainer.strategy.parameter_grad_norms() (element-wise changes of p.grad are exact as they"
            " are)."
        )


def _is_view(t: Tensor, sources: list[Tensor]) -> bool:
    """Whether ``t`` shares the storage of one of ``sources`` (a view or a part of it, no computation)."""
    try:
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == s.untyped_storage().data_ptr() for s in sources)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return False
