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
whole sequence.

A model that runs another implementation, one that takes no ``(T x T)`` mask -- ``flex_attention`` (transformers
builds its document ``BlockMask`` from the positions), ``flash_attention_2`` (its varlen path reads them), a kernel
registered with ``AttentionInterface`` -- keeps it: `VerifiedAttention` compares each attention module's first call
on a packed batch with one device's per-document causal attention on the same queries, keys and values (what the
masked reference computes), and raises, naming the layer and the difference, where they differ. `attention_for` picks
which.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_hybrid.core.batch import is_packed
from lightning_hybrid.core.document_attention import document_attention, document_spans

__all__ = ["DocumentAttention", "TOLERANCE", "VERIFIED_PREFIX", "VerifiedAttention", "attention_for",
           "first_packed_stance"]

#: The start of a `VerifiedAttention`'s implementation name: its masks are checked by running it, not by reading them.
VERIFIED_PREFIX = "lightning_hybrid_verified_"

#: Largest difference from the masked SDPA, over the largest output, that verifies a layer: fp32, 16-bit outputs.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
TOLERANCE_16 = 2e-2


def _usable(module: nn.Module, query: Tensor, key: Tensor, is_causal: Optional[bool], kwargs: dict) -> Optional[str]:
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


def _error_against_documents(query: Tensor, key: Tensor, value: Tensor, output: Tensor, scaling: Optional[float],
                             kwargs: dict) -> float:
    """How far ``output`` (``(B, T, heads, D)``, an attention call's) is from one device's causal attention of each
    document alone on the same queries, keys and values (`document_attention`, the call's sliding window), over the
    output's largest value. Outside autograd and the dispatch modes: a selective recomputation replays a layer's ops
    in order, and the recomputed call, verified by then, does not run these."""
    with torch.no_grad(), _disable_current_modes():
        ours = document_attention(query, key, value, kwargs["position_ids"], scale=scaling,
                                  window=kwargs.get("sliding_window")).transpose(1, 2)
        scale = output.detach().abs().max().clamp_min(torch.finfo(output.dtype).tiny)
        return float(((ours - output.detach()).abs().max() / scale).item())


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
        self.packed_layers: set[int] = set()  # decoder layers settled under a pipeline (`first_packed_stance`)
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

        usable = _usable(module, query, key, is_causal, kwargs)
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
    def _verify(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, reference: Tensor,
                dropout: float, scaling: Optional[float], usable: Optional[str], kwargs: dict) -> None:
        where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        if usable is not None:
            self.failed = f"{where}: {usable}"
            return
        if dropout:
            self.failed = f"{where}: attention dropout {dropout} (its random draws differ per call)"
            return
        error = _error_against_documents(query, key, value, reference, scaling, kwargs)
        if error <= TOLERANCE.get(query.dtype, TOLERANCE_16):
            self.verified.add(id(module))
        else:
            self.failed = (f"{where}: the per-document attention differs from the model's masked SDPA by {error:.2e}"
                           " of the output's scale (its mask says more than documents and a sliding window)")


class VerifiedAttention:
    """A model's own attention implementation that takes no ``(T x T)`` mask, verified on packed batches (module
    docstring): registered with its mask function under a name of its own that ends with the implementation's (what
    transformers' checks for FlashAttention read), made the model's implementation. ``verified``: ids of the attention
    modules verified."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.implementation = model.config._attn_implementation
        self.kernel = ALL_ATTENTION_FUNCTIONS[self.implementation]
        self.name = f"{VERIFIED_PREFIX}{id(self):x}_{self.implementation}"
        self.verified: set[int] = set()
        self.packed_layers: set[int] = set()  # decoder layers settled under a pipeline (`first_packed_stance`)
        #: Whether the forward under way is packed, where the caller found out (`first_packed_stance`); None: unknown
        #: (the attention then looks at the positions itself, a host sync).
        self.packed: Optional[bool] = None
        AttentionInterface.register(self.name, self.attention)
        if self.implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(self.name, ALL_MASK_ATTENTION_FUNCTIONS[self.implementation])
        model.set_attn_implementation(self.name)
        if model.config._attn_implementation != self.name:
            raise ValueError(f"{type(model).__name__} does not take a registered attention implementation")

    def attention(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.kernel(module, query, key, value, attention_mask, *args, **kwargs)
        positions = kwargs.get("position_ids")
        # Verified: a flag on the module (a compiled layer guards on it and compiles again without the check, once).
        if not getattr(module, self.name, False) and positions is not None and self.packed is not False and any(
                len(row) > 1 for row in document_spans(positions)):
            self._verify(module, query, key, value, attention_mask, out[0], args, kwargs)
        return out

    def _verify(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                output: Tensor, args: tuple, kwargs: dict) -> None:
        where = (f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) under"
                 f" attn_implementation={self.implementation!r}")
        is_causal = kwargs.get("is_causal")
        usable = _usable(module, query, key, is_causal, kwargs)
        if usable is not None:
            raise ValueError(f"{where}: packed documents cannot be verified ({usable}): train it on unpacked batches"
                             " padded on the right only, or with attn_implementation='sdpa' (or 'eager').")
        if module.training and (kwargs.get("dropout") or getattr(module, "attention_dropout", 0.0)):
            # Its output drew dropout masks: the comparison is of a call without them (no random draws).
            with torch.no_grad(), _disable_current_modes():
                output = self.kernel(module, query, key, value, attention_mask, *args, **{**kwargs, "dropout": 0.0})[0]
        error = _error_against_documents(query, key, value, output, kwargs.get("scaling"), kwargs)
        if not error <= TOLERANCE.get(query.dtype, TOLERANCE_16):
            raise ValueError(f"{where}: on a packed batch its attention differs from one device's attention of each"
                             f" document alone by {error:.2e} of the output's scale, so packed documents would see"
                             " each other: train it on unpacked batches padded on the right only, or with"
                             " attn_implementation='sdpa' (or 'eager').")
        self.verified.add(id(module))
        setattr(module, self.name, True)


def attention_for(model: nn.Module) -> "DocumentAttention | VerifiedAttention | None":
    """The attention of packed batches for ``model`` (not under context parallelism): `DocumentAttention` where it
    runs ``sdpa`` (its own masks where the model cannot switch), `VerifiedAttention` for an implementation that takes no
    dense mask; ``None`` for ``eager``, whose masks `lightning_hybrid.hf.decomposition.check_document_masks` reads."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        try:
            return DocumentAttention(model)
        except ValueError:  # a model that cannot switch its attention: its own masks, as before
            model.config._attn_implementation = "sdpa"
            return None
    return None if implementation in (None, "eager") else VerifiedAttention(model)


def first_packed_stance(attention: "DocumentAttention | VerifiedAttention | None", position_ids: Optional[Tensor],
                        layer: Optional[nn.Module] = None,
                        packed: Optional[Callable[[Tensor], bool]] = None) -> ContextManager:
    """Around a model's forward: until ``attention`` has verified a batch (or found it cannot), the forwards it
    verifies on -- packed ones; under `DocumentAttention`, whose masked SDPA verifies any batch with positions, those
    too -- run eagerly (``torch.compiler.set_stance("force_eager")``), so that the verification (host syncs,
    comparisons) stays out of compiled layers, which compile once it is settled, in whole graphs; a forward whose rows
    are one document each tells `VerifiedAttention` so (nothing to verify in it). Otherwise nothing. ``layer``: under
    ``pp > 1``, the decoder layer a pipeline calls (each settles on its own first such call); ``packed``: what says
    whether the positions are packed (`is_packed`, a host sync; the pipeline asks once a micro-batch)."""
    if attention is None or position_ids is None:
        return contextlib.nullcontext()
    settled = bool(attention.verified) if layer is None else id(layer) in attention.packed_layers
    if settled or getattr(attention, "failed", None) is not None:
        return contextlib.nullcontext()
    # (a host sync, outside compiled code, until the first batch it verifies on settles it)
    return _unsettled(attention, (packed or is_packed)(position_ids), layer)


@contextlib.contextmanager
def _unsettled(attention: "DocumentAttention | VerifiedAttention", packed: bool,
               layer: Optional[nn.Module]) -> Iterator[None]:
    # (``set_stance`` takes effect when called: entered here only, never left on by a context not entered)
    verifies = packed or isinstance(attention, DocumentAttention)
    if isinstance(attention, VerifiedAttention):
        attention.packed = packed
    try:
        with torch.compiler.set_stance("force_eager") if verifies else contextlib.nullcontext():
            yield
        if verifies and layer is not None:
            attention.packed_layers.add(id(layer))
    finally:
        if isinstance(attention, VerifiedAttention):
            attention.packed = None  # this forward's alone
