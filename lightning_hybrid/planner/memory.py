"""Predicted peak memory per device of a layout, by kind, as this codebase allocates it.

Notation: ``P`` the parameters on the device (its pipeline stages' layers, matrices split over ``tp``),
``dp`` the data-parallel size, ``b`` micro-batch sequences, ``s`` sequence length, ``h`` width, ``a`` heads.

Model states (ZeRO, Rajbhandari et al. 2020, Table 1, generalised to bytes per element ``(p, g, o)`` of
parameters, gradients and optimizer state, `PRECISIONS`): stage 0 ``(p + g + o) P``; 1 ``(p + g) P + o P/dp``;
2 ``p P + (g + o) P/dp``; 3 ``(p + g + o) P/dp``. With mixed precision and Adam ``(2, 2, 12)`` this is the
paper's 16Psi / 4Psi + 12Psi/Nd / 2Psi + 14Psi/Nd / 16Psi/Nd (`zero_model_states`). What
`lightning_hybrid.parallel.zero` does on top (docs/zero.md): stage 2 keeps the bucket backward fills and
``MAX_IN_FLIGHT`` being reduced
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
The paper's fp16 Megatron block (GPT: dropout, unfused attention, GELU MLP of ``4h``) has ``rep, split, scores =
10, 24, 5`` (`KORTHIKANTI`: ``sbh (34 + 5as/h)`` on one device, ``sbh (10 + 24/t + 5as/(ht))`` under TP, ``sbh/t (34
+ 5as/h)`` with sequence parallelism). ``megatron`` and ``megatron-flash`` count the same tensors for the model's
shapes (`korthikanti_coefficients`): ``rep = 8`` (the two LayerNorms' inputs, the QKV and first MLP matmuls' inputs)
``+ 2`` with dropout (its two masks, 1 byte each), ``split = 2 q + 4 kv + 2 q + 2 n F/h`` (Q; K and V at the key/value
heads' width -- grouped-query attention keeps ``a_kv`` heads, ``kv = a_kv d/h``; the output projection's input; the
MLP's ``n`` ffn-wide tensors: 2 for GELU, 3 for SwiGLU -- Megatron's fused ``bias_swiglu`` keeps its ``2F`` input and
the second matmul's ``F`` input), ``scores`` 5 (the softmax's output, its dropout mask and output; 2 without
dropout). Megatron-LM's ``report_theoretical_memory`` (megatron/training/theoretical_memory_usage.py) has ``sbh (18 +
4F/h)``, this count for GELU at any ``F``. ``megatron`` is the paper's (unfused attention, dropout: the 2021/2022
runs); ``megatron-flash`` the runs since 2023 (Llama 3, MPT): flash attention (no scores term; the kernels keep
``O(s)`` per head) and dropout 0 (no masks: PyTorch's dropout returns its input at ``p = 0``); ``megatron-core``
the same block with Megatron-Core's fp32 main gradients (its bf16 default). This codebase's
block (``32-true``, ``bf16-mixed``: autocast, fp32 weights and residual stream; ``p`` the residual stream's bytes, 4
in both, ``e`` the matmul outputs', 4 or 2; ``scaled_dot_product_attention`` keeping no ``s x s`` scores; no dropout by
default; measured per mode, docs/planner.md's table), without recompute (`codebase_coefficients`: autograd's saved
tensors): ``rep = 2 p + 2 norm + I(3) + I(n_in)`` (the block's input and mid residual sum, the norms' inputs;
LayerNorm's statistics ``8/h`` or eager RMSNorm's normalised fp32 input and ``rsqrt`` ``4 + 4/h``; the norms' outputs
as the matmuls keep them, ``I(k)`` = 4 under ``32-true``, ``k e`` under autocast, which casts them per linear: 3 for
q, k, v, ``n_in`` 2 gated MLP, 1 plain) and ``split = e (2 q + 2 kv') + 4 a/h + e n F/h`` (SDPA's inputs and output
-- the output projection's input, a view --, ``kv' = q`` for the reference GPT's repeated GQA heads, ``kv`` for
transformers' ``enable_gqa``; SDPA's fp32 logsumexp; ``n`` 2 GELU, 4 eager SwiGLU). Selective recompute
(``recompute="attention"``, `selective_coefficients`): Korthikanti's block without its scores (``sbh (10 + 24/t)``,
the paper's Table 2); this codebase's (`attention_coefficients`) every output of an op the policy does not
recompute, needed by backward or not -- ``rep = 2 p + 2 norm + 2 e`` (LayerNorm's fp32 output and statistics ``4 +
8/h``, RMSNorm's every op ``12 + 12/h``; the output and down projections' outputs), ``split = e (q + 2 kv) +
[rotary] (12 + 1.5 e)(q + kv) + e n F/h`` -- more than without recompute on a Llama layer (eager RMSNorm's and the
rotation's intermediates), about as much on the reference GPT.
Pointwise selective recompute (``recompute="pointwise"``, `pointwise_coefficients`: the attention core and every
element-wise op recomputed, views, copies and random ops too; kept: the outputs of matmuls, of norms that are one op,
of reductions and collectives, and the block's input):
``rep = p + 2 e + norms`` (the block's input in the residual stream's dtype ``p``, the parameters'; the output
projection's and the MLP's down projection's outputs, a TP row layer's reduced output; LayerNorm -- one
``native_layer_norm`` op, which autocast runs in fp32 -- its two fp32 outputs and statistics, ``2 (4 + 8/h)``;
eager RMSNorm, element-wise but for its mean, ``2 x 4/h``) and ``split = e (q + 2 kv + [rotary] (q + kv) + n F/h)``
(the q, k, v projections' outputs; with rotary embeddings the ``cat`` of ``rotate_half`` for Q and K, not
element-wise; ``n`` = 1 matmul output of ``F`` wide, 2 gated): GPT at ``F = 4h``, bf16-mixed ``sbh (16 + 14/t)``.
LayerNorm is taken for a model with learned positions or biases (the reference GPT, GPT-2, GPT-NeoX, Phi), RMSNorm
for the others (Llama, Mistral, Qwen, Gemma; `uses_layer_norm`). Measured (tests/planner/test_planner_memory.py:
the bytes one block of the reference GPT and of a Hugging Face Llama keeps for backward, fp32 and bf16 autocast):
within 1%. Not for the ``megatron`` precisions (`MEGATRON_PRECISIONS`: Korthikanti's count stands for Megatron-LM
runs, which have no such recompute mode): ``ValueError``.
A checkpointed block keeps its input, ``p h`` per token (the residual stream: fp32 under ``bf16-mixed``; ``/tp``
with sequence parallelism), and recomputes
one block at a time (not while the head's loss is alive: the larger of the two counts). The head keeps
``HEAD_ELEMENTS`` fp32 logit-sized tensors per token (logits, log-softmax, their gradients), ``V/tp`` wide with
``loss_parallel`` (the vocab-parallel cross entropy), else ``V`` (gathered). A schedule keeps several micro-batches
in flight (`in_flight`), of each of a rank's local stages as many as the schedule's order leaves it at the peak
(`held_micro_batches`: interleaved 1F1B's local stages need not be equal -- the embedding and the head take a
block's place). Under PP a rank also holds a boundary's send and receive tensors, ``s b h p`` bytes each
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

Batches with documents (packed, left padding; ``documents=True``) without context parallelism attend one SDPA call
per document (`lightning_hybrid.core.document_attention`; a transformers model once its first packed forward has
verified it): no mask; the calls' outputs, which SDPA keeps, are joined into the one the output projection keeps,
``b s (a/tp) d e`` more per held block than a plain batch's (`document_output_bytes`; measured:
benchmarks/ACTIVATIONS.md, the reference GPT 4 x 128 at T=2048, fp32: packed 76.30 MiB against plain 72.30, 4
layers x 1 MiB). Under ``compile`` the attention takes the traceable mask instead: each layer's SDPA converts the
boolean ``(b, 1, s, s)`` document mask to the queries' dtype and its kernel keeps that copy for backward,
``b s^2 e`` bytes per held block (one for all heads, whole on every TP rank; `document_mask_bytes`), the recomputed
block's only under activation checkpointing.

Context parallelism (`Layout.cp` = ``c``; `lightning_hybrid.parallel.context_parallel`): each rank holds ``s/c`` tokens
of every sequence (the zigzag split: chunks ``r`` and ``2c-1-r`` of ``2c``). Everything outside attention is local
to them, and attention computes ``s/c`` queries against all ``s`` keys: each layer all-gathers the keys and values
(``G`` = `gathered_kv_bytes`, ``2 b s (a/tp) d e``: per query head -- the implementation gathers grouped-query
attention's key/value heads once and repeats them per query head after the gather -- ``a/tp`` heads of ``d``
under TP). What a batch's attention needs
depends on its documents (``documents``, default False):

The gathered K and V are put in the sequence's order as they arrive (one copy of the pieces) and SDPA runs once
per local chunk of ``s/(2c)`` queries against the keys up to that chunk's end (``end`` = ``s`` for rank 0's second
chunk):

* plain causal batches (pretraining: every row one document from position 0; the default): no mask -- causal to
  the lower right, which the fused kernels take without a mask tensor;
* batches with documents (packed, left padding; ``documents=True``): one SDPA call per document a chunk meets, its
  queries against its keys (`lightning_hybrid.core.document_attention.document_block_attention`), no mask of the
  block (before, the boolean block ``(b, 1, s/(2c), end)`` and SDPA's float copy of it, `context_mask_bytes`); what a
  micro-batch keeps from its first layer until its backward is done is its tokens' documents, ``b s`` int64
  (`context_documents_bytes`): all ``m`` micro-batches of the batch under PP (the schedule runs every backward
  before it ends), one without (`context_masks`).

Without activation checkpointing the implementation checkpoints each layer's gather and attention
(``torch.utils.checkpoint`` around them; backward gathers again and recomputes the attention); with it (full or
selective) it does not: the layer's own recomputation regathers and recomputes. So:

* per held block (each micro-batch in flight) the block's activations above are ``1/c`` -- its ``s/c`` tokens. Without
  activation checkpointing the gathered keys and values and SDPA's saved tensors are not kept, only the
  checkpoint's inputs (the block's own q, k, v and their GQA repeats, which the block keeps anyway) -- less SDPA's
  logsumexp and, for a rotary model under ``bf16-mixed``, plus its fp32 Q and K (`context_unsaved_split`; SDPA's
  output, the checkpoint's, is not kept, its copy in the tokens' order is, as SDPA's output at ``cp = 1``);
  `KORTHIKANTI`'s block (``megatron``) drops its scores term
  (``5 a s/h``), as under Korthikanti's selective recomputation: the attention core is recomputed. With activation
  checkpointing a held block is its checkpoint's input, ``1/c`` as at ``c = 1``, and the block being recomputed
  keeps its whole activations ``/c`` (SDPA's output too; `KORTHIKANTI`'s scores are in the transient) and SDPA's
  saved inputs -- the reordered K/V slices of the two chunk calls, views of one copy, or the gathered K/V under a
  mask -- which are the transient's;
* once, for the layer being computed (its forward, or its backward after its attention's or its own
  recomputation), its attention's transient (`context_transient_bytes`): in forward the gathered pieces and their
  copy in the sequence's order, ``2G``; in backward that copy (SDPA's saved inputs) and the gradients SDPA returns
  for the longest prefix, ``2G`` (measured: benchmarks/ACTIVATIONS.md's "whole-sequence K/V" at the peak), the
  prefixes' gradients then summed into one buffer of ``G`` for the reduction (with documents the same: attended
  per document, no mask). `KORTHIKANTI`'s block adds its own scores of the one layer (``5 b (a/tp) (s/c) s``
  bytes). SDPA's fused kernels (CUDA's flash and memory-efficient kernels; with a mask on CPU its flash kernel, on
  CUDA the memory-efficient and cuDNN ones) keep no ``(s/c) x s`` scores. This transient is counted in the
  larger-of with the head's (`estimate_memory`): the head's loss and a block's backward are not alive at once.
  Ring attention (`Layout.cp_attention` ``"ring"``) holds no whole-sequence K/V: its transient is two ranks' K/V and
  their fp32 gradients and a few fp32 tensors of the rank's queries' size (`ring_transient_bytes`, measured); the
  ring is not checkpointed (it keeps the rank's own q, k, v, output and log-sum-exp, what SDPA keeps at ``c = 1``),
  so a held block keeps ``1/c`` of its ``c = 1`` activations, without `context_unsaved_split`.

The head, a checkpointed block's input and the pipeline's boundary tensors are ``1/c`` too. Model states: the
``cp`` ranks of a replica hold the same parameters and reduce their gradients together with the ``dp`` ranks, so
ZeRO shards over ``dp c`` ranks (each ``P/dp`` above is ``P/(dp c)``; the experts' group is ``dp c/ep`` ranks).
Not counted: the model's own mask of the rank's tokens (``b (s/c)^2`` bytes, made and dropped in each layer), and
the copy of the K/V gradients NCCL's reduce-scatter is handed (one of K or V at a time). On CPU, SDPA has no kernel
for causal attention aligned to the lower right with fewer queries than keys: it materializes each plain chunk
call's mask, ``s/(2c) x end`` booleans, and keeps their float copy for backward (``(2c + 1) (s/(2c))^2 e`` bytes
for the layer being computed on ranks ``r > 0``, ``2c (s/(2c))^2 e`` on rank 0; CUDA's kernels do not).

The parts live apart: a block's activations in `lightning_hybrid.planner.activations`, context parallelism's and
the documents' masks in `lightning_hybrid.planner.context_memory`, the layers' and parameters' placement in
`lightning_hybrid.planner.placement`; this module (which re-exports them) the model states, the micro-batches a
schedule holds and the estimate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from lightning_hybrid.parallel.pipeline.executor import SCHEDULES
from lightning_hybrid.parallel.zero import AUTO_WINDOW_FRACTION, DEFAULT_BUCKET_CAP_MB, MAX_IN_FLIGHT
from lightning_hybrid.parallel.zero.buckets import stage2_cap

# The parts (re-exported here, as they were defined here): a block's activations, context parallelism's and the
# documents' masks, and where the layers and parameters are.
from .activations import (
    CODEBASE_GATED_TENSORS,
    KORTHIKANTI,
    MEGATRON_GATED_TENSORS,
    MEGATRON_PRECISIONS,
    NORM_OUTPUT_BYTES,
    POINTWISE_GATED_TENSORS,
    POINTWISE_PLAIN_TENSORS,
    PRECISIONS,
    QKV_PROJECTIONS,
    ActivationCoefficients,
    attention_coefficients,
    block_activation_bytes,
    block_activations,
    block_coefficients,
    codebase_coefficients,
    context_unsaved_split,
    expert_activation_bytes,
    korthikanti_coefficients,
    mlp_tensors,
    moe_coefficients,
    pointwise_coefficients,
    pointwise_recomputed_bytes,
    routed_tokens,
    selective_coefficients,
    uses_layer_norm,
)
from .context_memory import (
    DOCUMENT_KV_COPIES,
    PLAIN_KV_COPIES,
    context_documents_bytes,
    context_mask_bytes,
    context_masks,
    context_transient_bytes,
    document_mask_bytes,
    document_output_bytes,
    gathered_kv_bytes,
)
from .layout import Layout
from .model import ModelSpec
from .placement import (
    fsdp_unit_params,
    largest_block_params,
    moe_block_count,
    pipeline_stages,
    rank_block_counts,
    rank_chunk_blocks,
    rank_expert_params,
    rank_layers,
    rank_params,
    rank_trainable,
)

__all__ = ["CODEBASE_GATED_TENSORS", "DOCUMENT_KV_COPIES", "KORTHIKANTI", "MEGATRON_GATED_TENSORS",
           "MEGATRON_PRECISIONS", "NORM_OUTPUT_BYTES", "PLAIN_KV_COPIES", "POINTWISE_GATED_TENSORS",
           "POINTWISE_PLAIN_TENSORS", "PRECISIONS", "QKV_PROJECTIONS", "ActivationCoefficients", "MemoryEstimate",
           "attention_coefficients", "block_activation_bytes", "block_activations", "block_coefficients",
           "codebase_coefficients",
           "context_documents_bytes", "context_mask_bytes", "context_masks", "context_transient_bytes",
           "context_unsaved_split", "document_mask_bytes", "document_output_bytes", "estimate_memory",
           "expert_activation_bytes",
           "fsdp_unit_params", "gathered_kv_bytes", "held_micro_batches", "in_flight", "korthikanti_coefficients",
           "largest_block_params", "mlp_tensors", "moe_block_count", "moe_coefficients", "pipeline_stages",
           "rank_block_counts", "rank_chunk_blocks", "rank_expert_params", "rank_layers", "rank_params",
           "resolve_grad_reduce",
           "pointwise_coefficients", "pointwise_recomputed_bytes", "routed_tokens", "selective_coefficients",
           "uses_layer_norm", "zero_model_states"]

#: fp32 logit-sized tensors per token the LM head keeps at its peak (logits, log-softmax, their gradients).
HEAD_ELEMENTS = 4



def zero_model_states(psi: float, dp: int, stage: int, precision: str = "megatron") -> float:
    """Bytes of parameters + gradients + optimizer state per device under ZeRO ``stage`` (the paper's table)."""
    p, g, o, _ = PRECISIONS[precision]
    return {0: (p + g + o) * psi, 1: (p + g) * psi + o * psi / dp, 2: p * psi + (g + o) * psi / dp,
            3: (p + g + o) * psi / dp}[stage]


def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations pipeline ``rank`` holds at its peak, in units of all its layers (equal local
    stages; `held_micro_batches` weighs unequal ones).

    GPipe: all ``m``. 1F1B: ``min(pp - rank, m)`` (Narayanan et al. 2021). Interleaved 1F1B: its warm-up forwards
    and the first steady one, ``(v-1) pp + 2 (pp-1-rank) + 1`` local-stage micro-batches (at most ``m v``: all
    forwards first), ``1/v`` of the rank's layers each -- rank 0 ``pp + (pp-1)/v`` (Korthikanti et al. 2022,
    section 4.2.3). ZB-V: ``pp`` on every rank (Qi et al. 2024: the V shape balances 1F1B's peak across ranks)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v
    if schedule == "zero_bubble":
        return float(pp)
    return float(min(pp - rank, m))


@functools.lru_cache(maxsize=1 << 16)  # a search asks again for the same schedule and stages (other dp, ZeRO)
def held_micro_batches(schedule: str, pp: int, m: int, v: int, rank: int, chunks: tuple[float, ...]) -> float:
    """The peak over the schedule of ``sum_c n_c chunks[c]``: ``n_c`` the micro-batches whose activations the rank's
    ``c``-th local stage holds, ``chunks[c]`` what one micro-batch of it holds (its blocks' activations: local stages
    need not be equal -- the embedding's and the head's take a block's place). Interleaved 1F1B replays the
    schedule's order (Megatron-LM's ``forward_backward_pipelining_with_interleaving``, which
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` follows): ``(v-1) pp + 2 (pp-1-rank)`` warm-up forwards,
    then one forward and one backward at a time; forward ``k`` runs local stage ``(k // pp) % v``, backward ``k``
    stage ``v - 1 - (k // pp) % v``. With equal stages rank 0's peak is `in_flight`'s ``pp + (pp-1)/v`` stages' worth
    (Korthikanti et al. 2022, section 4.2.3), the last rank's ``1/v`` of a micro-batch above its warm-up's. Other
    schedules: `in_flight` of the whole rank."""
    if pp == 1 or schedule != "interleaved_1f1b" or v == 1:
        return in_flight(schedule, pp, m, v, rank) * sum(chunks)
    total = m * v
    held, forward = 0.0, 0  # what the local stages hold, kept as the schedule runs (a sum per step is O(v) more)
    for _ in range(min(total, (v - 1) * pp + 2 * (pp - 1 - rank))):
        held += chunks[(forward // pp) % v]
        forward += 1
    peak = 0.0
    for backward in range(total):
        if forward < total:
            held += chunks[(forward // pp) % v]
            forward += 1
        if held > peak:
            peak = held
        held -= chunks[v - 1 - (backward // pp) % v]
    return peak


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
    batches hold documents (packed, left padding), whose micro-batches keep their documents under context parallelism
    (`context_masks`), and which under ``compile`` without it keep SDPA's float copy of the mask per block
    (`document_mask_bytes`); default plain causal batches (pretraining). ``compile``: the strategy's
    ``compile=True``, whose ZeRO-3 units are whole layers (`fsdp_unit_params`)."""
    pb, gb, ob, e = PRECISIONS[precision]
    lay = layout
    lay.check_model(model)
    spec = SCHEDULES[lay.schedule] if lay.pp > 1 else SCHEDULES["1f1b"]
    per_rank = lay.virtual_stages if lay.pp > 1 else 1
    ranks = rank_layers(model, lay.pp, per_rank, spec.style)
    counts = rank_block_counts(model, lay.pp, per_rank, spec.style)
    chunks = rank_chunk_blocks(model, lay.pp, per_rank, spec.style)
    s, b, h, t, ep, cp = model.seq_len, lay.micro_batch, model.hidden, lay.tp, lay.ep, lay.cp
    dense_act, moe_act = block_activations(model, lay, precision)
    # the layer being computed's attention (ring attention: what the ring holds)
    transient = context_transient_bytes(model, b, precision, t, cp, documents, lay.cp_attention == "ring")
    masks = context_masks(lay, documents) * context_documents_bytes(model, b)  # each micro-batch's documents
    # Per block without CP: eagerly (one SDPA call per document) the documents' outputs joined, beside SDPA's own;
    # under compile (the traceable mask) SDPA's float copy of the mask
    own_mask = ((document_mask_bytes(model, b, e) if compile else document_output_bytes(model, b, e, t))
                if documents and cp == 1 else 0.0)
    # a checkpointed block's input: the residual stream, in the parameters' dtype (fp32 under bf16-mixed)
    kept = s * b * h * pb / (t if lay.sequence_parallel else 1) / cp
    unit_p = fsdp_unit_params(model, t, ep, compile)  # the largest FSDP2 unit
    whole_window = lay.pp > 1 or lay.accumulation > 1  # gradients not reduced before the window ends
    # ZeRO-3 reduce-scattering every micro-batch (``grad_reduce``) keeps no unsharded gradients through the window
    zero3_window = lay.pp > 1 or (lay.accumulation > 1 and lay.grad_reduce != "micro_batch")
    bucket = bucket_cap_mb * 2**20
    best = None
    for rank in sorted({0, lay.pp - 1}):
        layers = ranks[rank]
        P = rank_params(model, layers, t, ep)
        experts = rank_expert_params(model, layers, ep)  # sharded over dp cp/ep ranks, the rest over dp cp
        dense_blocks, moe_blocks = counts[rank]
        sharded = lay.zero_stage > 0 and lay.shard > 1
        # ZeRO-3 shards over dp_shard cp ranks under hybrid sharding (replicated across the groups)
        dp, edp = ((lay.zero3_shard if lay.zero_stage == 3 else lay.shard), lay.edp) if sharded else (1, 1)
        slices = (P - experts) / dp + experts / edp  # this device's share of what ZeRO shards
        if lay.zero_stage == 3 and sharded:
            gathered = P if zero3_window else min(P, 2 * unit_p)  # the running unit and the prefetched one
            params = pb * (slices + gathered)
            # the running unit's unsharded gradients until its reduce-scatter (all of the stage's in a window)
            grads = gb * (slices + (P if zero3_window else min(P, unit_p)))
        else:
            params = pb * P
            if lay.zero_stage == 2 and sharded and not whole_window:
                # stage 2 cuts its buckets at most 1/32 of the gradients (`stage2_cap`)
                grads = gb * (slices + min(P, (1 + MAX_IN_FLIGHT) * stage2_cap(int(bucket), int(gb * P)) / gb))
            elif lay.pp > 1 and not sharded and lay.shard == 1:
                grads = 2 * gb * P  # no buckets: a micro-batch's new gradients beside the accumulated ones
            else:
                grads = gb * (P + (slices if lay.zero_stage == 2 and sharded else 0))
        optimizer = ob * (P - experts) / dp + ob * experts / edp
        if model.lora_rank:  # LoRA: the adapters alone have gradients and optimizer state (ZeRO shards them too)
            dense_adapters, expert_adapters = rank_trainable(model, layers, t, ep)
            params += pb * (dense_adapters + expert_adapters)
            grads = gb * (dense_adapters + expert_adapters)
            optimizer = ob * (dense_adapters / dp + expert_adapters / edp)
        per_chunk = tuple((d + x) * kept if lay.activation_checkpointing
                          else d * (dense_act + own_mask) + x * (moe_act + own_mask)
                          for d, x in chunks[rank])
        held = held_micro_batches(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages, rank, per_chunk)
        largest = max(dense_act if dense_blocks or not moe_blocks else 0.0, moe_act if moe_blocks else 0.0)
        head = 0.0
        if model.n_layer + 1 in layers:
            head_f = lay.micro_batches if (lay.pp > 1 and lay.schedule == "gpipe") else 1
            vocab = model.vocab / t if lay.loss_parallel else model.vocab
            head = head_f * s * b * (h * e + HEAD_ELEMENTS * 4 * vocab) / cp
        # The head's loss and a block's backward (a recomputed block's activations, the attention's transient under
        # CP) are not alive at once.
        act = held + masks + max(head, (largest + own_mask if lay.activation_checkpointing else 0.0) + transient)
        # the stage boundary's send and receive tensors: the residual stream, in the parameters' dtype
        buffers = 2 * s * b * h * pb / cp if lay.pp > 1 else 0.0
        est = MemoryEstimate(params, grads, optimizer, act * activation_scale, buffers, rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def resolve_grad_reduce(model: ModelSpec, layout: Layout, precision: str, device_memory: float) -> Layout:
    """``layout`` with ``grad_reduce="auto"`` resolved as the strategy resolves it
    (`lightning_hybrid.grad_sync.resolve_grad_reduce`): ZeRO-3 reduce-scatters every micro-batch where the fullest
    rank's unsharded gradients would take more than `AUTO_WINDOW_FRACTION` of ``device_memory``, else once per
    window; any other layout keeps ``"window"`` (nothing to choose)."""
    if layout.grad_reduce != "auto":
        return layout
    every = False
    if layout.zero_stage == 3 and layout.shard > 1 and layout.accumulation > 1:
        spec = SCHEDULES[layout.schedule] if layout.pp > 1 else SCHEDULES["1f1b"]
        per_rank = layout.virtual_stages if layout.pp > 1 else 1
        gb = PRECISIONS[precision][1]
        fullest = max(sum(rank_trainable(model, layers, layout.tp, layout.ep)) if model.lora_rank  # (LoRA: the
                      else rank_params(model, layers, layout.tp, layout.ep)  # adapters alone have gradients)
                      for layers in rank_layers(model, layout.pp, per_rank, spec.style))
        every = gb * fullest > AUTO_WINDOW_FRACTION * device_memory
    return replace(layout, grad_reduce="micro_batch" if every else "window")
