"""One loss semantics, declared: how a module's loss reduces over the tokens of a batch.

A layout that splits a batch -- over data-parallel ranks, CP ranks (each holds part of every sequence) or pipeline
micro-batches -- computes the module's loss on each part, and the gradients of the parts are combined. Which
combination gives one device's loss depends on how the loss reduces, so a module says it (`declared_reduction`):

* ``"token_mean"``: it defines ``loss_items(target)``, the number of items its ``loss_fn`` averages over. Each part's
  backward is then that of its loss *sum* and `lightning_hybrid.grad_sync.GradientSync` divides by the items of the
  whole window: the token mean of the global batch, exact whatever the parts hold (`LanguageModel` does this).
* ``"mean"`` (class attribute ``loss_reduction = "mean"``): the mean of the per-part means, Lightning's DDP
  semantics. Equal to one device where every part has the same number of loss items; declared, it is accepted on
  batches with ignored labels or padding too (statistically, not bitwise, one device's loss).
* ``"sum"`` (``loss_reduction = "sum"``): a loss summed over items; the parts' gradients are summed (not averaged).
* undeclared: taken as ``"mean"``, which is exact only where every part has as many loss items; so a batch with
  ignored labels (``-100``) or padding under a layout that splits it is refused (`ignored_tokens`), on every rank.

Where the module has a ``loss_fn``, its first call in training is also verified against what is declared
(`check_decomposition`): the loss of the whole (micro-)batch against those of its two halves -- ``L n = L_a n_a +
L_b n_b`` for a token mean (a ``loss_items`` that counts other items than ``loss_fn`` averages over fails), ``L = L_a
+ L_b`` for a sum -- and an undeclared loss that adds up like a sum is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten_with_path

from lightning_hybrid.core.batch import IGNORE_INDEX, TokenBatch

__all__ = ["REDUCTIONS", "check_decomposition", "declared_reduction", "ignored_tokens", "undeclared_error"]

REDUCTIONS = ("mean", "sum")
#: How far the halves may be from the whole: fp32 losses agree to ~1e-7 (a wrong count is off by ~1e-3 or more); a
#: loss computed in 16 bits to ~1e-3.
_RTOL = {torch.float16: 3e-2, torch.bfloat16: 3e-2}
_RTOL_FP32 = 2e-5


def declared_reduction(module: Any) -> Optional[str]:
    """``"token_mean"`` for a module with a callable ``loss_items``, else its ``loss_reduction`` (``"mean"`` or
    ``"sum"``), else ``None``. ``ValueError`` for another ``loss_reduction``, or one beside ``loss_items``."""
    declared = getattr(module, "loss_reduction", None)
    name = type(module).__name__
    if declared is not None and declared not in REDUCTIONS:
        raise ValueError(f"{name}.loss_reduction={declared!r} is invalid: use 'mean' (the mean of per-batch means),"
                         " 'sum' (a loss summed over items), or define loss_items(target) for the exact token mean.")
    if callable(getattr(module, "loss_items", None)):
        if declared is not None:
            raise ValueError(f"{name} defines loss_items (the token mean) and loss_reduction={declared!r}: say one.")
        return "token_mean"
    return declared


def ignored_tokens(batch: Any) -> bool:
    """Whether the batch, as the module receives it, has tokens that take no loss: an integer tensor anywhere in it
    holding -100 (cross entropy's ``ignore_index``: a `TokenBatch`'s or a dict's labels, an ``(x, y)`` pair's
    ``y``, whatever the key), or padding (a `TokenBatch`'s, or a tensor under a key naming a mask with zeros). A
    host sync. Ignored tokens marked otherwise (a pad id the loss ignores) cannot be read."""
    if isinstance(batch, TokenBatch):
        return batch.padding is not None or bool((batch.labels == IGNORE_INDEX).any())
    leaves = tree_flatten_with_path(batch)[0]
    for path, leaf in leaves:
        if not isinstance(leaf, Tensor) or leaf.is_floating_point() or leaf.is_complex():
            continue
        if leaf.dtype != torch.bool and bool((leaf == IGNORE_INDEX).any()):
            return True
        key = str(path[-1]).lower() if path else ""
        if "mask" in key and not bool(leaf.bool().all()):
            return True
    return False


def undeclared_error(module: Any, layout: str) -> str:
    """Why an undeclared loss cannot train a batch with ignored tokens under ``layout`` (e.g. "dp=2"), and how to
    declare it."""
    return (
        f"{type(module).__name__} does not say how its loss reduces over tokens, and its batch has tokens that take no"
        f" loss (labels -100, or padding): under {layout} the batch is split and the parts' means averaged -- a mean of"
        " means, not the token mean one device computes over the whole batch. Declare it: define loss_items(target)"
        " (how many items loss_fn averages over: the exact token mean, as lightning_hybrid's LanguageModel does), or"
        " set the class attribute loss_reduction = 'mean' to accept the mean of per-batch means, or 'sum' for a loss"
        " summed over items (docs/correctness.md)."
    )


def check_decomposition(loss_fn: Callable[[Any, Tensor], Tensor], loss_items: Optional[Callable[[Tensor], Tensor]],
                        reduction: Optional[str], output: Any, target: Tensor, name: str) -> Optional[str]:
    """Why ``loss_fn`` on ``(output, target)`` does not reduce as ``reduction`` says (see the module doc), or
    ``None``. Splits along the first dimension (the second where it has one row); nothing to check for a declared
    ``"mean"``, an output that is not a tensor, or a target that does not split. Called in the same way on every
    rank of a TP group (``loss_fn`` on logits split over the vocabulary is collective)."""
    if reduction == "mean" or not isinstance(output, Tensor) or not isinstance(target, Tensor) or target.dim() == 0:
        return None
    dim = 0 if target.size(0) > 1 else (1 if target.dim() > 1 and target.size(1) > 1 else None)
    if dim is None or output.dim() <= dim or output.size(dim) != target.size(dim):
        return None
    half = target.size(dim) // 2
    parts = [(_narrow(output, dim, 0, half), target.narrow(dim, 0, half)),
             (_narrow(output, dim, half, target.size(dim) - half), target.narrow(dim, half, target.size(dim) - half))]
    with torch.no_grad():
        value = loss_fn(output, target)
        rtol = _RTOL.get(value.dtype, _RTOL_FP32)
        whole = float(value)
        pieces = [float(loss_fn(o, t)) for o, t in parts]

        def _close(a: float, b: float) -> bool:
            return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)

        if reduction == "token_mean":
            assert loss_items is not None
            counts = [float(loss_items(t)) for _, t in parts]
            total = float(loss_items(target))
            if not _close(whole * total, sum(p * c for p, c in zip(pieces, counts))):
                return (f"{name}'s loss_items does not count the items its loss_fn averages over: the loss of the batch"
                        f" times its {total:g} items is {whole * total:.6g}, its halves' add up to"
                        f" {sum(p * c for p, c in zip(pieces, counts)):.6g} ({pieces[0]:.6g} x {counts[0]:g} +"
                        f" {pieces[1]:.6g} x {counts[1]:g}). The token weighting would weigh its parts wrongly: make"
                        " loss_items(target) count exactly the targets loss_fn averages over.")
        elif reduction == "sum":
            if not _close(whole, sum(pieces)):
                return (f"{name} declares loss_reduction='sum', but its loss_fn does not add up over the batch: the"
                        f" whole gives {whole:.6g}, its halves {pieces[0]:.6g} + {pieces[1]:.6g}. Declare what it is"
                        " ('mean', or loss_items for a token mean).")
        elif _close(whole, sum(pieces)) and not _close(whole, sum(pieces) / 2):
            return (f"{name}'s loss_fn adds up over the batch like a sum ({whole:.6g} for the whole, {pieces[0]:.6g}"
                    f" + {pieces[1]:.6g} for its halves), while a loss that says nothing is averaged over the ranks"
                    " and micro-batches: declare it with the class attribute loss_reduction = 'sum'.")
    return None


def _narrow(output: Tensor, dim: int, start: int, length: int) -> Tensor:
    return output[(slice(None),) * dim + (slice(start, start + length),)]  # indexing keeps `SplitLogits` split

