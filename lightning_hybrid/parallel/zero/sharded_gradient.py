"""`ShardedGradient`: what ``p.grad`` is where no rank holds the parameter's gradient -- a placeholder that refuses
any use with an error that says why and what to use instead (ZeRO 1-2 from the reduction to the step; ZeRO-3
inside an accumulation window reduced once, while ``on_after_backward`` runs)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["ShardedGradient"]


class ShardedGradient(Tensor):
    """What ``p.grad`` of a parameter is under ZeRO 1-2 from the gradient reduction to the optimizer step: the
    reduced gradient lives in bucket slices spread over the data-parallel ranks (this rank holds ``1/dp`` of it,
    which the optimizer steps), so no rank has ``p``'s gradient. Any use of it -- ``torch.nn.utils.clip_grad_norm_``,
    ``p.grad.norm()``, adding to it -- raises a ``RuntimeError`` that says what to use instead (where ``None`` would
    let a hand-called ``clip_grad_norm_`` silently clip nothing). ``is None`` checks see a gradient; the optimizer
    step and ``zero_grad`` set it back to ``None``. With ``why``: the placeholder of another gradient no rank holds,
    and the error's reason (`lightning_hybrid.grad_sync.GradientSync.placeholders`: ZeRO-3 inside a window)."""

    _name: str
    _stage: int
    _why: str | None

    @staticmethod
    def __new__(cls, param: Tensor, name: str, stage: int, why: str | None = None) -> "ShardedGradient":
        out = Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        out._name, out._stage, out._why = name, stage, why
        return out

    def __init__(self, param: Tensor, name: str, stage: int, why: str | None = None) -> None:
        pass

    def __repr__(self) -> str:
        return f"ShardedGradient({self._name!r}, zero_stage={self._stage})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        grad = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, ShardedGradient))
        if grad._why is not None:
            raise RuntimeError(f"{func.__name__} on the gradient of {grad._name}: {grad._why}")
        raise RuntimeError(
            f"{func.__name__} on the gradient of {grad._name}: under zero_stage={grad._stage} the reduced gradient is"
            " split over the data-parallel ranks' bucket slices (the optimizer steps this rank's slice), so no rank"
            " holds p.grad. Clip with Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer,"
            " gradient_clip_val=..., gradient_clip_algorithm='norm') (by the global norm, as one device), read each"
            " parameter's whole-gradient norm with trainer.strategy.parameter_grad_norms(), or use zero_stage 0 or 3."
        )
