"""Packed documents in a ``transformers`` model without its ``(T x T)`` masks: verified, then used.

With ``position_ids`` of a packed or padded batch (`lightning_hybrid.core.batch`) a model's ``sdpa`` attention
builds a block-diagonal causal mask per forward, ``(B, 1, T, T)`` booleans (with the layer's sliding window where it
has one), and SDPA attends under it -- the reference, whose masks `check_document_masks` verifies. `DocumentAttention`
replaces that implementation by one registered with ``transformers``' ``AttentionInterface`` under a name of its own
(the model's config says it; the name is not saved with the config), which:

1. until verified, hands every layer the model's own mask (``sdpa_mask``) and returns SDPA's output under it, and on
   a layer's first call with such a mask also computes `lightning_hybrid.core.document_attention` -- one causal SDPA
   call per document, found from the ``position_ids`` the layer passes its attention (as FlashAttention-2's packed
   path reads them), the layer's ``sliding_window`` included -- and compares the two (`TOLERANCE` of the output's
   scale);
2. once some layer has been verified so and none has failed, builds no mask (what ``flash_attention_2`` gets) and
   runs the per-document attention.

Anything that does not verify -- a layer that does not pass its attention the positions, a mask that says more than
documents and a window (chunks, bidirectional parts), attention dropout, a different result -- keeps the model's own
masks for the rest of the run (`DocumentAttention.failed` says why). Either way each forward computes what the
model's masked SDPA computes, within fp32 noise. Not under context parallelism, which runs its own attention over the
whole sequence, nor for a model that does not run ``sdpa``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_hybrid.core.document_attention import document_attention

__all__ = ["DocumentAttention", "TOLERANCE"]

#: Largest difference from the masked SDPA, over the largest output, that verifies a layer: fp32, 16-bit outputs.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
TOLERANCE_16 = 2e-2


class DocumentAttention:
    """A model's attention for packed batches (module docstring), installed by the constructor: registers its
    attention and mask functions and makes them the model's implementation (``model.config._attn_implementation`` is
    then `name`). ``verified``: ids of the attention modules verified; ``failed``: why verification failed, if it
    did; ``fast``: whether the per-document attention runs (no masks)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.name = f"lightning_hybrid_documents_{id(self):x}"
        self.verified: set[int] = set()
        self.failed: Optional[str] = None
        self.fast = False
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, self.mask)
        model.set_attn_implementation(self.name)
        if model.config._attn_implementation != self.name:
            raise ValueError(f"{type(model).__name__} does not take a registered attention implementation")

    # ------------------------------------------------------------------ the model's calls
    def mask(self, *args: Any, **kwargs: Any) -> Optional[Tensor]:
        """transformers' mask for SDPA until verified; afterwards none where the batch gave no 2-D padding mask."""
        from transformers.masking_utils import sdpa_mask

        if not self.fast and self.verified and self.failed is None:
            self.fast = True  # every layer of a forward is called after its masks are made: the last was verified
        if self.fast and kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    def attention(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[Tensor, None]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        usable = self._usable(module, query, key, is_causal, kwargs)
        if attention_mask is None and self.fast and usable is None:
            out = document_attention(query, key, value, kwargs["position_ids"], dropout_p=dropout, scale=scaling,
                                     window=kwargs.get("sliding_window"))
            return out.transpose(1, 2).contiguous(), None
        reference = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
        if attention_mask is not None and not self.fast and self.failed is None and id(module) not in self.verified:
            self._verify(module, query, key, value, reference[0], dropout, scaling, usable, kwargs)
        return reference

    # ------------------------------------------------------------------ verification
    def _usable(self, module: nn.Module, query: Tensor, key: Tensor, is_causal: Optional[bool],
                kwargs: dict) -> Optional[str]:
        """Why the per-document attention cannot stand in for this call (``None``: it can)."""
        positions = kwargs.get("position_ids")
        if positions is None:
            return "the layer does not pass its attention the position_ids"
        if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            return "the attention is not causal"
        if query.size(-2) != key.size(-2):
            return "queries and keys of different lengths (a cache)"
        if tuple(positions.shape) != (query.size(0), query.size(-2)):
            return f"position_ids of shape {tuple(positions.shape)} for {query.size(0)} rows of {query.size(-2)}"
        for name in ("position_bias", "softcap", "s_aux", "sinks"):
            if kwargs.get(name) is not None:
                return f"the attention takes {name}"
        return None

    def _verify(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, reference: Tensor,
                dropout: float, scaling: Optional[float], usable: Optional[str], kwargs: dict) -> None:
        where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        if usable is not None:
            self.failed = f"{where}: {usable}"
            return
        if dropout:
            self.failed = f"{where}: attention dropout {dropout} (its random draws differ per call)"
            return
        # Outside autograd and the dispatch modes: a selective recomputation replays a layer's ops in order, and the
        # recomputed call, verified by then, does not run these.
        with torch.no_grad(), _disable_current_modes():
            ours = document_attention(query, key, value, kwargs["position_ids"], scale=scaling,
                                      window=kwargs.get("sliding_window")).transpose(1, 2)
            tolerance = TOLERANCE.get(query.dtype, TOLERANCE_16)
            scale = reference.detach().abs().max().clamp_min(torch.finfo(reference.dtype).tiny)
            error = float(((ours - reference.detach()).abs().max() / scale).item())
        if error <= tolerance:
            self.verified.add(id(module))
        else:
            self.failed = (f"{where}: the per-document attention differs from the model's masked SDPA by {error:.2e}"
                           " of the output's scale (its mask says more than documents and a sliding window)")
