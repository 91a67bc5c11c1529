"""Predicted peak memory per device of a layout, by kind, as this codebase allocates it.

Notation: ``P`` the parameters on the device (its pipeline stages' layers, matrices split over ``tp``),
``dp`` the data-parallel size, ``b`` micro-batch sequences, ``s`` sequence length, ``h`` width, ``a`` heads.

Model states (ZeRO, Rajbhandari et al. 2020, Table 1, generalised to bytes per element ``(p, g, o)`` of
parameters, gradients and optimizer state, `PRECISIONS`): stage 0 ``(p + g + o) P``; 1 ``(p + g) P + o P/dp``;
2 ``p P + (g + o) P/dp``; 3 ``(p + g + o) P/dp``. With mixed precision and Adam ``(2, 2, 12)`` this is the
paper's 16Psi / 4Psi + 12Psi/Nd / 2Psi + 14Psi/Nd / 16Psi/Nd (`zero_model_states`). What `lightning_hybrid.zero`
does on top (docs/zero.md): stage 2 keeps the bucket backward fills and ``MAX_IN_FLIGHT`` being reduced
(``bucket_cap_mb`` each) beside its ``P/dp`` slices, and its full buffers ``P`` under PP or accumulation
(nothing is reduced before the window's last backward); stage 3 (FSDP2) keeps two blocks gathered (the one
running and the one prefetched), and under PP or accumulation a stage's parameters gathered and its gradients
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
A checkpointed block keeps its input, ``e h`` per token (``/tp`` with sequence parallelism), and recomputes
one block at a time (not while the head's loss is alive: the larger of the two counts). The head keeps
``HEAD_ELEMENTS`` fp32 logit-sized tensors per token (logits, log-softmax, their gradients), ``V/tp`` wide with
``loss_parallel`` (the vocab-parallel cross entropy), else ``V`` (gathered). A schedule keeps several micro-batches
in flight (`in_flight`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lightning_hybrid.pipeline.executor import SCHEDULES
from lightning_hybrid.pipeline.partition import partition_layers, stage_ranks
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB, MAX_IN_FLIGHT

from .layout import Layout
from .model import ModelSpec

__all__ = ["KORTHIKANTI", "PRECISIONS", "ActivationCoefficients", "MemoryEstimate", "block_activation_bytes",
           "codebase_coefficients", "estimate_memory", "in_flight", "rank_layers", "rank_params", "zero_model_states"]

#: bytes per element: (parameters, gradients, optimizer state, activations). Adam keeps 2 moments.
#: ``32-true``: fp32 everything; ``bf16-mixed``: Lightning autocast, fp32 weights and gradients, bf16
#: activations; ``megatron``: fp16/bf16 weights and gradients, fp32 master weights + moments (ZeRO's K = 12).
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "megatron": (2, 2, 12, 2)}
#: fp32 logit-sized tensors per token the LM head keeps at its peak (logits, log-softmax, their gradients).
HEAD_ELEMENTS = 4


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes per token of one block: ``rep * h`` (outside TP regions), ``split * h`` (inside, ``/tp``) and
    ``scores * a * s`` (attention scores, ``/tp``)."""

    rep: float
    split: float
    scores: float


KORTHIKANTI = ActivationCoefficients(rep=10, split=24, scores=5)


def codebase_coefficients(model: ModelSpec, element: int) -> ActivationCoefficients:
    """This codebase's block (see the module docstring) with ``element``-byte activations."""
    gqa = model.kv_heads < model.heads
    attention = 3 + 2 * model.kv_heads / model.heads + (2 if gqa else 0)
    mlp = (4 if model.gated_mlp else 2) * model.ffn / model.hidden
    return ActivationCoefficients(rep=4 * element, split=element * (attention + mlp), scores=0)


def block_activation_bytes(c: ActivationCoefficients, s: int, b: int, h: int, a: int, tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one block keeps for backward for one micro-batch of ``b`` sequences of ``s`` tokens."""
    rep = c.rep / tp if sequence_parallel else c.rep
    return s * b * (h * (rep + c.split / tp) + c.scores * a * s / tp)


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
def rank_layers(model: ModelSpec, pp: int, stages_per_rank: int, style: str) -> tuple[tuple[int, ...], ...]:
    """Pipeline layer indices (``0`` embed, ``L + 1`` head) of each rank, split as the strategy splits them."""
    stages = partition_layers(model.pipeline_layer_params(), pp * stages_per_rank)
    ranks = stage_ranks(len(stages), pp, style)
    return tuple(tuple(i for stage, r in zip(stages, ranks) if r == rank for i in stage) for rank in range(pp))


def rank_params(model: ModelSpec, layers: tuple[int, ...], tp: int) -> float:
    """Parameters a device holds for pipeline ``layers`` under ``tp``: matrices, embeddings, the LM head and
    column-parallel biases split, norms and row-parallel biases whole."""
    head = model.n_layer + 1
    whole = 2 * model.hidden * (2 if model.bias else 1) + (2 * model.hidden if model.bias else 0)  # norms, o/down bias
    block = (model.block_params() - whole) / tp + whole
    total = 0.0
    for i in layers:
        if i == 0:
            total += model.pipeline_layer_params()[0] / tp
        elif i == head:
            total += (model.hidden * (2 if model.bias else 1)
                      + (0 if model.tied_embeddings else model.vocab * model.hidden / tp))
        else:
            total += block
    return total


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
                    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> MemoryEstimate:
    """The predicted peak of the first and the last pipeline rank (the fullest is returned)."""
    pb, gb, ob, e = PRECISIONS[precision]
    lay = layout
    spec = SCHEDULES[lay.schedule] if lay.pp > 1 else SCHEDULES["1f1b"]
    per_rank = lay.virtual_stages if lay.pp > 1 else 1
    ranks = rank_layers(model, lay.pp, per_rank, spec.style)
    coeffs = KORTHIKANTI if precision == "megatron" else codebase_coefficients(model, e)
    s, b, h, t = model.seq_len, lay.micro_batch, model.hidden, lay.tp
    block_act = block_activation_bytes(coeffs, s, b, h, model.heads, t, lay.sequence_parallel)
    kept = s * b * h * e / (t if lay.sequence_parallel else 1)  # a checkpointed block's input
    block_p = rank_params(model, (1,), t) if model.n_layer else 0.0
    whole_window = lay.pp > 1 or lay.accumulation > 1  # gradients not reduced before the window ends
    bucket = bucket_cap_mb * 2**20
    best = None
    for rank in sorted({0, lay.pp - 1}):
        layers = ranks[rank]
        P = rank_params(model, layers, t)
        blocks = sum(1 for i in layers if 0 < i <= model.n_layer)
        sharded = lay.zero_stage > 0 and lay.dp > 1
        dp = lay.dp if sharded else 1
        if lay.zero_stage == 3 and sharded:
            gathered = P if whole_window else min(P, 2 * block_p)
            params = pb * (P / dp + gathered)
            grads = gb * (P / dp + (P if whole_window else 0.0))
        else:
            params = pb * P
            if lay.zero_stage == 2 and sharded and not whole_window:
                grads = gb * (P / dp + min(P, (1 + MAX_IN_FLIGHT) * bucket / gb))
            elif lay.pp > 1 and not sharded and lay.dp == 1:
                grads = 2 * gb * P  # no buckets: a micro-batch's new gradients beside the accumulated ones
            else:
                grads = gb * (P + (P / dp if lay.zero_stage == 2 and sharded else 0))
        optimizer = ob * P / dp
        f = in_flight(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages, rank)
        held = blocks * f * (kept if lay.activation_checkpointing else block_act)
        head = 0.0
        if model.n_layer + 1 in layers:
            head_f = lay.micro_batches if (lay.pp > 1 and lay.schedule == "gpipe") else 1
            vocab = model.vocab / t if lay.loss_parallel else model.vocab
            head = head_f * s * b * (h * e + HEAD_ELEMENTS * 4 * vocab)
        # The head's loss and a recomputed block's activations are not alive at once.
        act = held + max(head, block_act if lay.activation_checkpointing else 0.0)
        buffers = 2 * s * b * h * e if lay.pp > 1 else 0.0  # the stage boundary's send and receive tensors
        est = MemoryEstimate(params, grads, optimizer, act * activation_scale, buffers, rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best
