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
``O(s)`` per head) and dropout 0 (no masks: PyTorch's dropout returns its input at ``p = 0``). This codebase's
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
for the others (Llama, Mistral, Qwen, Gemma; `uses_layer_norm`). Measured (tests/test_planner.py: the bytes one
block of the reference GPT and of a Hugging Face Llama keeps for backward, fp32 and bf16 autocast): within 1%. Not for
the ``megatron`` precisions (`MEGATRON_PRECISIONS`: Korthikanti's count stands for Megatron-LM runs, which have no
such recompute mode): ``ValueError``.
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

Batches with documents (packed, left padding; ``documents=True``) without context parallelism: each layer's SDPA
converts the model's boolean ``(b, 1, s, s)`` document mask to the queries' dtype and its kernel keeps that copy
for backward, ``b s^2 e`` bytes per held block (one for all heads, whole on every TP rank; `document_mask_bytes`),
the recomputed block's only under activation checkpointing.

Context parallelism (`Layout.cp` = ``c``; `lightning_hybrid.context_parallel`): each rank holds ``s/c`` tokens of
every sequence (the zigzag split: chunks ``r`` and ``2c-1-r`` of ``2c``). Everything outside attention is local
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
* batches with documents (packed, left padding; ``documents=True``): each call's mask is made in the call, the
  boolean block ``(b, 1, s/(2c), end)`` and SDPA's float copy of it (``e`` bytes per element, one for all heads,
  whole on every TP rank): at most ``b (s/2c) s (1 + e)`` bytes (`context_mask_bytes`), transient; what a
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
  prefixes' gradients then summed into one buffer of ``G`` for the reduction; with documents plus the largest
  call's mask and its float copy (`context_mask_bytes`). `KORTHIKANTI`'s block adds instead of
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

__all__ = ["CODEBASE_GATED_TENSORS", "DOCUMENT_KV_COPIES", "KORTHIKANTI", "MEGATRON_GATED_TENSORS",
           "MEGATRON_PRECISIONS", "NORM_OUTPUT_BYTES", "PLAIN_KV_COPIES", "POINTWISE_GATED_TENSORS",
           "POINTWISE_PLAIN_TENSORS", "PRECISIONS", "QKV_PROJECTIONS", "ActivationCoefficients", "MemoryEstimate",
           "attention_coefficients", "block_activation_bytes", "block_activations", "block_coefficients",
           "codebase_coefficients",
           "context_documents_bytes", "context_mask_bytes", "context_masks", "context_transient_bytes",
           "context_unsaved_split", "document_mask_bytes", "estimate_memory", "expert_activation_bytes",
           "fsdp_unit_params", "gathered_kv_bytes", "held_micro_batches", "in_flight", "korthikanti_coefficients",
           "largest_block_params", "mlp_tensors", "moe_block_count", "moe_coefficients", "pipeline_stages",
           "rank_block_counts", "rank_chunk_blocks", "rank_expert_params", "rank_layers", "rank_params",
           "pointwise_coefficients", "pointwise_recomputed_bytes", "routed_tokens", "selective_coefficients",
           "uses_layer_norm", "zero_model_states"]

#: bytes per element: (parameters, gradients, optimizer state, activations). Adam keeps 2 moments.
#: ``32-true``: fp32 everything; ``bf16-mixed``: Lightning autocast, fp32 weights and gradients, bf16
#: activations; ``megatron``: fp16/bf16 weights and gradients, fp32 master weights + moments (ZeRO's K = 12),
#: Korthikanti's block with its unfused attention and dropout (the ``s x s`` scores kept: the 2021/2022 Megatron
#: runs); ``megatron-flash``: the same states, the block as the runs since 2023 train it (flash / SDPA attention:
#: no ``s x s`` tensor, only ``O(s)`` per head -- the softmax's logsumexp, negligible beside ``h``; dropout 0).
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "megatron": (2, 2, 12, 2),
              "megatron-flash": (2, 2, 12, 2)}
#: Precisions whose block is Korthikanti's count (`korthikanti_coefficients`; ``megatron-flash``: no scores or dropout).
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


#: The paper's block (section 4.1, fp16, GPT: dropout, GELU MLP of ``4h``, one K/V head per query head): ``rep`` the
#: two LayerNorms' inputs (4), the inputs of the QKV and first MLP matmuls (2 + 2), the attention's and the MLP's
#: dropout masks (1 + 1); ``split`` Q, K, V (6), the output projection's input (2), GELU's input and output (2 x 8
#: of ``4h``: ``mlp`` 16); ``scores`` the softmax's output (2), its dropout mask (1) and output (2) per score.
KORTHIKANTI = ActivationCoefficients(rep=10, split=24, scores=5, mlp=16)


def _head_widths(model: ModelSpec) -> tuple[float, float]:
    """``(q, kv)``: the query heads' and the key/value heads' widths over ``h``, ``a d/h`` and ``a_kv d/h``."""
    return model.heads * model.head_dim / model.hidden, model.kv_heads * model.head_dim / model.hidden


def korthikanti_coefficients(model: ModelSpec, scores: bool = True, dropout: bool = True) -> ActivationCoefficients:
    """`KORTHIKANTI`'s per-tensor count (2-byte activations) for ``model``'s shapes: Q ``2 q`` and K, V ``2 kv`` each
    (``q``, ``kv``: their widths over ``h``, ``a d/h`` and ``a_kv d/h`` -- grouped-query attention keeps K and V at
    ``a_kv`` heads, flash attention takes them so); the MLP's input, ``2 F/h`` per ffn-wide tensor it keeps: 2 for
    GELU (its input and output), 3 for SwiGLU (Megatron's fused ``bias_swiglu`` keeps the first matmul's ``2F`` output
    and the second's ``F`` input); ``dropout``: the two dropout masks (1 byte each; no mask at ``p = 0``: PyTorch's
    dropout returns its input); ``scores``: the unfused attention's ``5 a s/h`` (``2`` without dropout: the softmax's
    output alone). The GPT of the paper (dropout, ``F = 4h``, ``a_kv = a``) gives `KORTHIKANTI`; Megatron-LM's
    ``report_theoretical_memory`` (megatron/training/theoretical_memory_usage.py) uses ``sbh (18 + 4F/h)``, the same
    count for GELU at any ``F`` (its TODO: not for ``a d != h``; nor gating nor GQA)."""
    width, kv = _head_widths(model)
    mlp = _mlp_split(model, 2, model.ffn, MEGATRON_GATED_TENSORS)
    return ActivationCoefficients(rep=8 + (2 if dropout else 0), split=2 * width + 4 * kv + 2 * width + mlp,
                                  scores=(5 if dropout else 2) if scores else 0.0, mlp=mlp)


def block_coefficients(model: ModelSpec, precision: str) -> ActivationCoefficients:
    """The block's coefficients at ``precision``: ``megatron`` Korthikanti's (`korthikanti_coefficients`: unfused
    attention, dropout masks -- the 2021/2022 Megatron runs), ``megatron-flash`` the same count with flash attention
    and no dropout (the runs since 2023 it stands for, Llama 3 and MPT, train with dropout 0), else this codebase's
    (`codebase_coefficients`)."""
    if precision == "megatron":
        return korthikanti_coefficients(model)
    if precision == "megatron-flash":
        return korthikanti_coefficients(model, scores=False, dropout=False)
    return codebase_coefficients(model, PRECISIONS[precision][3], PRECISIONS[precision][0])


def selective_coefficients(c: ActivationCoefficients, model: ModelSpec, precision: str) -> ActivationCoefficients:
    """A block's coefficients under selective recompute (``recompute="attention"``: the attention core recomputed in
    backward). Korthikanti's block drops its scores term (the paper's Table 2: ``sbh (10 + 24/t)``); with flash
    attention there are none to drop (the kernel's output is the output projection's kept input). This codebase's
    block (`attention_coefficients`, ``c`` unused): torch's selective checkpoint keeps the output of every op the
    policy does not recompute (`lightning_hybrid.activation_checkpointing`), needed by backward or not."""
    if precision in MEGATRON_PRECISIONS:
        return dataclasses.replace(c, scores=0.0)
    return attention_coefficients(model, PRECISIONS[precision][3], PRECISIONS[precision][0])


def attention_coefficients(model: ModelSpec, element: float, params: float = 4) -> ActivationCoefficients:
    """This codebase's block under ``recompute="attention"`` (`lightning_hybrid.activation_checkpointing`: SDPA and
    eager attention's core recomputed; views, copies -- autocast's casts, GQA's ``repeat_interleave`` --, in-place and
    random ops too; every other op's output kept, needed by backward or not), ``element`` ``e`` (matmul outputs),
    ``params`` ``p`` (the residual stream's dtype: fp32 under ``bf16-mixed``). ``rep``: the block's input and the
    residual sum between its halves (``2 p``), the output and down projections' outputs (``2 e``), per norm (two)
    LayerNorm's fp32 output and mean and reciprocal standard deviation (``4 + 8/h``: autocast runs it in fp32) or
    eager RMSNorm's every op (``pow``, ``x * rsqrt``, ``weight *``: ``3 x 4``; ``mean``, ``+ eps``, ``rsqrt``:
    ``3 x 4/h``; fp32). ``split``: the q, k, v projections' outputs ``e (q + 2 kv)``; with rotary embeddings
    (`uses_layer_norm` False: transformers' ``apply_rotary_pos_emb``) per Q and K head the products with the fp32
    cos and sin tables and their sum (``3 x 4``), ``rotate_half``'s ``neg`` of one half and ``cat`` (``1.5 e``): ``(12
    + 1.5 e)(q + kv)``; the MLP's hidden tensors, as without recompute (``e n F/h``, ``n`` 2 GELU -- ``fc1 x``, its
    GELU --, 4 SwiGLU: ``mlp``). SDPA's output and its logsumexp are not kept (recomputed). On a Llama layer this is
    more than no recompute keeps (`codebase_coefficients`): eager RMSNorm's and rotary's intermediates outweigh the
    attention's output; on the reference GPT about as much."""
    e, p, h = element, params, model.hidden
    q, kv = _head_widths(model)
    layer_norm = uses_layer_norm(model)
    norm = NORM_OUTPUT_BYTES + 8 / h if layer_norm else 3 * 4 + 3 * 4 / h
    rope = 0.0 if model.learned_positions else (3 * 4 + 1.5 * e) * (q + kv)
    mlp = _mlp_split(model, e, model.ffn, CODEBASE_GATED_TENSORS)
    return ActivationCoefficients(rep=2 * p + 2 * norm + 2 * e, split=e * (q + 2 * kv) + rope + mlp, scores=0.0,
                                  mlp=mlp)


#: bytes of a norm's output in this codebase's precisions: LayerNorm's (``native_layer_norm``, which autocast runs in
#: fp32) and eager RMSNorm's (an fp32 weight times its fp32 normalised input).
NORM_OUTPUT_BYTES = 4


def uses_layer_norm(model: ModelSpec) -> bool:
    """Whether the model's norms are LayerNorm (one ``native_layer_norm`` op, kept under pointwise recompute) rather
    than RMSNorm (element-wise ops but for a mean): taken for models with learned positions or biases (the reference
    GPT, GPT-2, GPT-NeoX, Phi); Llama-style models (rotary, no biases: Llama, Mistral, Qwen, Gemma) use RMSNorm."""
    return model.learned_positions or model.bias


def pointwise_coefficients(model: ModelSpec, precision: str) -> ActivationCoefficients:
    """A block's coefficients under pointwise selective recompute (``recompute="pointwise"``: the attention core and
    every element-wise op recomputed; views, copies, in-place and random ops always are): what is kept is the outputs
    of the matmuls, of norms that are one op, of reductions and TP collectives, and the checkpoint's input. ``rep``:
    the block's input (``p`` bytes, the residual stream's dtype: fp32 under ``bf16-mixed``), the output and down
    projections' outputs (``2 e``; a TP row layer's reduced output, `row_parallel_linear`), and per norm (two)
    LayerNorm's fp32 output and its mean and reciprocal standard deviation, ``4 + 8/h``, or eager RMSNorm's mean of
    squares, ``4/h`` (`uses_layer_norm`). ``split``: the q, k, v projections' outputs ``e (q + 2 kv)``, with rotary
    embeddings the ``cat`` of ``rotate_half`` of Q and K ``e (q + kv)`` (not element-wise), and the MLP's first
    matmul outputs ``e n F/h`` (``n`` 1, 2 gated: ``mlp``). ``megatron`` precisions: ``ValueError`` (Korthikanti's
    count stands for Megatron-LM, which has no such recompute mode)."""
    if precision in MEGATRON_PRECISIONS:
        raise ValueError(f"recompute='pointwise' is not modelled for precision={precision!r}: the megatron precisions"
                         " count Korthikanti's block, which stands for Megatron-LM runs, and Megatron-LM has no"
                         " pointwise recompute. Use 'none', 'full' or 'attention', or a codebase precision"
                         " ('32-true', 'bf16-mixed').")
    p, e = PRECISIONS[precision][0], PRECISIONS[precision][3]
    h = model.hidden
    width, kv = _head_widths(model)
    norms = 2 * (NORM_OUTPUT_BYTES + 8 / h) if uses_layer_norm(model) else 2 * 4 / h
    rope = 0.0 if model.learned_positions else e * (width + kv)
    mlp = _mlp_split(model, e, model.ffn, POINTWISE_GATED_TENSORS, plain=POINTWISE_PLAIN_TENSORS)
    return ActivationCoefficients(rep=p + 2 * e + norms, split=e * (width + 2 * kv) + rope + mlp, scores=0.0, mlp=mlp)


def pointwise_recomputed_bytes(model: ModelSpec, layout: Layout, precision: str) -> tuple[float, float]:
    """Bytes of the element-wise outputs one dense block and one MoE block (0 without experts) compute again under
    pointwise recompute for one micro-batch on a device (the time model's element-wise traffic, `estimate_time`):
    the MLP's activation, ``e F`` (SiLU and the product gated: ``2 e F``; each expert's per (token, expert) pair),
    the two residual sums (``2 p h``), eager RMSNorm's normalised fp32 output (``2 x 4 h``; LayerNorm's is kept) and
    rotary embeddings' rotated Q and K (``4 (q + kv) h``, fp32: the tables are). Not a memory term."""
    p, e = PRECISIONS[precision][0], PRECISIONS[precision][3]
    h = model.hidden
    width, kv = _head_widths(model)
    act = 2 if model.gated_mlp else 1
    rep = 2 * p + (0.0 if uses_layer_norm(model) else 2 * 4)
    rope = 0.0 if model.learned_positions else 4 * (width + kv)
    mlp = e * act * model.ffn / h
    s, b, t, sp, cp = model.seq_len, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp
    c = ActivationCoefficients(rep=rep, split=rope + mlp, scores=0.0, mlp=mlp)
    dense = block_activation_bytes(c, s, b, h, model.heads, t, sp, cp)
    if not model.experts:
        return dense, 0.0
    shared = e * act * model.shared_ffn / h
    moe = block_activation_bytes(dataclasses.replace(c, split=rope + shared, mlp=shared), s, b, h, model.heads, t,
                                 sp, cp)
    routed = routed_tokens(s * b // cp, t, sp)
    return dense, moe + routed * model.top_k * e * act * model.expert_ffn


#: ffn-wide tensors a gated MLP keeps: Megatron's fused SwiGLU 3 (the first matmul's ``2F`` output, the second's ``F``
#: input), this codebase's 4 (``silu(w1 x) * w3 x`` in eager PyTorch: ``w1 x``, its SiLU, ``w3 x``, the product);
#: a GELU MLP keeps 2 either way (GELU's input and output). Under pointwise recompute the matmuls' outputs alone:
#: gated 2 (``w1 x``, ``w3 x``), plain 1 (the up projection's).
MEGATRON_GATED_TENSORS, CODEBASE_GATED_TENSORS = 3, 4
POINTWISE_GATED_TENSORS, POINTWISE_PLAIN_TENSORS = 2, 1


def mlp_tensors(model: ModelSpec, precision: str, recompute: str = "none") -> int:
    """ffn-wide tensors an MLP (or expert) keeps per token at ``precision`` (`MEGATRON_GATED_TENSORS`); under
    ``recompute="pointwise"`` its matmuls' outputs (`POINTWISE_GATED_TENSORS`)."""
    if recompute == "pointwise":
        return POINTWISE_GATED_TENSORS if model.gated_mlp else POINTWISE_PLAIN_TENSORS
    if not model.gated_mlp:
        return 2
    return MEGATRON_GATED_TENSORS if precision in MEGATRON_PRECISIONS else CODEBASE_GATED_TENSORS


def _mlp_split(model: ModelSpec, element: float, width: int, tensors: int, plain: int = 2) -> float:
    """An MLP's hidden tensors per token, in units of ``h`` bytes: ``tensors`` of ``width`` elements (``plain`` not
    gated)."""
    return element * (tensors if model.gated_mlp else plain) * width / model.hidden


def context_unsaved_split(model: ModelSpec, element: float) -> float:
    """The part of `codebase_coefficients`' ``split`` that a context-parallel block does not keep without activation
    checkpointing (its attention checkpointed, `lightning_hybrid.context_parallel`): SDPA's logsumexp (``4 a/h``,
    fp32 per head). SDPA's output is replaced by the ``cat`` of the two chunks' outputs, which nothing keeps, and
    its copy in the tokens' order, which the output projection keeps (as it keeps SDPA's output at ``cp = 1``: one
    ``e q``); and a rotary model's Q and K are kept as the checkpoint's inputs -- the fp32 sums of the rotation
    (``4``) -- rather than as SDPA's casts (``e``): ``- (4 - e)(q + kv)`` (negative: more kept under
    ``bf16-mixed``). Measured on one rank (a gloo group of one): the reference GPT's block, and a transformers
    Llama layer with packed documents, fp32 and bf16 autocast -- exact."""
    h = model.hidden
    q, kv = _head_widths(model)
    rope = 0.0 if model.learned_positions else (4 - element) * (q + kv)
    return 4 * model.heads / h - rope


#: linears reading each norm's output: the attention's separate q, k and v projections (the reference GPT,
#: transformers' decoders); the MLP's first matmuls read the other norm's (2 gated, 1 plain).
QKV_PROJECTIONS = 3


def _matmul_inputs(element: float, linears: int) -> float:
    """A norm's output as the matmuls reading it keep it, per token in units of ``h`` bytes: the fp32 output itself,
    once (``32-true``), or under autocast each linear's own cast of it (``linears e``: autocast casts an fp32 input
    for every matmul; only the weights' casts are cached)."""
    return float(NORM_OUTPUT_BYTES) if element >= NORM_OUTPUT_BYTES else linears * element


def codebase_coefficients(model: ModelSpec, element: float, params: float = 4) -> ActivationCoefficients:
    """This codebase's block without recompute (autograd's saved tensors; see the module docstring) with
    ``element``-byte matmul outputs ``e`` and a ``params``-byte residual stream ``p`` (fp32 under ``bf16-mixed``).
    ``rep``: the block's input and the residual sum between its halves (``2 p``: the norms' inputs), per norm (two)
    LayerNorm's mean and reciprocal standard deviation (``8/h``) or eager RMSNorm's normalised fp32 input and
    ``rsqrt`` (``4 + 4/h``), and the norms' outputs as the matmuls keep them (`_matmul_inputs`: fp32 once, or
    under ``bf16-mixed`` a bf16 cast per linear -- 3 for q, k, v, 2 for a gated MLP's, 1 a plain one's). ``split``:
    SDPA's inputs and output, ``e (2 q + 2 kv')`` (the output is the output projection's input: SDPA's kernels lay
    it out in the tokens' order, so its reshape is a view), ``kv' = q`` under grouped-query attention in the
    reference GPT (``repeat_interleave`` before SDPA; `ModelSpec.learned_positions`), ``kv`` for transformers'
    decoders (SDPA's ``enable_gqa``); its logsumexp ``4 a/h`` (fp32 per head); the MLP's hidden tensors ``e n F/h``
    (``n`` 2 GELU, 4 eager SwiGLU: ``w1 x``, its SiLU, ``w3 x``, the product; ``mlp``). Rotary embeddings keep
    nothing more (their products' other operands are the tables)."""
    e, p, h = element, params, model.hidden
    q, kv = _head_widths(model)
    sdpa_kv = q if model.learned_positions else kv
    norm = 8 / h if uses_layer_norm(model) else NORM_OUTPUT_BYTES + 4 / h
    inputs = _matmul_inputs(e, QKV_PROJECTIONS) + _matmul_inputs(e, 2 if model.gated_mlp else 1)
    mlp = _mlp_split(model, e, model.ffn, CODEBASE_GATED_TENSORS)
    return ActivationCoefficients(rep=2 * p + 2 * norm + inputs,
                                  split=e * (2 * q + 2 * sdpa_kv) + 4 * model.heads / h + mlp, scores=0, mlp=mlp)


def moe_coefficients(c: ActivationCoefficients, model: ModelSpec, element: float,
                     tensors: int) -> ActivationCoefficients:
    """A MoE block's activations outside its experts: ``c`` with the dense MLP's part of ``split`` replaced by the
    shared experts' (split over TP like it; ``tensors``: the model's, `mlp_tensors`); the experts' own are
    `expert_activation_bytes`."""
    shared = element * tensors * model.shared_ffn / model.hidden
    return ActivationCoefficients(rep=c.rep, split=max(0.0, c.split - c.mlp) + shared, scores=c.scores, mlp=shared)


def routed_tokens(tokens: float, tp: int, sequence_parallel: bool) -> float:
    """Tokens one rank routes to experts out of its replica's ``tokens``: all of them under TP (the experts are
    replicated over TP), ``1/tp`` with sequence parallelism."""
    return tokens / tp if sequence_parallel else tokens


def expert_activation_bytes(model: ModelSpec, tokens: float, element: float, tp: int = 1,
                            sequence_parallel: bool = False, *, tensors: int) -> float:
    """Bytes one MoE block's experts and router keep for backward on one rank for a micro-batch of ``tokens``
    (its replica's): per pair computed (``k`` per routed token under uniform routing) the expert's input and
    output rows and hidden tensors, ``e (2h + n F_e)`` (``n = tensors``, the model's: `mlp_tensors`, gated or not,
    under the recompute mode); per routed token the router's logits (``e``) and probabilities (fp32),
    ``(e + 4) E``."""
    if not model.experts:
        return 0.0
    routed = routed_tokens(tokens, tp, sequence_parallel)
    per_pair = element * (2 * model.hidden + tensors * model.expert_ffn)
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
    gathers grouped-query attention's key/value heads once and repeats them per query head after the gather,
    `lightning_hybrid.context_parallel`; the exchange carries ``a_kv/a`` of it, `time.kv_exchange_bytes`); 0
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
#: The same with documents (the masks are counted apart: `context_mask_bytes`).
DOCUMENT_KV_COPIES = 2.0


def context_transient_bytes(model: ModelSpec, b: int, precision: str, tp: int = 1, cp: int = 1,
                            documents: bool = False) -> float:
    """The transient of the attention of the layer being computed under context parallelism (its forward, or its
    backward after the attention's or the layer's recomputation): twice the gathered K and V (`gathered_kv_bytes`;
    `PLAIN_KV_COPIES`: the pieces and their copy in the sequence's order in forward, that copy and the longest
    prefix's gradients in backward); with ``documents`` also the largest call's boolean mask and SDPA's float copy
    of it (`context_mask_bytes`, ``1 + e`` bytes per element). `KORTHIKANTI`'s block
    (``megatron``) adds instead of the float mask its own scores of the one layer (``5 b (a/tp) (s/cp) s`` bytes).
    0 without context parallelism."""
    if cp == 1:
        return 0.0
    e = PRECISIONS[precision][3]
    kv = (DOCUMENT_KV_COPIES if documents else PLAIN_KV_COPIES) * gathered_kv_bytes(model, b, e, tp, cp)
    if precision == "megatron":  # (megatron-flash: no scores)
        return kv + block_activation_bytes(ActivationCoefficients(0.0, 0.0, KORTHIKANTI.scores), model.seq_len, b,
                                           model.hidden, model.heads, tp, cp=cp)
    return kv + (context_mask_bytes(model, b, 1 + e, cp) if documents else 0.0)


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
    held, forward, peak = [0] * v, 0, 0.0
    for _ in range(min(total, (v - 1) * pp + 2 * (pp - 1 - rank))):
        held[(forward // pp) % v] += 1
        forward += 1
    for backward in range(total):
        if forward < total:
            held[(forward // pp) % v] += 1
            forward += 1
        peak = max(peak, sum(n * c for n, c in zip(held, chunks)))
        held[v - 1 - (backward // pp) % v] -= 1
    return peak


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
def rank_chunk_blocks(model: ModelSpec, pp: int, stages_per_rank: int,
                      style: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``(dense blocks, MoE blocks)`` of each local stage of each pipeline rank, in the order the rank runs them."""
    stages, ranks = pipeline_stages(model, pp, stages_per_rank, style)
    out = []
    for rank in range(pp):
        chunks = []
        for stage, r in zip(stages, ranks):
            if r == rank:
                moe = moe_block_count(model, stage)
                chunks.append((sum(1 for i in stage if 0 < i <= model.n_layer) - moe, moe))
        out.append(tuple(chunks))
    return tuple(out)


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
    activation checkpointing less `context_unsaved_split` (the checkpointed attention's logsumexp; a rotary model's
    fp32 Q and K kept as its inputs). With activation checkpointing this is the block being recomputed (its count
    without recompute)."""
    e = PRECISIONS[precision][3]
    coeffs = block_coefficients(model, precision)
    s, b, h, t, sp = model.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.sequence_parallel
    cp = layout.cp
    mode = layout.recompute_mode
    if mode == "pointwise":  # the attention core and the element-wise ops recomputed: matmul and norm outputs kept
        coeffs = pointwise_coefficients(model, precision)
    elif mode == "attention":  # selective recompute: the attention core's activations not kept
        coeffs = selective_coefficients(coeffs, model, precision)
    elif cp > 1:
        if precision in MEGATRON_PRECISIONS:  # Korthikanti: the scores of the layer being computed are the transient's
            coeffs = dataclasses.replace(coeffs, scores=0.0)
        elif not layout.activation_checkpointing:  # the attention is checkpointed: SDPA's output not kept
            coeffs = dataclasses.replace(coeffs, split=coeffs.split - context_unsaved_split(model, e))
    dense = block_activation_bytes(coeffs, s, b, h, model.heads, t, sp, cp)
    if not model.experts:
        return dense, 0.0
    n = mlp_tensors(model, precision, mode)
    moe = block_activation_bytes(moe_coefficients(coeffs, model, e, n), s, b, h, model.heads, t, sp, cp)
    return dense, moe + expert_activation_bytes(model, s * b // cp, e, t, sp, tensors=n)


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
    (`context_masks`, `context_transient_bytes`), and without it keeps SDPA's float copy of the model's mask per
    block (`document_mask_bytes`); default plain causal batches (pretraining). ``compile``: the strategy's
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
    transient = context_transient_bytes(model, b, precision, t, cp, documents)  # the layer being computed's attention
    masks = context_masks(lay, documents) * context_documents_bytes(model, b)  # each micro-batch's documents
    own_mask = document_mask_bytes(model, b, e) if documents and cp == 1 else 0.0  # per block: SDPA's float mask
    # a checkpointed block's input: the residual stream, in the parameters' dtype (fp32 under bf16-mixed)
    kept = s * b * h * pb / (t if lay.sequence_parallel else 1) / cp
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
