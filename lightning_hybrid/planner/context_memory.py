"""What context parallelism adds to a rank's activations, and the masks of batches with documents: the keys and
values all-gathered over the ``cp`` ranks (`gathered_kv_bytes`), the attention's transient of the layer being
computed (`context_transient_bytes`), the calls' masks and the documents a micro-batch keeps (`context_mask_bytes`,
`context_documents_bytes`, `context_masks`), and without context parallelism the documents' joined outputs
(`document_output_bytes`) or under compile SDPA's float copy of the document mask (`document_mask_bytes`); what
the attention moves beside the kept activations (`context_attention_traffic`, for the time model); with ring
attention (``ring``) what the ring holds instead (`ring_transient_bytes`) and what its merges move. The model:
`lightning_hybrid.planner.memory`'s docstring.
"""

from __future__ import annotations

from .activations import KORTHIKANTI, PRECISIONS, ActivationCoefficients, block_activation_bytes
from .layout import Layout
from .model import ModelSpec

__all__ = ["DOCUMENT_KV_COPIES", "PLAIN_KV_COPIES", "context_attention_traffic", "context_documents_bytes",
           "context_mask_bytes", "context_masks", "context_transient_bytes", "document_mask_bytes",
           "document_output_bytes", "gathered_kv_bytes", "ring_transient_bytes"]


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
                            documents: bool = False, ring: bool = False) -> float:
    """The transient of the attention of the layer being computed under context parallelism (its forward, or its
    backward after the attention's or the layer's recomputation): twice the gathered K and V (`gathered_kv_bytes`;
    `PLAIN_KV_COPIES`: the pieces and their copy in the sequence's order in forward, that copy and the longest
    prefix's gradients in backward); with ``documents`` the same (`DOCUMENT_KV_COPIES`: attended one SDPA call per
    document, no mask; `context_mask_bytes` what a call's mask would take). `KORTHIKANTI`'s block (``megatron``)
    adds its own scores of the one layer (``5 b (a/tp) (s/cp) s`` bytes). 0 without context parallelism.
    ``ring``: ring attention's instead (`ring_transient_bytes`; `KORTHIKANTI`'s scores of one chunk pair)."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    scores = 0.0
    if precision == "megatron":  # (megatron-flash: no scores)
        scores = block_activation_bytes(ActivationCoefficients(0.0, 0.0, KORTHIKANTI.scores), model.seq_len, b,
                                        model.hidden, model.heads, tp, cp=cp)
    if ring:  # a chunk pair's scores: s/(2cp) queries against s/(2cp) keys
        return ring_transient_bytes(model, b, e, tp, cp) + scores / (4 * cp)
    return (DOCUMENT_KV_COPIES if documents else PLAIN_KV_COPIES) * gathered_kv_bytes(model, b, e, tp, cp) + scores


def ring_transient_bytes(model: ModelSpec, b: int, element: float, tp: int = 1, cp: int = 2) -> float:
    """What ring attention (`lightning_hybrid.parallel.context_parallel.ring`) holds at its peak beyond its inputs,
    the layer's backward (the larger pass), with ``u`` = `gathered_kv_bytes` ``/ cp`` (the rank's own K and V at
    ``a/tp`` query heads), ``r = a_kv/a`` and ``e`` = ``element`` bytes:

        2 r u  +  2 r u (4/e)  +  5 (2u/e)  [+ u/2 where r < 1]

    two ranks' keys and values (the visiting ones and the next, arriving: ``a_kv`` heads travel), two ranks' key
    and value gradients in fp32 (the ones arriving and the ones sent on), five fp32 tensors of the rank's queries'
    size (``2u/e``: the query gradient's accumulators and their joined copy, one chunk pair's query, key and value
    gradients at ``a`` heads), and grouped-query attention's keys and values repeated to ``a`` heads for one chunk
    pair. Nothing of the whole sequence: with documents the same (each pair's mask is one pair's, counted in no
    term). Measured (`ring_attention` alone, 2 and 4 gloo ranks, T = 2048, 4 heads of 32 or 8 query heads over 1
    key/value head, fp32 and bf16, the live tensor bytes beyond the inputs and the output's gradient): 6.75 u
    against 6.5, 11.0 against 11.0, 3.45 against 3.5, 6.52 against 6.25 at cp 2; at cp 4 up to 16% more (7.75 u
    against 6.5, fp32 and r = 1). The forward holds less (two ranks' keys and values, the output's fp32
    accumulators, their joined copy and one pair's output: 2.3-5.1 u measured)."""
    u = gathered_kv_bytes(model, b, element, tp, cp) / cp
    r = model.kv_heads / model.heads
    return 2 * r * u + 2 * r * u * 4 / element + 5 * 2 * u / element + (u / 2 if r < 1 else 0.0)


def context_attention_traffic(model: ModelSpec, b: int, precision: str, tp: int = 1, cp: int = 1,
                              ring: bool = False) -> float:
    """Bytes of one block's context-parallel attention that are not the block's kept activations, for its
    element-wise traffic (per pass: the time model counts three): the gathered K and V and their copy in the
    sequence's order (batches with documents the same: attended per document, no masks); `KORTHIKANTI`'s block its
    scores. ``ring``: the merges of ring attention instead -- at each of its ``cp`` steps the forward reads and
    writes the output's fp32 accumulators and reads the pair's output, the backward the same for the query
    gradient's and adds to the key and value gradients (``a_kv`` heads, fp32): ``cp O (3 + 2 a_kv/a)`` a pass, ``O``
    the rank's output in fp32 (`KORTHIKANTI`: its scores, a chunk pair's at every step). 0 for ``cp = 1``."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    kv = gathered_kv_bytes(model, b, e, tp, cp)
    scores = context_transient_bytes(model, b, precision, tp, cp) - PLAIN_KV_COPIES * kv  # KORTHIKANTI's, else 0
    if ring:
        output = kv / cp * 2 / e  # the rank's queries' size in fp32
        return cp * output * (3 + 2 * model.kv_heads / model.heads) + scores
    return 2 * kv + scores
