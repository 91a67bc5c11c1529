"""Activation bytes of one block for one micro-batch on a device: the bytes per element of each precision
(`PRECISIONS`) and the block's coefficients (``rep``, ``split``, ``scores`` per token: `ActivationCoefficients`) by
precision and recompute mode -- Korthikanti's count (`KORTHIKANTI`, `korthikanti_coefficients`), this codebase's
(`codebase_coefficients`, `attention_coefficients`, `pointwise_coefficients`), torchtitan's per-op selective
recompute's (`op_coefficients`) --, a MoE block's experts and router
(`expert_activation_bytes`), and a layout's dense and MoE block (`block_activations`). What each count holds:
`lightning_hybrid.planner.memory`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .layout import Layout
from .model import ModelSpec

__all__ = ["CODEBASE_GATED_TENSORS", "KORTHIKANTI", "MEGATRON_GATED_TENSORS", "MEGATRON_PRECISIONS",
           "NORM_OUTPUT_BYTES", "POINTWISE_GATED_TENSORS", "POINTWISE_PLAIN_TENSORS", "PRECISIONS", "QKV_PROJECTIONS",
           "ActivationCoefficients", "attention_coefficients", "block_activation_bytes", "block_activations",
           "block_coefficients", "codebase_coefficients", "context_unsaved_split", "expert_activation_bytes",
           "korthikanti_coefficients", "mlp_tensors", "moe_coefficients", "op_coefficients", "op_recomputed_weights",
           "pointwise_coefficients",
           "pointwise_recomputed_bytes", "routed_tokens", "selective_coefficients", "uses_layer_norm"]

#: bytes per element: (parameters, gradients, optimizer state, activations). Adam keeps 2 moments.
#: ``32-true``: fp32 everything; ``bf16-mixed``: Lightning autocast, fp32 weights and gradients, bf16
#: activations; ``megatron``: fp16/bf16 weights and gradients, fp32 master weights + moments (ZeRO's K = 12),
#: Korthikanti's block with its unfused attention and dropout (the ``s x s`` scores kept: the 2021/2022 Megatron
#: runs); ``megatron-flash``: the same states, the block as the runs since 2023 train it (flash / SDPA attention:
#: no ``s x s`` tensor, only ``O(s)`` per head -- the softmax's logsumexp, negligible beside ``h``; dropout 0).
#: ``fsdp-bf16``: FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and no autocast
#: (torchtitan's, NeMo AutoModel's): fp32 parameter shards gathered in bf16 (2; the shard's other 2 bytes counted
#: with the optimizer's 8: 10), gradients computed in bf16 and reduced and kept sharded in fp32 (4), bf16 activations
#: and residual stream, this codebase's eager block otherwise (`codebase_coefficients`).
#: ``megatron-core``: Megatron-Core's bf16 training as its own CI measures memory (``--bf16``, the distributed
#: optimizer): bf16 weights, fp32 main gradients (its DDP's gradient buffer: fp32 for bf16 runs), fp32 master
#: weights and moments (12); the block counted as ``megatron-flash``'s.
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "megatron": (2, 2, 12, 2),
              "megatron-flash": (2, 2, 12, 2), "megatron-core": (2, 4, 12, 2), "fsdp-bf16": (2, 4, 10, 2)}
#: Precisions whose block is Korthikanti's count (`korthikanti_coefficients`; ``megatron-flash``, ``megatron-core``:
#: no scores or dropout).
MEGATRON_PRECISIONS = ("megatron", "megatron-flash", "megatron-core")


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
    and no dropout (the runs since 2023 it stands for, Llama 3 and MPT, train with dropout 0), ``megatron-core`` that
    block too (the dropout masks of a run keeping Megatron's default 0.1 left out), else this codebase's
    (`codebase_coefficients`)."""
    if precision == "megatron":
        return korthikanti_coefficients(model)
    if precision in MEGATRON_PRECISIONS:  # megatron-flash, megatron-core
        return korthikanti_coefficients(model, scores=False, dropout=False)
    return codebase_coefficients(model, PRECISIONS[precision][3], PRECISIONS[precision][0])


def selective_coefficients(c: ActivationCoefficients, model: ModelSpec, precision: str) -> ActivationCoefficients:
    """A block's coefficients under selective recompute (``recompute="attention"``: the attention core recomputed in
    backward). Korthikanti's block drops its scores term (the paper's Table 2: ``sbh (10 + 24/t)``); with flash
    attention there are none to drop (the kernel's output is the output projection's kept input). This codebase's
    block (`attention_coefficients`, ``c`` unused): torch's selective checkpoint keeps the output of every op the
    policy does not recompute (`lightning_hybrid.parallel.activation_checkpointing`), needed by backward or not."""
    if precision in MEGATRON_PRECISIONS:
        return dataclasses.replace(c, scores=0.0)
    return attention_coefficients(model, PRECISIONS[precision][3], PRECISIONS[precision][0])


def attention_coefficients(model: ModelSpec, element: float, params: float = 4) -> ActivationCoefficients:
    """This codebase's block under ``recompute="attention"`` (`lightning_hybrid.parallel.activation_checkpointing`:
    SDPA and eager attention's core recomputed; views, copies -- autocast's casts, GQA's ``repeat_interleave`` --,
    in-place and
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


def _op_matmuls(model: ModelSpec, width: int) -> list[tuple[float, float, bool]]:
    """A block's weight matmuls in the order its forward calls them (torchtitan's Llama: ``wq, wk, wv, wo``, then
    ``w1, w3, w2``; a plain MLP ``fc1, fc2``), each ``(weights, output width over h, column-parallel)``, with an MLP
    (or shared experts) of ``width`` (none for 0)."""
    h, d = model.hidden, model.head_dim
    q, kv = model.heads * d, model.kv_heads * d
    mms = [(h * q, q / h, True), (h * kv, kv / h, True), (h * kv, kv / h, True), (q * h, 1.0, False)]
    if width:
        up = [(h * width, width / h, True)] * (2 if model.gated_mlp else 1)
        mms += up + [(width * h, 1.0, False)]
    return mms


def op_coefficients(model: ModelSpec, precision: str) -> ActivationCoefficients:
    """A block's coefficients under torchtitan's per-op selective recompute (``recompute="op"``, its
    ``selective_ac_option = "op"``: a policy per checkpointed block that keeps the outputs of every other ``mm`` --
    the 1st, 3rd, ... in call order, `_op_matmuls` -- and of the attention kernel, and recomputes everything else):
    ``rep`` the block's input (the residual stream's dtype) and the kept row-parallel outputs (``e`` each: a gated
    MLP's ``w2``), ``split`` the kept column outputs (``wq``'s ``e q``, ``wv``'s ``e kv``, ``w1``'s ``e F/h``: ``mlp``),
    the attention's output ``e q`` and its logsumexp ``4 a/h``. (Under TP a kept row output is its partial sum before
    the reduction, whole on each rank; it is counted as the reduced one.)"""
    e = PRECISIONS[precision][3]
    residual = e if precision in MEGATRON_PRECISIONS else PRECISIONS[precision][0]
    mms = _op_matmuls(model, model.ffn)
    kept = mms[0::2]
    mlp = e * sum(w for _, w, column in kept[2:] if column)
    split = e * sum(w for _, w, column in kept if column) + e * model.heads * model.head_dim / model.hidden
    return ActivationCoefficients(rep=residual + e * sum(w for _, w, column in kept if not column),
                                  split=split + 4 * model.heads / model.hidden, scores=0.0, mlp=mlp)


def op_recomputed_weights(model: ModelSpec, moe: bool = False) -> tuple[float, float]:
    """Weights whose GEMMs per-op selective recompute (`op_coefficients`) runs again in backward, per token: the
    even-numbered matmuls of a dense block (``wk, wo, w3``), or of a MoE block's attention and shared experts; and
    per (token, expert) pair a MoE block's experts whole (their grouped GEMMs are not ``mm``: never kept)."""
    if not moe:
        return float(sum(w for w, _, _ in _op_matmuls(model, model.ffn)[1::2])), 0.0
    return (float(sum(w for w, _, _ in _op_matmuls(model, model.shared_ffn)[1::2])),
            float(model.mlp_weights(model.expert_ffn)))


#: ffn-wide tensors a gated MLP keeps: Megatron's fused SwiGLU 3 (the first matmul's ``2F`` output, the second's ``F``
#: input), this codebase's 4 (``silu(w1 x) * w3 x`` in eager PyTorch: ``w1 x``, its SiLU, ``w3 x``, the product);
#: a GELU MLP keeps 2 either way (GELU's input and output). Under pointwise recompute the matmuls' outputs alone:
#: gated 2 (``w1 x``, ``w3 x``), plain 1 (the up projection's).
MEGATRON_GATED_TENSORS, CODEBASE_GATED_TENSORS = 3, 4
POINTWISE_GATED_TENSORS, POINTWISE_PLAIN_TENSORS = 2, 1


def mlp_tensors(model: ModelSpec, precision: str, recompute: str = "none") -> int:
    """ffn-wide tensors an MLP (or expert) keeps per token at ``precision`` (`MEGATRON_GATED_TENSORS`); under
    ``recompute="pointwise"`` its matmuls' outputs (`POINTWISE_GATED_TENSORS`), under ``"op"`` the first."""
    if recompute == "pointwise":
        return POINTWISE_GATED_TENSORS if model.gated_mlp else POINTWISE_PLAIN_TENSORS
    if recompute == "op":  # the first of the MLP's matmul outputs (`op_coefficients`)
        return 1
    if not model.gated_mlp:
        return 2
    return MEGATRON_GATED_TENSORS if precision in MEGATRON_PRECISIONS else CODEBASE_GATED_TENSORS


def _mlp_split(model: ModelSpec, element: float, width: int, tensors: int, plain: int = 2) -> float:
    """An MLP's hidden tensors per token, in units of ``h`` bytes: ``tensors`` of ``width`` elements (``plain`` not
    gated)."""
    return element * (tensors if model.gated_mlp else plain) * width / model.hidden


def context_unsaved_split(model: ModelSpec, element: float) -> float:
    """The part of `codebase_coefficients`' ``split`` that a context-parallel block does not keep without activation
    checkpointing (its attention checkpointed, `lightning_hybrid.parallel.context_parallel`): SDPA's logsumexp (``4
    a/h``, fp32 per head). SDPA's output is replaced by the ``cat`` of the two chunks' outputs, which nothing keeps, and
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


def block_activations(model: ModelSpec, layout: Layout, precision: str) -> tuple[float, float]:
    """Bytes one dense block and one MoE block keep for backward for one micro-batch on a device (the MoE block's
    experts included; 0 when the model has none); under context parallelism the rank's ``1/cp`` of them, without
    what the attention's transient counts (`context_transient_bytes`): `KORTHIKANTI`'s scores, and without
    activation checkpointing less `context_unsaved_split` (the checkpointed attention's logsumexp; a rotary model's
    fp32 Q and K kept as its inputs; not for ring attention, which is not checkpointed: ``1/cp`` of what the block
    keeps at ``cp = 1``). With activation checkpointing this is the block being recomputed (its count without
    recompute)."""
    return _block_activations(model, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp,
                              layout.recompute_mode, layout.activation_checkpointing, precision,
                              layout.cp_attention == "ring")


@functools.lru_cache(maxsize=4096)
def _block_activations(model: ModelSpec, b: int, t: int, sp: bool, cp: int, mode: str, checkpointing: bool,
                       precision: str, ring: bool = False) -> tuple[float, float]:
    """`block_activations` of the layout fields it reads (cached: the search asks for the same ones often)."""
    e = PRECISIONS[precision][3]
    coeffs = block_coefficients(model, precision)
    s, h = model.seq_len, model.hidden
    if mode == "pointwise":  # the attention core and the element-wise ops recomputed: matmul and norm outputs kept
        coeffs = pointwise_coefficients(model, precision)
    elif mode == "op":  # torchtitan's per-op policy: every other matmul's output and the attention's kept
        coeffs = op_coefficients(model, precision)
    elif mode == "attention":  # selective recompute: the attention core's activations not kept
        coeffs = selective_coefficients(coeffs, model, precision)
    elif cp > 1:
        if precision in MEGATRON_PRECISIONS:  # Korthikanti: the scores of the layer being computed are the transient's
            coeffs = dataclasses.replace(coeffs, scores=0.0)
        elif not checkpointing and not ring:  # the attention is checkpointed: SDPA's output not kept (the ring
            # is not: it keeps what SDPA keeps at cp=1)
            coeffs = dataclasses.replace(coeffs, split=coeffs.split - context_unsaved_split(model, e))
    dense = block_activation_bytes(coeffs, s, b, h, model.heads, t, sp, cp)
    if not model.experts:
        return dense, 0.0
    n = mlp_tensors(model, precision, mode)
    moe = block_activation_bytes(moe_coefficients(coeffs, model, e, n), s, b, h, model.heads, t, sp, cp)
    return dense, moe + expert_activation_bytes(model, s * b // cp, e, t, sp, tensors=n)
