"""What context parallelism adds to a rank's activations, and the masks of batches with documents: the keys and
values all-gathered over the ``cp`` ranks (`gathered_kv_bytes`), the attention's transient of the layer being
computed (`context_transient_bytes`), the calls' masks and the documents a micro-batch keeps (`context_mask_bytes`,
`context_documents_bytes`, `context_masks`), and without context parallelism the documents' joined outputs
(`document_output_bytes`) or under compile SDPA's float copy of the document mask (`document_mask_bytes`); what
the attention moves beside the kept activations (`context_attention_traffic`, for the time model). The model:
`lightning_hybrid.planner.memory`'s docstring.
"""

from __future__ import annotations

from .activations import KORTHIKANTI, PRECISIONS, ActivationCoefficients, block_activation_bytes
from .layout import Layout
from .model import ModelSpec

__all__ = ["DOCUMENT_KV_COPIES", "PLAIN_KV_COPIES", "context_attention_traffic", "context_documents_bytes",
           "context_mask_bytes", "context_masks", "context_transient_bytes", "document_mask_bytes",
           "document_output_bytes", "gathered_kv_bytes"]


def gathered_kv_bytes(model: ModelSpec, b: int, element: float, tp: int = 1, cp: int = 1) -> float:
    """Bytes of one block's keys and values all-gathered over ``cp`` ranks for a micro-batch of ``b`` sequences:
    ``2 b s (a/tp) d e`` (K and V of every token for the rank's ``a/tp`` query heads of ``d``: the implementation
    gathers grouped-query attention's key/value heads once and repeats them per query head after the gather,
    `lightning_hybrid.parallel.context_parallel`; the exchange carries ``a_kv/a`` of it, `time.kv_exchange_bytes`); 0
    without context parallelism (the block's own keys and values are in its coefficients)."""
    if cp == 1:
        return 0.0
    return 2 * b * model.seq_len * model.heads * model.head_dim / tp * element


def context_mask_bytes(model: ModelSpec, b: int, element: float, cp: int = 1) -> float:
    """Bytes of the largest mask one context-parallel SDPA call takes for a micro-batch of ``b`` sequences with
    documents: rank 0's second chunk's ``s/(2cp)`` queries against all ``s`` keys, ``b (s/2cp) s`` elements (one for
    all heads) of ``element`` bytes -- 1 for the boolean block the call makes, ``e`` for SDPA's float copy of it;
    0 without context parallelism (the model's own mask)."""
    if cp == 1:
        return 0.0
    return b * (model.seq_len // (2 * cp)) * model.seq_len * element


def document_mask_bytes(model: ModelSpec, b: int, element: float) -> float:
    """Bytes a block keeps for backward of a micro-batch of ``b`` sequences with documents without context
    parallelism: SDPA's float copy of the model's boolean ``(b, 1, s, s)`` document mask (one for all heads, whole on
    every TP rank, ``element`` bytes: the queries' dtype), which each layer's SDPA makes and its kernel saves for
    backward -- measured: benchmarks/ACTIVATIONS.md, packed against plain batches at cp=1, 16 MiB more per layer at
    s = 2048 in fp32. The boolean mask itself (transformers builds it once per forward, the reference GPT per
    layer, unsaved) is not counted."""
    return b * model.seq_len * model.seq_len * element


def document_output_bytes(model: ModelSpec, b: int, element: float, tp: int = 1) -> float:
    """Bytes a block keeps for backward of a micro-batch of ``b`` sequences with documents without context
    parallelism beyond a plain batch's: the documents' attention outputs joined into the one the output projection
    keeps (``b s (a/tp) d``, ``element`` bytes), beside the calls' own, which SDPA keeps
    (`lightning_hybrid.core.document_attention`)."""
    return b * model.seq_len * model.heads * model.head_dim / tp * element


def context_documents_bytes(model: ModelSpec, b: int) -> float:
    """Bytes a micro-batch with documents keeps under context parallelism until its backward is done: the document
    of every token of its sequences, ``b s`` int64 (the calls make their masks from it)."""
    return 8.0 * b * model.seq_len


def context_masks(layout: Layout, documents: bool = False) -> int:
    """How many micro-batches' documents (`context_documents_bytes`) a rank keeps at its peak: 0 for plain causal
    batches; with ``documents`` each micro-batch's until the batch's backward is done -- all ``m`` under PP (the
    schedule runs every micro-batch's backward first), 1 without (each accumulated micro-batch is a batch of its
    own); 0 at ``cp = 1``."""
    if layout.cp == 1 or not documents:
        return 0
    return layout.micro_batches if layout.pp > 1 else 1


#: The whole sequence's keys and values the attention of the layer being computed holds at its peak, in units of
#: `gathered_kv_bytes`: in forward the all-gather's pieces and their copy in the sequence's order (2); in backward
#: that copy (SDPA's saved inputs) and the gradients SDPA returns for the longest prefix (2; measured at the peak,
#: benchmarks/ACTIVATIONS.md), the buffer summing the prefixes' gradients coming after the copy is released.
PLAIN_KV_COPIES = 2.0
#: The same with documents (attended per document: `lightning_hybrid.core.document_attention`, no mask).
DOCUMENT_KV_COPIES = 2.0


def context_transient_bytes(model: ModelSpec, b: int, precision: str, tp: int = 1, cp: int = 1,
                            documents: bool = False) -> float:
    """The transient of the attention of the layer being computed under context parallelism (its forward, or its
    backward after the attention's or the layer's recomputation): twice the gathered K and V (`gathered_kv_bytes`;
    `PLAIN_KV_COPIES`: the pieces and their copy in the sequence's order in forward, that copy and the longest
    prefix's gradients in backward); with ``documents`` the same (`DOCUMENT_KV_COPIES`: attended one SDPA call per
    document, no mask; `context_mask_bytes` what a call's mask would take). `KORTHIKANTI`'s block (``megatron``)
    adds its own scores of the one layer (``5 b (a/tp) (s/cp) s`` bytes). 0 without context parallelism."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    kv = (DOCUMENT_KV_COPIES if documents else PLAIN_KV_COPIES) * gathered_kv_bytes(model, b, e, tp, cp)
    if precision == "megatron":  # (megatron-flash: no scores)
        return kv + block_activation_bytes(ActivationCoefficients(0.0, 0.0, KORTHIKANTI.scores), model.seq_len, b,
                                           model.hidden, model.heads, tp, cp=cp)
    return kv


def context_attention_traffic(model: ModelSpec, b: int, precision: str, tp: int = 1, cp: int = 1) -> float:
    """Bytes of one block's context-parallel attention that are not the block's kept activations, for its
    element-wise traffic: the gathered K and V and their copy in the sequence's order (batches with documents the
    same: attended per document, no masks); `KORTHIKANTI`'s block its scores. 0 for ``cp = 1``."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    kv = gathered_kv_bytes(model, b, e, tp, cp)
    scores = context_transient_bytes(model, b, precision, tp, cp) - PLAIN_KV_COPIES * kv  # KORTHIKANTI's, else 0
    return 2 * kv + scores
