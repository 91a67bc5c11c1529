"""The router's auxiliary (load-balancing) loss of a ``transformers`` mixture-of-experts model, as the model's own
training adds it, over the whole data-parallel batch.

A ``transformers`` MoE causal LM (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, GraniteMoE, ...) whose config says
``output_router_logits=True`` adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts,
num_experts_per_tok, attention_mask)`` to its loss, the function being its modeling module's own. That loss is a
product of batch-wide means (the fraction of tokens routed to each expert times the mean router probability of
each expert, over every layer and token), so it does not decompose over the ranks' shares of the batch: a rank's
own batch would give another loss (and other gradients) than one device on the global batch.

`RouterAuxLoss` therefore calls the model's own function on the router logits of the whole data-parallel batch:
each rank all-gathers the logits of every layer (rows of ``(tokens, experts)``: small) and the padding mask over
the data-parallel group, with a backward that hands each rank the gradient of its own rows summed over the
ranks. Every rank then holds the same global loss and adds it to its (token-mean) loss; with the strategy's token
weighting (the gradients of the ranks' loss sums, divided by the global batch's loss tokens) the sum over the ranks
of ``items_r * aux`` over the global items is exactly ``aux``: the gradient is that of one device.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["RouterAuxLoss", "gather_rows"]

_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


@dataclass(frozen=True)
class RouterAuxLoss:
    """The auxiliary loss of one ``transformers`` MoE model: its modeling module's ``load_balancing_loss_func``
    with the model's ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``."""

    fn: Callable[..., Any]
    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, model: nn.Module) -> Optional["RouterAuxLoss"]:
        """The model's auxiliary loss where its config asks for one (``output_router_logits``), else ``None``.
        A model that asks for one in a way this cannot reproduce is a ``ValueError`` (rather than training on the
        cross entropy alone, which would let the experts drift out of balance without a word)."""
        config = getattr(model, "config", None)
        if not getattr(config, "output_router_logits", False) or not _adds_aux_loss(model):
            return None
        fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
        missing = [name for name in _ATTRIBUTES if not hasattr(model, name)]
        if fn is None or missing:
            what = "no load_balancing_loss_func in its modeling module" if fn is None else f"no attribute {missing}"
            raise ValueError(
                f"{type(model).__name__} has output_router_logits=True, so its own training adds the router's"
                f" auxiliary loss, but it has {what}: lightning_hybrid cannot reproduce that loss. Set"
                " output_router_logits=False in the config to train on the cross entropy alone."
            )
        coef = float(model.router_aux_loss_coef)
        return cls(fn, int(model.num_experts), int(model.num_experts_per_tok), coef)

    def __call__(
        self, router_logits: Sequence[Tensor], padding: Optional[Tensor], group: Optional[dist.ProcessGroup],
        grad_scale: float = 1.0,
    ) -> Tensor:
        """The model's auxiliary loss (without the coefficient) of the whole batch over ``group`` (``None``: this
        rank's batch is the whole batch). ``router_logits``: this rank's, one ``(tokens, experts)`` tensor per MoE
        layer; ``padding``: the mask of the real tokens among them (``None``: all are); ``grad_scale``: of the
        gradient each rank's rows get (`gather_rows`)."""
        if not router_logits:
            raise ValueError("the model returned no router logits although output_router_logits=True")
        rows = router_logits[0].size(0)
        mask = padding.reshape(-1).float() if padding is not None else None
        if mask is not None and mask.numel() != rows:
            raise ValueError(f"the padding mask has {mask.numel()} tokens but the router saw {rows}")
        if group is not None and dist.get_world_size(group) > 1:
            router_logits = [gather_rows(logits, group, grad_scale) for logits in router_logits]
            ones = torch.ones(rows, device=router_logits[0].device)
            with torch.no_grad():
                mask = gather_rows(ones if mask is None else mask.to(ones.device), group)
        if mask is not None and bool(mask.all()):
            mask = None  # as the model's own call on a batch without padding (its attention_mask is None)
        if mask is not None:
            mask = mask.unsqueeze(0)  # (1, tokens): the function reads it as a (batch, sequence) mask
        return self.fn(tuple(router_logits), self.num_experts, self.top_k, mask)


def _adds_aux_loss(model: nn.Module) -> bool:
    """Whether the model's ``forward`` adds an auxiliary loss (DeepSeek-V3 records router logits but balances its
    experts with a bias instead: no loss)."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True  # cannot tell: `of` then says what it needs
    return "aux_loss" in source


def gather_rows(tensor: Tensor, group: dist.ProcessGroup, grad_scale: float = 1.0) -> Tensor:
    """The rows of ``tensor`` (first dimension; their number may differ between ranks) of every rank of ``group``,
    concatenated in rank order, on every rank. Differentiable: each rank gets the gradient of its own rows summed
    over the ranks (each rank's loss of the gathered rows is its own), times ``grad_scale``."""
    return _GatherRows.apply(tensor, group, grad_scale)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup, grad_scale: float) -> Tensor:
        size = dist.get_world_size(group)
        counts = torch.tensor([tensor.size(0)], device=tensor.device, dtype=torch.long)
        all_counts = [torch.zeros_like(counts) for _ in range(size)]
        dist.all_gather(all_counts, counts, group=group)
        sizes = [int(c) for c in all_counts]
        longest = max(sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.size(0)] = tensor
        pieces = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        ctx.group, ctx.sizes, ctx.rank, ctx.grad_scale = group, sizes, dist.get_rank(group), grad_scale
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        # Each rank's loss of the gathered rows: this rank's rows get the sum of every rank's gradient of them. A
        # reduce-scatter of uneven pieces, as an all-to-all (each rank's gradient of the rows of each) and a sum.
        mine = ctx.sizes[ctx.rank]
        pieces = grad.new_empty((len(ctx.sizes) * mine, *grad.shape[1:]))
        dist.all_to_all_single(pieces, grad.contiguous(), [mine] * len(ctx.sizes), ctx.sizes, group=ctx.group)
        summed = pieces.view(len(ctx.sizes), mine, *grad.shape[1:]).sum(0)
        return (summed if ctx.grad_scale == 1.0 else summed * ctx.grad_scale), None, None
