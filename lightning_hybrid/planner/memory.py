"""Predicted peak memory per device of a layout, by kind, as this codebase allocates it.

Notation: ``P`` the parameters on the device (its pipeline stages' layers, matrices split over ``tp``),
``dp`` the data-parallel size, ``b`` micro-batch sequences, ``s`` sequence length, ``h`` width, ``a`` heads.

Model states (ZeRO, Rajbhandari et al. 2020, Table 1, generalised to bytes per element ``(p, g, o)`` of
parameters, gradients and optimizer state, `PRECISIONS`): stage 0 ``(p + g + o) P``; 1 ``(p + g) P + o P/dp``;
2 ``p P + (g + o) P/dp``; 3 ``(p + g + o) P/dp``. With mixed precision and Adam ``(2, 2, 12)`` this is the
paper's 16Psi / 4Psi + 12Psi/Nd / 2Psi + 14Psi/Nd / 16Psi/Nd (`zero_model_states`). What `lightning_hybrid.zero`
does on top (docs/zero.md): stage 2 keeps the bucket backward fills and ``MAX_IN_FLIGHT`` being reduced
(``bucket_cap_mb`` each) beside its ``P/dp`` slices, and its full buffers ``P`` under PP or accumulation
(nothing is reduced before the window's last backward); stage 3 (FSDP2) keeps two units gathered (the one
running and the one prefetched; on gloo, which prefetches nothing, the one unit twice for a moment: FSDP2's flat
buffer and the parameters copied out of it), and in backward the running unit's unsharded gradients until its
reduce-scatter (``g`` bytes each: FSDP2 reduces in the parameters' dtype, the strategy sets no ``reduce_dtype``) --
a unit is a layer's part (its attention, its MLP, a MoE block's experts), a whole layer under ``torch.compile``
(``compile``; `fsdp_unit_params`) -- and under PP or accumulation a stage's parameters gathered and its gradients
unsharded (``P`` each, beside the ``P/dp`` shards). Without buckets (``dp = 1``) under PP a micro-batch's new
gradients exist beside the accumulated ones (``2 g P``; measured by ``benchmarks/bench_planner.py``).

Activations of one block for one micro-batch (Korthikanti et al. 2022, "Reducing activation recomputation",
section 4): ``s b (rep h / (tp if sequence parallel else 1) + split h / tp + scores a s / tp)`` bytes.
The paper's fp16 Megatron block with dropout and unfused attention has ``rep, split, scores = 10, 24, 5``
(`KORTHIKANTI`: ``sbh (34 + 5as/h)`` on one device, ``sbh (10 + 24/t + 5as/(ht))`` under TP, ``sbh/t (34 +
5as/h)`` with sequence parallelism). This codebase's block (`codebase_coefficients`, element size ``e``,
no dropout by default, ``scaled_dot_product_attention`` keeping no ``s x s`` scores): ``rep = 4e`` (the
two LayerNorms' inputs and outputs) and ``split = e (3 + 2 a_kv/a + 2 [a_kv < a] + 2F/h (4F/h SwiGLU))``
(q, k, v and their GQA repeats, the attention output and its contiguous copy, the MLP's hidden tensors).
``megatron-flash``: Korthikanti's block with flash attention (`KORTHIKANTI_FLASH`: no scores term; the kernels
keep ``O(s)`` per head). Selective recompute (``recompute="attention"``, `selective_coefficients`): Korthikanti's
block without its scores (``sbh (10 + 24/t)``, the paper's Table 2), this codebase's without SDPA's output, its
contiguous copy and GQA's repeated K/V (``split - e (2 + 2 [a_kv < a])``), every block kept so.
A checkpointed block keeps its input, ``e h`` per token (``/tp`` with sequence parallelism), and recomputes
one block at a time (not while the head's loss is alive: the larger of the two counts). The head keeps
``HEAD_ELEMENTS`` fp32 logit-sized tensors per token (logits, log-softmax, their gradients), ``V/tp`` wide with
``loss_parallel`` (the vocab-parallel cross entropy), else ``V`` (gathered). A schedule keeps several micro-batches
in flight (`in_flight`). Under PP a rank also holds a boundary's send and receive tensors, ``s b h p`` bytes each
(the residual stream is in the parameters' dtype: fp32 under ``bf16-mixed``).

Mixture of experts (`ModelSpec.experts`, `Layout.ep`): a MoE block's experts are split over ``ep`` ranks (``E/ep``
each, whole across TP: `rank_expert_params`) and ZeRO shards their states over their own data-parallel group of
``dp/ep`` ranks, the rest over ``dp`` as above: with ``P_x`` the experts on the device and ``P_n`` the rest, each
``P/dp`` above is ``P_n/dp + P_x/(dp/ep)``. Its activations: the block's without the dense MLP, with the shared
experts' (``split``, as the MLP's), plus the experts' (`expert_activation_bytes`): per (token, expert) pair the
rank computes -- ``k`` per token it routes under uniform routing, whatever ``ep`` (it receives as many pairs as it
sends) -- the expert's input and output rows and its hidden tensors, ``e (2h + 4F_e)`` (``2F_e`` not gated), and per
routed token the router's logits and fp32 probabilities ``(e + 4) E``. A rank routes all of its replica's tokens
under TP (the experts are replicated over TP), ``1/tp`` of them with sequence parallelism.

Context parallelism (`Layout.cp` = ``c``; `lightning_hybrid.context_parallel`): each rank holds ``s/c`` tokens of
every sequence (the zigzag split: chunks ``r`` and ``2c-1-r`` of ``2c``). Everything outside attention is local
to them, and attention computes ``s/c`` queries against all ``s`` keys: each layer all-gathers the keys and values
(``G`` = `gathered_kv_bytes`, ``2 b s (a/tp) d e``: per query head -- the implementation repeats grouped-query
attention's key/value heads before gathering -- ``a/tp`` heads of ``d`` under TP). What a batch's attention needs
depends on its documents (``documents``, default False):

* plain causal batches (pretraining: every row one document from position 0; the default): no mask. The gathered
  K and V are reordered into the sequence's order (``index_select``: a copy) and SDPA runs once per local chunk of
  ``s/(2c)`` queries against the keys up to that chunk's end, causal to the lower right (the fused kernels take it
  without a mask tensor);
* batches with documents (packed, left padding; ``documents=True``): a boolean ``(b, 1, s/c, s)`` mask of the
  whole sequence for the rank's queries, made once per micro-batch before its first layer and dropped once the
  batch's backward is done (`context_mask_bytes` with 1 byte per element, ``b (s/c) s``): all ``m`` micro-batches of
  the batch under PP (the schedule runs every backward before it ends), one without (gradient accumulation ends a
  batch per micro-batch) (`context_masks`), all of them alive at the peak; SDPA attends over the gathered keys with
  it, converting it to a float mask (``b (s/c) s`` elements of ``e`` bytes, one for all heads, whole on every TP
  rank).

Without activation checkpointing the implementation checkpoints each layer's gather and attention
(``torch.utils.checkpoint`` around them; backward gathers again and recomputes the attention); with it (full or
selective) it does not: the layer's own recomputation regathers and recomputes. So:

* per held block (each micro-batch in flight) the block's activations above are ``1/c`` -- its ``s/c`` tokens. Without
  activation checkpointing the gathered keys and values and SDPA's saved tensors are not kept, only the
  checkpoint's inputs (the block's own q, k, v and their GQA repeats, which the block keeps anyway) -- less SDPA's
  output (``e h`` per local token, `context_unsaved_split`: the checkpoint's output, which the output projection
  does not keep; its contiguous copy it does); `KORTHIKANTI`'s block (``megatron``) drops its scores term
  (``5 a s/h``), as under Korthikanti's selective recomputation: the attention core is recomputed. With activation
  checkpointing a held block is its checkpoint's input, ``1/c`` as at ``c = 1``, and the block being recomputed
  keeps its whole activations ``/c`` (SDPA's output too; `KORTHIKANTI`'s scores are in the transient) and SDPA's
  saved inputs -- the reordered K/V slices of the two chunk calls, views of one copy, or the gathered K/V under a
  mask -- which are the transient's;
* once, for the layer being computed (its forward, or its backward after its attention's or its own
  recomputation), its attention's transient (`context_transient_bytes`). Plain: in forward the gathered K and V
  and their reordered copy, ``2G``; in backward the reordered copy (SDPA's saved inputs, until the rank's first
  chunk's backward) and its gradients, ``2G``, beside the gradients SDPA returns for the first chunk's keys and
  values (``(r + 1)/(2c)`` of ``G`` on rank ``r``: up to ``G/2``) -- ``5G/2``. Documents: the gathered K and V and
  their gradients before the reduce-scatter, ``2G``, and SDPA's float mask. `KORTHIKANTI`'s block adds instead of
  the float mask its own scores of the one layer (``5 b (a/tp) (s/c) s`` bytes). SDPA's fused kernels (CUDA's
  flash and memory-efficient kernels; with a mask on CPU its flash kernel, on CUDA the memory-efficient and cuDNN
  ones) keep no ``(s/c) x s`` scores. This transient is counted in the larger-of with the head's
  (`estimate_memory`): the head's loss and a block's backward are not alive at once.

The head, a checkpointed block's input and the pipeline's boundary tensors are ``1/c`` too. Model states: the
``cp`` ranks of a replica hold the same parameters and reduce their gradients together with the ``dp`` ranks, so
ZeRO shards over ``dp c`` ranks (each ``P/dp`` above is ``P/(dp c)``; the experts' group is ``dp c/ep`` ranks).
Not counted: the model's own mask of the rank's tokens (``b (s/c)^2`` bytes, made and dropped in each layer), and
the copy of the K/V gradients NCCL's reduce-scatter is handed (one of K or V at a time). On CPU, SDPA has no kernel
for causal attention aligned to the lower right with fewer queries than keys: it materializes each plain chunk
call's mask, ``s/(2c) x end`` booleans, and keeps their float copy for backward (``(2c + 1) (s/(2c))^2 e`` bytes
for the layer being computed on ranks ``r > 0``, ``2c (s/(2c))^2 e`` on rank 0; CUDA's kernels do not).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from lightning_hybrid.pipeline.executor import SCHEDULES
from lightning_hybrid.pipeline.partition import partition_layers, stage_ranks
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB, MAX_IN_FLIGHT

from .layout import Layout
from .model import ModelSpec

__all__ = ["ActivationCoefficients", "DOCUMENT_KV_COPIES", "KORTHIKANTI", "KORTHIKANTI_FLASH", "MEGATRON_PRECISIONS",
           "MemoryEstimate", "PLAIN_KV_COPIES", "PRECISIONS", "block_activation_bytes", "block_coefficients",
           "selective_coefficients", "block_activations", "codebase_coefficients", "context_mask_bytes",
           "context_masks", "context_transient_bytes", "context_unsaved_split", "estimate_memory",
           "expert_activation_bytes", "fsdp_unit_params", "gathered_kv_bytes", "in_flight", "largest_block_params",
           "moe_block_count", "moe_coefficients", "pipeline_stages", "rank_block_counts", "rank_expert_params",
           "rank_layers", "rank_params", "routed_tokens", "zero_model_states"]

#: bytes per element: (parameters, gradients, optimizer state, activations). Adam keeps 2 moments.
#: ``32-true``: fp32 everything; ``bf16-mixed``: Lightning autocast, fp32 weights and gradients, bf16
#: activations; ``megatron``: fp16/bf16 weights and gradients, fp32 master weights + moments (ZeRO's K = 12),
#: Korthikanti's block with its unfused attention (the ``s x s`` scores kept: the 2021/2022 Megatron runs);
#: ``megatron-flash``: the same states, the block as the kernels users run since 2023 (flash / SDPA attention:
#: no ``s x s`` tensor, only ``O(s)`` per head -- the softmax's logsumexp, negligible beside ``h``).
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "megatron": (2, 2, 12, 2),
              "megatron-flash": (2, 2, 12, 2)}
#: Precisions whose block is `KORTHIKANTI`'s (``megatron-flash``: without its scores term).
MEGATRON_PRECISIONS = ("megatron", "megatron-flash")
#: fp32 logit-sized tensors per token the LM head keeps at its peak (logits, log-softmax, their gradients).
HEAD_ELEMENTS = 4


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes per token of one block: ``rep * h`` (outside TP regions), ``split * h`` (inside, ``/tp``) and
    ``scores * a * s`` (attention scores, ``/tp``); ``mlp``: the part of ``split`` that is the MLP's (which a MoE
    block replaces: `moe_coefficients`)."""

    rep: float
    split: float
    scores: float
    mlp: float = 0.0


#: The paper's MLP: GELU's input and output, 2 bytes each of ``4h`` (``16 sbh`` of the 24).
KORTHIKANTI = ActivationCoefficients(rep=10, split=24, scores=5, mlp=16)
#: Korthikanti's block with flash attention: the kernel keeps Q, K, V (counted) and its output (the output
#: projection's input, counted) and the logsumexp, ``O(s)`` per head; no scores, no softmax, no dropout mask.
KORTHIKANTI_FLASH = dataclasses.replace(KORTHIKANTI, scores=0.0)


def block_coefficients(model: ModelSpec, precision: str) -> ActivationCoefficients:
    """The block's coefficients at ``precision``: `KORTHIKANTI` (``megatron``), `KORTHIKANTI_FLASH`
    (``megatron-flash``), else this codebase's (`codebase_coefficients`)."""
    if precision == "megatron":
        return KORTHIKANTI
    if precision == "megatron-flash":
        return KORTHIKANTI_FLASH
    return codebase_coefficients(model, PRECISIONS[precision][3])


def selective_coefficients(c: ActivationCoefficients, model: ModelSpec, precision: str) -> ActivationCoefficients:
    """A block's coefficients under selective recompute (``recompute="attention"``: the attention core recomputed in
    backward). Korthikanti's block drops its scores term (the paper's Table 2: ``sbh (10 + 24/t)``); with flash
    attention there are none to drop (the kernel's output is the output projection's kept input). This codebase's
    block (`lightning_hybrid.activation_checkpointing`: the fused SDPA kernel is recomputed, and copies always are)
    drops SDPA's output and its contiguous copy, and under grouped-query attention the repeated K/V (copies):
    ``split - e (2 + 2 [a_kv < a])``."""
    if precision in MEGATRON_PRECISIONS:
        return dataclasses.replace(c, scores=0.0)
    e = PRECISIONS[precision][3]
    dropped = e * (2 + (2 if model.kv_heads < model.heads else 0))
    return dataclasses.replace(c, split=max(0.0, c.split - dropped))


def _mlp_split(model: ModelSpec, element: float, width: int) -> float:
    """An MLP's hidden tensors per token, in units of ``h`` bytes: 2 (4 gated) of ``width`` elements."""
    return element * (4 if model.gated_mlp else 2) * width / model.hidden


def context_unsaved_split(element: float) -> float:
    """The part of `codebase_coefficients`' ``split`` that a context-parallel block does not keep without activation
    checkpointing: SDPA's output (``e``; the output of the checkpointed attention, recomputed in backward)."""
    return float(element)


def codebase_coefficients(model: ModelSpec, element: int) -> ActivationCoefficients:
    """This codebase's block (see the module docstring) with ``element``-byte activations."""
    gqa = model.kv_heads < model.heads
    attention = 3 + 2 * model.kv_heads / model.heads + (2 if gqa else 0)
    mlp = _mlp_split(model, element, model.ffn)
    return ActivationCoefficients(rep=4 * element, split=element * attention + mlp, scores=0, mlp=mlp)


def moe_coefficients(c: ActivationCoefficients, model: ModelSpec, element: float) -> ActivationCoefficients:
    """A MoE block's activations outside its experts: ``c`` with the dense MLP's part of ``split`` replaced by the
    shared experts' (split over TP like it); the experts' own are `expert_activation_bytes`."""
    shared = _mlp_split(model, element, model.shared_ffn)
    return ActivationCoefficients(rep=c.rep, split=max(0.0, c.split - c.mlp) + shared, scores=c.scores, mlp=shared)


def routed_tokens(tokens: float, tp: int, sequence_parallel: bool) -> float:
    """Tokens one rank routes to experts out of its replica's ``tokens``: all of them under TP (the experts are
    replicated over TP), ``1/tp`` with sequence parallelism."""
    return tokens / tp if sequence_parallel else tokens


def expert_activation_bytes(model: ModelSpec, tokens: float, element: float, tp: int = 1,
                            sequence_parallel: bool = False) -> float:
    """Bytes one MoE block's experts and router keep for backward on one rank for a micro-batch of ``tokens``
    (its replica's): per pair computed (``k`` per routed token under uniform routing) the expert's input and
    output rows and hidden tensors, ``e (2h + 4F_e)`` (``2F_e`` not gated); per routed token the router's logits
    (``e``) and probabilities (fp32), ``(e + 4) E``."""
    if not model.experts:
        return 0.0
    routed = routed_tokens(tokens, tp, sequence_parallel)
    per_pair = element * (2 * model.hidden + (4 if model.gated_mlp else 2) * model.expert_ffn)
    return routed * (model.top_k * per_pair + (element + 4) * model.experts)


def block_activation_bytes(c: ActivationCoefficients, s: int, b: int, h: int, a: int, tp: int = 1,
                           sequence_parallel: bool = False, cp: int = 1) -> float:
    """Bytes one block keeps for backward for one micro-batch of ``b`` sequences of ``s`` tokens; under context
    parallelism ``cp`` the rank's ``s/cp`` tokens of each (their scores against all ``s`` keys); the attention over
    the whole sequence's transient and masks are `context_transient_bytes` and `context_mask_bytes`."""
    rep = c.rep / tp if sequence_parallel else c.rep
    return s * b * (h * (rep + c.split / tp) + c.scores * a * s / tp) / cp


def gathered_kv_bytes(model: ModelSpec, b: int, element: float, tp: int = 1, cp: int = 1) -> float:
    """Bytes of one block's keys and values all-gathered over ``cp`` ranks for a micro-batch of ``b`` sequences:
    ``2 b s (a/tp) d e`` (K and V of every token for the rank's ``a/tp`` query heads of ``d``: the implementation
    repeats grouped-query attention's key/value heads before gathering, `lightning_hybrid.context_parallel`); 0
    without context parallelism (the block's own keys and values are in its coefficients)."""
    if cp == 1:
        return 0.0
    return 2 * b * model.seq_len * model.heads * model.head_dim / tp * element


def context_mask_bytes(model: ModelSpec, b: int, element: float, cp: int = 1) -> float:
    """Bytes of the whole-sequence mask of the rank's queries under context parallelism for a micro-batch of ``b``
    sequences with documents: ``b (s/cp) s`` elements (the rank's queries against every key; one for all heads) of
    ``element`` bytes -- 1 for the boolean mask the implementation makes once per micro-batch, ``e`` for SDPA's float
    copy of it in the layer being computed; 0 without context parallelism (the model's own mask)."""
    if cp == 1:
        return 0.0
    return b * (model.seq_len // cp) * model.seq_len * element


def context_masks(layout: Layout, documents: bool = False) -> int:
    """How many boolean masks (`context_mask_bytes`) a rank keeps at its peak: 0 for plain causal batches (no
    mask); with ``documents`` one per micro-batch of the batch, dropped once the batch's backward is done -- all
    ``m`` under PP (the schedule runs every micro-batch's backward first), 1 without (each accumulated micro-batch
    is a batch of its own); 0 at ``cp = 1``."""
    if layout.cp == 1 or not documents:
        return 0
    return layout.micro_batches if layout.pp > 1 else 1


#: The gathered keys and values a plain causal batch's attention holds at its peak, in units of
#: `gathered_kv_bytes`: forward the gathered and their reordered copy (2); backward the reordered copy (SDPA's saved
#: inputs) and its gradients (2) beside the gradients SDPA returns for the rank's first chunk's keys (up to 1/2).
PLAIN_KV_COPIES = 2.5
#: The same with documents: the gathered K and V (SDPA's saved inputs) and their gradients.
DOCUMENT_KV_COPIES = 2.0


def context_transient_bytes(model: ModelSpec, b: int, precision: str, tp: int = 1, cp: int = 1,
                            documents: bool = False) -> float:
    """The transient of the attention of the layer being computed under context parallelism (its forward, or its
    backward after the attention's or the layer's recomputation): for plain causal batches ``5/2`` of the gathered
    K and V (`gathered_kv_bytes`; `PLAIN_KV_COPIES`: in forward the gathered and their reordered copy, in backward
    the reordered copy, its gradients and the first chunk's key/value gradients, up to half of them); with
    ``documents`` the gathered K and V and their gradients before the reduce-scatter (`DOCUMENT_KV_COPIES`) and
    SDPA's float copy of the mask (`context_mask_bytes` with ``e``-byte elements). `KORTHIKANTI`'s block
    (``megatron``) adds instead of the float mask its own scores of the one layer (``5 b (a/tp) (s/cp) s`` bytes).
    0 without context parallelism."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    kv = (DOCUMENT_KV_COPIES if documents else PLAIN_KV_COPIES) * gathered_kv_bytes(model, b, e, tp, cp)
    if precision == "megatron":  # (megatron-flash: no scores)
        return kv + block_activation_bytes(ActivationCoefficients(0.0, 0.0, KORTHIKANTI.scores), model.seq_len, b,
                                           model.hidden, model.heads, tp, cp=cp)
    return kv + (context_mask_bytes(model, b, e, cp) if documents else 0.0)


def zero_model_states(psi: float, dp: int, stage: int, precision: str = "megatron") -> float:
    """Bytes of parameters + gradients + optimizer state per device under ZeRO ``stage`` (the paper's table)."""
    p, g, o, _ = PRECISIONS[precision]
    return {0: (p + g + o) * psi, 1: (p + g) * psi + o * psi / dp, 2: p * psi + (g + o) * psi / dp,
            3: (p + g + o) * psi / dp}[stage]


def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations pipeline ``rank`` holds at its peak, in units of all its layers.

    GPipe: all ``m``. 1F1B: ``min(pp - rank, m)`` (Narayanan et al. 2021). Interleaved 1F1B: rank 0 holds
    ``pp + (pp - 1)/v`` (Korthikanti et al. 2022, section 4.2.3), the last rank ``1 + (v - 1) pp / v``
    (its warm-up of ``(v-1) pp`` chunk micro-batches). ZB-V: ``pp`` on every rank (Qi et al. 2024: the V shape
    balances 1F1B's peak across ranks)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return pp + (pp - 1) / v if rank == 0 else 1 + (v - 1) * pp / v
    if schedule == "zero_bubble":
        return float(pp)
    return float(min(pp - rank, m))


@functools.lru_cache(maxsize=None)
def pipeline_stages(model: ModelSpec, pp: int, stages_per_rank: int,
                    style: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The pipeline's stages (each a tuple of layer indices, ``0`` embed, ``L + 1`` head), split as the strategy
    splits them, and the rank of each (cached: the split is a search over the layers)."""
    stages = partition_layers(model.pipeline_layer_params(), pp * stages_per_rank)
    return tuple(tuple(stage) for stage in stages), tuple(stage_ranks(len(stages), pp, style))


@functools.lru_cache(maxsize=None)
def rank_layers(model: ModelSpec, pp: int, stages_per_rank: int, style: str) -> tuple[tuple[int, ...], ...]:
    """Pipeline layer indices (``0`` embed, ``L + 1`` head) of each rank, split as the strategy splits them."""
    stages, ranks = pipeline_stages(model, pp, stages_per_rank, style)
    return tuple(tuple(i for stage, r in zip(stages, ranks) if r == rank for i in stage) for rank in range(pp))


def _block_on_device(model: ModelSpec, moe: bool, tp: int, ep: int) -> float:
    """One block's parameters on a device: matrices and column-parallel biases split over ``tp``, norms and
    row-parallel biases whole; in a MoE block the router whole and the experts ``1/ep`` (whole across TP)."""
    norms = 2 * model.hidden * (2 if model.bias else 1)
    if not (moe and model.experts):
        whole = norms + (2 * model.hidden if model.bias else 0)  # norms, o/down bias
        return (model.block_params() - whole) / tp + whole
    experts = model.block_expert_params()
    whole = norms + (model.hidden if model.bias else 0) + model.router_params()  # norms, o bias, router
    whole += model.hidden if model.bias and model.shared_ffn else 0  # the shared experts' down bias
    return (model.block_params(True) - whole - experts) / tp + whole + experts / ep


def rank_params(model: ModelSpec, layers: tuple[int, ...], tp: int, ep: int = 1) -> float:
    """Parameters a device holds for pipeline ``layers`` under ``tp`` (and ``ep``): matrices, embeddings, the LM
    head and column-parallel biases split, norms and row-parallel biases whole; a MoE block's router whole and its
    experts ``1/ep`` (`rank_expert_params`)."""
    head = model.n_layer + 1
    first_moe = model.n_layer - model.moe_layers + 1
    dense = _block_on_device(model, False, tp, ep)
    moe = _block_on_device(model, True, tp, ep) if model.experts else dense
    total = 0.0
    for i in layers:
        if i == 0:
            total += model.embedding_params() / tp
        elif i == head:
            total += (model.hidden * (2 if model.bias else 1)
                      + (0 if model.tied_embeddings else model.vocab * model.hidden / tp))
        else:
            total += moe if i >= first_moe else dense
    return total


def moe_block_count(model: ModelSpec, layers: tuple[int, ...]) -> int:
    """How many of pipeline ``layers`` are MoE blocks."""
    if not model.experts:
        return 0
    first, last = model.n_layer - model.moe_layers + 1, model.n_layer
    return sum(1 for i in layers if first <= i <= last)


@functools.lru_cache(maxsize=None)
def rank_block_counts(model: ModelSpec, pp: int, stages_per_rank: int, style: str) -> tuple[tuple[int, int], ...]:
    """``(dense blocks, MoE blocks)`` of each pipeline rank (`rank_layers`)."""
    counts = []
    for layers in rank_layers(model, pp, stages_per_rank, style):
        moe = moe_block_count(model, layers)
        counts.append((sum(1 for i in layers if 0 < i <= model.n_layer) - moe, moe))
    return tuple(counts)


@functools.lru_cache(maxsize=None)
def largest_block_params(model: ModelSpec, tp: int, ep: int) -> float:
    """The parameters on a device of the largest block (dense or MoE): an FSDP2 unit under ``torch.compile``."""
    return max(rank_params(model, (i,), tp, ep) for i in {1, model.n_layer}) if model.n_layer else 0.0


def fsdp_unit_params(model: ModelSpec, tp: int, ep: int, compile: bool = False) -> float:
    """The parameters on a device of the largest FSDP2 unit of a block (`lightning_hybrid.zero.apply_fsdp_units`):
    the whole block under ``torch.compile`` (`largest_block_params`), else the largest of its parts -- the attention
    (``/tp``), the MLP or shared experts (``/tp``), a MoE block's experts (``E/ep``, whole across TP)."""
    if compile or not model.n_layer:
        return largest_block_params(model, tp, ep)
    parts = [model.attention_weights() / tp, model.mlp_weights(model.ffn if model.moe_layers < model.n_layer
                                                                 else model.shared_ffn) / tp]
    if model.experts:
        parts.append(model.block_expert_params() / ep)
    return max(parts)


def rank_expert_params(model: ModelSpec, layers: tuple[int, ...], ep: int = 1) -> float:
    """The expert parameters a device holds for pipeline ``layers``: ``E/ep`` experts of each MoE block (whole
    across TP), reduced and sharded over their own data-parallel group of ``dp/ep`` ranks."""
    return moe_block_count(model, layers) * model.block_expert_params() / ep


def block_activations(model: ModelSpec, layout: Layout, precision: str) -> tuple[float, float]:
    """Bytes one dense block and one MoE block keep for backward for one micro-batch on a device (the MoE block's
    experts included; 0 when the model has none); under context parallelism the rank's ``1/cp`` of them, without
    what the attention's transient counts (`context_transient_bytes`): `KORTHIKANTI`'s scores, and without
    activation checkpointing SDPA's output (`context_unsaved_split`: the checkpointed attention's, not kept). With
    activation checkpointing this is the block being recomputed, which keeps SDPA's output."""
    e = PRECISIONS[precision][3]
    coeffs = block_coefficients(model, precision)
    s, b, h, t, sp = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.sequence_parallel
    cp = layout.cp
    if layout.recompute_mode == "attention":  # selective recompute: the attention core's activations not kept
        coeffs = selective_coefficients(coeffs, model, precision)
    elif cp > 1:
        if precision in MEGATRON_PRECISIONS:  # Korthikanti: the scores of the layer being computed are the transient's
            coeffs = dataclasses.replace(coeffs, scores=0.0)
        elif not layout.activation_checkpointing:  # the attention is checkpointed: SDPA's output not kept
            coeffs = dataclasses.replace(coeffs, split=coeffs.split - context_unsaved_split(e))
    dense = block_activation_bytes(coeffs, s, b, h, model.heads, t, sp, cp)
    if not model.experts:
        return dense, 0.0
    moe = block_activation_bytes(moe_coefficients(coeffs, model, e), s, b, h, model.heads, t, sp, cp)
    return dense, moe + expert_activation_bytes(model, s * b // cp, e, t, sp)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per device of the fullest pipeline rank, by kind (``rank``: which one)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    rank: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "total": self.total}


def estimate_memory(model: ModelSpec, layout: Layout, precision: str, activation_scale: float = 1.0,
                    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, *, documents: bool = False,
                    compile: bool = False) -> MemoryEstimate:
    """The predicted peak of the first and the last pipeline rank (the fullest is returned). ``documents``: the
    batches hold documents (packed, left padding), whose attention under context parallelism takes a mask
    (`context_masks`, `context_transient_bytes`); default plain causal batches (pretraining). No effect at
    ``cp = 1``. ``compile``: the strategy's ``compile=True``, whose ZeRO-3 units are whole layers
    (`fsdp_unit_params`)."""
    pb, gb, ob, e = PRECISIONS[precision]
    lay = layout
    lay.check_model(model)
    spec = SCHEDULES[lay.schedule] if lay.pp > 1 else SCHEDULES["1f1b"]
    per_rank = lay.virtual_stages if lay.pp > 1 else 1
    ranks = rank_layers(model, lay.pp, per_rank, spec.style)
    counts = rank_block_counts(model, lay.pp, per_rank, spec.style)
    s, b, h, t, ep, cp = model.seq_len, lay.micro_batch, model.hidden, lay.tp, lay.ep, lay.cp
    dense_act, moe_act = block_activations(model, lay, precision)
    transient = context_transient_bytes(model, b, precision, t, cp, documents)  # the layer being computed's attention
    masks = context_masks(lay, documents) * context_mask_bytes(model, b, 1, cp)  # boolean, per micro-batch
    kept = s * b * h * e / (t if lay.sequence_parallel else 1) / cp  # a checkpointed block's input
    unit_p = fsdp_unit_params(model, t, ep, compile)  # the largest FSDP2 unit
    whole_window = lay.pp > 1 or lay.accumulation > 1  # gradients not reduced before the window ends
    bucket = bucket_cap_mb * 2**20
    best = None
    for rank in sorted({0, lay.pp - 1}):
        layers = ranks[rank]
        P = rank_params(model, layers, t, ep)
        experts = rank_expert_params(model, layers, ep)  # sharded over dp cp/ep ranks, the rest over dp cp
        dense_blocks, moe_blocks = counts[rank]
        sharded = lay.zero_stage > 0 and lay.shard > 1
        dp, edp = (lay.shard, lay.edp) if sharded else (1, 1)
        slices = (P - experts) / dp + experts / edp  # this device's share of what ZeRO shards
        if lay.zero_stage == 3 and sharded:
            gathered = P if whole_window else min(P, 2 * unit_p)  # the running unit and the prefetched one
            params = pb * (slices + gathered)
            # the running unit's unsharded gradients until its reduce-scatter (all of the stage's in a window)
            grads = gb * (slices + (P if whole_window else min(P, unit_p)))
        else:
            params = pb * P
            if lay.zero_stage == 2 and sharded and not whole_window:
                grads = gb * (slices + min(P, (1 + MAX_IN_FLIGHT) * bucket / gb))
            elif lay.pp > 1 and not sharded and lay.shard == 1:
                grads = 2 * gb * P  # no buckets: a micro-batch's new gradients beside the accumulated ones
            else:
                grads = gb * (P + (slices if lay.zero_stage == 2 and sharded else 0))
        optimizer = ob * (P - experts) / dp + ob * experts / edp
        f = in_flight(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages, rank)
        if lay.activation_checkpointing:
            held = (dense_blocks + moe_blocks) * f * kept
        else:
            held = dense_blocks * f * dense_act + moe_blocks * f * moe_act
        largest = max(dense_act if dense_blocks or not moe_blocks else 0.0, moe_act if moe_blocks else 0.0)
        head = 0.0
        if model.n_layer + 1 in layers:
            head_f = lay.micro_batches if (lay.pp > 1 and lay.schedule == "gpipe") else 1
            vocab = model.vocab / t if lay.loss_parallel else model.vocab
            head = head_f * s * b * (h * e + HEAD_ELEMENTS * 4 * vocab) / cp
        # The head's loss and a block's backward (a recomputed block's activations, the attention's transient under
        # CP) are not alive at once.
        act = held + masks + max(head, (largest if lay.activation_checkpointing else 0.0) + transient)
        # the stage boundary's send and receive tensors: the residual stream, in the parameters' dtype
        buffers = 2 * s * b * h * pb / cp if lay.pp > 1 else 0.0
        est = MemoryEstimate(params, grads, optimizer, act * activation_scale, buffers, rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best
