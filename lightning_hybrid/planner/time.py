"""Predicted time of one optimizer step of a layout, by part.

Collectives (ring algorithms, Patarasuk & Yuan 2009; NCCL's bus bandwidth): over ``n`` ranks a ring
all-reduce of ``B`` bytes sends ``2 (n-1)/n B`` per rank in ``2 (n-1)`` steps; reduce-scatter and all-gather
``(n-1)/n B`` in ``n-1`` steps (`ring_time`). The link is the slowest hop of the group (`Cluster.link`); a DP/FSDP
ring over whole nodes sees the node's NICs together (`Cluster.ring_link`: ``k x`` one NIC's bandwidth with ``k`` of
the group's ranks per node, at most NVLink's; one NIC when the group has one rank per node).

Per micro-batch of ``b`` sequences (``T = b s`` tokens) and per block on one device:

* compute: forward ``2 W / tp`` FLOPs per token for the block's ``W`` matrix weights plus ``4 h s / tp`` for
  attention (the `ModelSpec.flops_per_token` count; ``s`` x `ModelSpec.attention_span` under sliding windows where
  the kernel skips what they mask, `Cluster.window_kernels`), backward twice that, a checkpointed block's forward
  again (so x4/3), under selective recompute (``recompute="attention"``, and ``"pointwise"``) the attention core's
  ``4 h s / tp`` once more; at the cluster's achievable matmul FLOP/s, the weight GEMMs slower by their shapes
  (`matmul_time_factor`: ``E K / (K + K0)`` for a reduction ``K`` per device; ``K0`` the depth an output tile's
  fixed memory traffic is worth, in proportion to the GPU's ridge point: 800 on A100, 1,514 on H100,
  `lightning_hybrid.planner.cluster.matmul_k0`), the attention core's ``4 h s / tp`` (and its recomputation) at the
  attention kernel's speed (`Cluster.attention_speed` of the GEMMs' rate: FlashAttention-2 on H100 ~0.54), plus
  ``layer_overhead`` per pass, plus
  element-wise work: the block's activations written in forward, read and written in backward
  (3 x activation bytes / memory bandwidth; under selective recompute the block's whole activations and the
  recomputed attention core's once more, under ``"pointwise"`` also the element-wise outputs it computes again,
  `pointwise_recomputed_bytes`: the MLP's activation, the residual sums, RMSNorm's and rotary's outputs);
* TP: two all-reduces of ``T h e`` bytes in forward and two in backward (Shoeybi et al. 2019; with sequence
  parallelism an all-gather + reduce-scatter pair each, the same volume; Korthikanti et al. 2022), two more
  when the block is recomputed (none for selective recompute, ``"attention"`` or ``"pointwise"``: the attention
  core and the element-wise ops have no TP collective, the reductions are kept, and sequence parallelism's
  all-gathers, which the recomputation runs again, are what SP's backward gathers again without recompute too --
  `lightning_hybrid.parallel.activation_checkpointing`); not
  overlapped with compute in this codebase's TP layers (unless ``async_tp``) but for the backward's (not compiled):
  the units' reductions under the column layers' weight-gradient GEMMs and SP's row all-gathers under their own part
  (`Cluster.tp_grad_reduce_overlap`, `Cluster.tp_row_gather_overlap`: what exceeds and the latency show); for a
  runtime that overlaps
  them with the GEMMs (`Cluster.tp_comm_overlap`, Megatron-Core) only the latency and what exceeds the block's GEMM
  time show; torch's async TP (this codebase's ``async_tp``, torchtitan's; `Cluster.tp_overlap_backward` False)
  overlaps the forward's collectives alone, with the forward's GEMMs, under sequence parallelism;
* PP (`pipeline_p2p_time`; the runtime: ``torch.distributed.pipelining``,
  `lightning_hybrid.parallel.pipeline.executor`): per micro-batch each stage boundary between two ranks carries one
  tensor forward, the hidden states, and its
  gradient back (the side inputs -- positions -- are split on every rank, not sent). Its bytes: ``T h`` elements
  of the residual stream's dtype, the parameters' (the embedding's output; fp32 under Lightning's autocast, whose
  residual additions keep it; `PRECISIONS`' ``p``), ``T/c`` tokens under CP, and under sequence parallelism
  ``1/tp`` of them where the boundary lies between two blocks (the split activations travel; the embedding's output
  is split at the first block's input and the last block gathers its own), else whole on every TP rank. One
  message each (latency + bytes / bandwidth) over the link of its two ranks (``dp c tp`` apart per rank of
  distance, so usually across nodes; `Cluster.link`; interleaved's wrap from the last rank to the first further).
  The first micro-batch's forward crosses every boundary in turn and the last one's backward crosses them back:
  exposed, whatever the schedule (``v pp - 1`` boundaries interleaved, ``2 pp - 2`` for ZB-V, whose turn is on one
  rank). In steady state GPipe and 1F1B wait for each transfer (GPipe posts a receive just before the stage needs
  it; 1F1B batches a forward send with the backward receive from the same neighbour and waits for both, and a
  backward send with the next forward receive): per micro-batch a rank pays one message per neighbour (GPipe:
  the slowest boundary's once per pass). The interleaved and ZB-V schedules (torch's schedule runtime) post their
  receives as early as the schedule allows and wait for sends only at the end: a rank's messages of a micro-batch
  (one forward and one backward per stage whose neighbour is on another rank) run under its computation, only
  what exceeds it shows. A runtime that scatters the boundary tensor over TP and all-gathers it at the receiver
  (`Cluster.pp_scatter_gather`, Megatron-LM: Narayanan et al. 2021, section 4.1) sends ``1/tp`` of every one.

The head adds ``6 h V / tp`` FLOPs per token and under TP either three all-reduces of one fp32 per token (the
vocab-parallel cross entropy's max, sum and target logit) or, without ``loss_parallel``, the logits'
all-gather (fp32).

Pipeline (Narayanan et al. 2021): ``step = (m + bubble) t_mb`` with the bubble ``(pp - 1)`` micro-batch
times for GPipe and 1F1B -- a bubble fraction ``(pp-1)/m`` of the ideal time -- ``(pp - 1)/v`` for the
interleaved schedule with ``v`` stages per rank, and a third of 1F1B's for zero-bubble (Qi et al. 2024, ZB-H1's
figure; a conservative bound for ZB-V). Accumulation around the pipeline (`Layout.accumulate` runs of the schedule
per step): each run has its bubble and its ramp; the gradients are reduced once, after the last (ZeRO-3: the stage
gathered in each run).

DP (this codebase's buckets, `lightning_hybrid.parallel.zero`): stage 0 all-reduces the gradients, stages 1-2
reduce-scatter them and all-gather the updated parameters, stage 3 all-gathers the parameters in forward and
backward and reduce-scatters the gradients (ZeRO: 2 Psi vs 3 Psi of traffic). Each overlap is modelled once, only
where the schedule allows it, as ``max(0, communication - its compute window)``, plus what cannot overlap:

* stages 0-2: gradients are reduced once per optimizer step, the buckets launching during the backward that ends
  the accumulation window: ``max(R/u, R - B)`` (``R`` the reduction, ``u`` buckets, ``B`` the last micro-batch's
  backward with its recomputation: the last bucket is reduced after it); under PP a runtime reducing during the
  stage's last backward (`Cluster.grad_reduce_overlap_pp`: this codebase, Megatron-Core) as without PP, one reducing
  after the schedule (Megatron-LM 2021) ``R``; stages 1-2's all-gather of the updated parameters follows the step
  (exposed: ``G``), or for a runtime gathering them under the next step's first forward ``F``, bucket by bucket
  (`Cluster.param_gather_overlap`, Megatron-Core's ``--overlap-param-gather``) ``max(G/u, G - F)``;
* stage 3 (FSDP2, ``u`` units, ``G`` one pass of gathers): per micro-batch ``G/u + max(0, G - F)`` in forward (each
  unit prefetched under the previous one's forward ``F``, the first exposed), ``max(0, G - B)`` in backward, and in
  the window's last micro-batch ``max(0, G + R - B) + R/u`` (the reduce-scatters in the same window as the
  gathers; the last unit's after it), in every micro-batch with ``grad_reduce="micro_batch"``. Under PP a stage is
  gathered once and reduced after the schedule. Hybrid sharding (``dp_shard``): the gathers and reduce-scatters
  over the ``dp_shard cp`` ranks of a group, then each shard all-reduced across the ``dp / dp_shard`` replicas.

Every term keeps its collectives' latency, so no layout's DP communication is 0 at scale. The optimizer step reads
and writes its states once (memory bound), or takes the measured time per parameter (CPU).

Mixture of experts (`ModelSpec.experts`): a MoE block's compute and all-to-alls are
`lightning_hybrid.planner.expert_time`'s (its docstring); the experts' gradients (``E/ep`` experts per MoE block) are
reduced over their own data-parallel group of ``edp`` ranks (``ep`` x the EP group's stride apart), in their own
buckets; the rest over ``dp`` as below; the optimizer steps ``1/edp`` of them under ZeRO.

Context parallelism (`Layout.cp` = ``c``; `lightning_hybrid.parallel.context_parallel`), per block and micro-batch:

* compute: ``1/c`` of the block's -- its ``T/c`` tokens through the matrices, and attention's ``T/c`` queries
  against all ``T`` keys (``4 h s`` FLOPs per query: ``1/c`` as well; the zigzag split balances the causal mask's
  work) -- and of the head; without activation checkpointing plus the attention core's forward once more (its
  ``4 h s / tp`` FLOPs per local token): the implementation checkpoints the gather and the attention, so backward
  recomputes it (with activation checkpointing the recomputed layer's forward, counted already, includes it); TP's
  collectives and the pipeline's boundary tensors carry ``T/c`` tokens; the element-wise traffic includes the
  gathered K/V and their copy in the sequence's order (`context_attention_traffic`; ``documents`` attend one call
  per document, no masks);
* KV exchange (``c > 1``; `kv_exchange_time`), each a ring over ``c`` ranks of ``2 b s (a_kv/tp) d e`` bytes for K
  and V together -- grouped-query attention's key/value heads, which the implementation repeats per query head
  after the gather (`Cluster.cp_gathers_kv_heads`; ``a/tp`` heads for a runtime repeating them first) -- a rank
  sending ``(c-1)/c`` of it (`kv_exchange_bytes`): in forward an all-gather of K and one of V
  over the ``cp`` group; in backward they are gathered again (by the checkpointed attention's recomputation, or
  with activation checkpointing by the layer's), and the reduce-scatter of their gradients follows (gloo, on a CPU
  cluster: an all-reduce): 3 exchanges (`kv_exchanges`). Per micro-batch (not per block) the all-gather of the
  tokens' int64 positions, from which each rank finds whether the batch has documents and where they are. Over
  the link the cp group spans (``c`` ranks ``tp`` apart: NVLink while ``c tp`` fits in a node; `Cluster.link`).
  Not overlapped with computation (attention waits for the gathered keys; the implementation's collectives are
  synchronous): on the critical path (``cp_comm``), and in the pipeline bubble like the rest of a micro-batch's
  time. Ring attention (`Layout.cp_attention` ``"ring"``): point-to-point transfers of the rank's own K/V (and in
  backward of their fp32 gradients) at each of the ring's ``c`` steps, under that step's attention: what exceeds
  it shows (`kv_exchange_time`); its merges' traffic replaces the gathered K/V's (`context_attention_traffic`);
  not checkpointed of its own, so without recomputation its attention core runs no second forward;
* DP: the gradients are reduced (and ZeRO-sharded) over the ``dp c`` ranks (``tp`` apart), the experts' over
  ``dp c/ep``; the optimizer steps ``1/(dp c)`` under ZeRO.

FP8 (``fp8``; `lightning_hybrid.planner.float8`): the converted linears' GEMMs at the float8 rate, their casts as
element-wise traffic and launches in the block's compute, this codebase's amax all-reduces per linear and
micro-batch on the critical path (``fp8_comm``), and under ZeRO-3 with float8 all-gather the converted weights
gathered at 1 byte.

A step also costs the cluster's ``step_overhead`` (the training loop's own time; measured on CPU).

Collectives between computation cost ``collective_overhead`` each beyond their transfer (ranks that arrive apart,
threads that wake; measured on CPU, milliseconds; 0 on the GPU presets), counted per step for TP, PP and DP.

CPU (``compute_units`` > 0): the transfers are the cores' own work, so nothing overlaps computation; and the
node's ranks share its cores: with more ranks than cores everything a rank does (computation, communication,
the training loop) runs ``ranks / cores`` times slower.

The collectives' and transfers' own times and volumes are in `lightning_hybrid.planner.communication` (re-exported
here); this module the compute, the bubble and the step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightning_hybrid.parallel.pipeline.executor import SCHEDULES
from lightning_hybrid.parallel.zero import DEFAULT_BUCKET_CAP_MB

from .activations import (
    PRECISIONS,
    ActivationCoefficients,
    block_activation_bytes,
    block_activations,
    block_coefficients,
    op_recomputed_weights,
    pointwise_recomputed_bytes,
)
from .cluster import Cluster

# The collectives' times and volumes (re-exported here, as they were defined here).
from .communication import (
    all_to_all_bytes,
    all_to_all_time,
    kv_exchange_bytes,
    kv_exchange_time,
    kv_exchanges,
    mask_gather_time,
    pipeline_boundaries,
    pipeline_p2p_time,
    ring_forwards,
    ring_time,
    ring_volume,
)
from .context_memory import context_attention_traffic
from .expert_time import moe_block_time
from .float8 import check_fp8, fp8_amax_time, fp8_block_linears, fp8_extra_time
from .gemm import matmul_time_factor
from .layout import Layout
from .model import ModelSpec
from .placement import rank_block_counts, rank_expert_params, rank_layers, rank_params, rank_trainable

__all__ = ["TimeEstimate", "all_to_all_bytes", "all_to_all_time", "bubble_fraction", "estimate_time",
           "matmul_time_factor", "pipeline_boundaries", "pipeline_p2p_time",
           "kv_exchange_bytes", "kv_exchange_time", "kv_exchanges", "mask_gather_time", "ring_time", "ring_volume"]


#: Schedules run by torch's schedule runtime, which posts receives early and waits for sends at the end: their
#: steady-state transfers run under the rank's computation.
_ASYNC_P2P = ("interleaved_1f1b", "zero_bubble")



def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle time over ideal time: ``(pp-1)/m`` (GPipe, 1F1B), ``(pp-1)/(v m)`` (interleaved),
    ``(pp-1)/(3 m)`` (zero-bubble)."""
    if pp == 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m)
    if schedule == "zero_bubble":
        return (pp - 1) / (3 * m)
    return (pp - 1) / m


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one optimizer step, by part (``total`` = what is on the critical path)."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    total: float
    ep_comm: float = 0.0  # the expert-parallel all-to-alls
    cp_comm: float = 0.0  # the context-parallel key/value all-gathers and reduce-scatters
    fp8_comm: float = 0.0  # FP8: the amaxes' all-reduces (`lightning_hybrid.planner.float8`)

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm, "ep_comm": self.ep_comm,
                "cp_comm": self.cp_comm, "fp8_comm": self.fp8_comm, "bubble": self.bubble, "dp_comm": self.dp_comm,
                "optimizer": self.optimizer, "total": self.total}


def estimate_time(model: ModelSpec, layout: Layout, cluster: Cluster,
                  bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, *, documents: bool = False,
                  fp8: str | None = None) -> TimeEstimate:
    """The predicted step time of ``layout`` (see the module docstring). ``documents``: the batches hold documents
    (attended per document: the same time model as plain causal batches, the default).
    ``fp8``: the strategy's FP8 recipe (`lightning_hybrid.planner.float8`: the blocks' linears, and the LM head where
    `Cluster.fp8_head`, on the float8 tensor cores; their casts; this codebase's amax all-reduces); None: bf16."""
    lay, prec = layout, cluster.precision
    lay.check_model(model)
    check_fp8(fp8, cluster, model)
    pb, gb, ob, e = PRECISIONS[prec]
    flops = cluster.achievable_flops(prec)
    s, h, t, b, ep, cp = model.seq_len, model.hidden, lay.tp, lay.micro_batch, lay.ep, lay.cp
    tokens = b * s // cp  # the rank's tokens of a micro-batch (all of them without context parallelism)
    mode = lay.recompute_mode
    recompute = mode == "full"  # the whole layer recomputed (activation checkpointing)
    passes = 4 if recompute else 3  # forward, backward = 2 forwards, recomputed forward
    dense_act, moe_act = block_activations(model, lay, prec)
    # The attention core's forward runs once more (its 4 h s FLOPs per local token again) under selective recompute,
    # and under CP without activation checkpointing (the checkpointed gather and attention, recomputed in backward);
    # with full recomputation the recomputed layer's forward, counted in the passes, includes it. Under CP the
    # element-wise traffic includes the gathered K/V and their reordered copy (KORTHIKANTI: its own scores), which
    # the block does not keep.
    # Sliding windows: the attention core on the keys the windows leave, where the kernel skips the rest.
    keys = s * model.attention_span() if cluster.window_kernels else s
    selective = mode in ("attention", "pointwise")
    ring = lay.cp_attention == "ring"  # (not checkpointed of its own: no second forward)
    core_flops = tokens * 4 * h * keys / t  # the attention core's forward of the rank's tokens
    core_recompute = core_flops if selective or (cp > 1 and mode == "none" and not ring) else 0.0
    cp_traffic = context_attention_traffic(model, b, prec, t, cp, ring)

    # LoRA (``model.lora_rank``): a frozen weight has no weight-gradient GEMM, one pass of the weights' fewer (the
    # adapters' own GEMMs, r/h of a weight's, are left out).
    weight_passes = passes - (1 if model.lora_rank else 0)
    # Per-op selective recompute (torchtitan's "op"): the even-numbered matmuls' forward GEMMs again.
    op_dense = op_recomputed_weights(model)[0] if mode == "op" else 0.0
    gemms = (weight_passes * model.block_matmul_weights() + op_dense) * tokens * 2 / t
    block_flops = gemms + passes * tokens * 4 * h * keys / t + core_recompute
    shape = matmul_time_factor(model, t, cluster.matmul_k0)  # the weight GEMMs' time at their shapes
    # Attention's core (its counted 4 h s FLOPs per token and pass, and its recomputation) at the attention kernel's
    # speed, which is not a GEMM's (`Cluster.attention_speed`).
    attention_flops = passes * tokens * 4 * h * keys / t + core_recompute
    slower = attention_flops * (1 / cluster.attention_speed - 1)
    block_matmul = (block_flops + (shape - 1) * gemms + slower) / flops
    bandwidth = cluster.memory_bandwidth
    if selective or mode == "op":
        # Element-wise traffic is the work's, not what is kept: the block's whole activations (the attention core's
        # too, though not kept), and the recomputed core's (Korthikanti's scores, softmax and dropout) once more;
        # under "pointwise" the element-wise outputs computed again too (written once more: 1/3 of the 3 passes).
        whole, whole_moe = block_activations(model, dataclasses.replace(lay, recompute="full"), prec)
        core = block_activation_bytes(ActivationCoefficients(0.0, 0.0, block_coefficients(model, prec).scores), s,
                                      b, h, model.heads, t, cp=cp)
        if mode == "op":  # the attention's output kept: no core recomputed; the element-wise ops are
            core = 0.0
        again, again_moe = pointwise_recomputed_bytes(model, lay, prec) if mode != "attention" else (0.0, 0.0)
        dense_act, moe_act = whole + (core + again) / 3, whole_moe + (core + again_moe) / 3
    block_compute = block_matmul + passes * cluster.layer_overhead + 3 * (dense_act + cp_traffic) / bandwidth
    block_fp8 = head_fp8 = 0.0  # FP8: the amax all-reduces per micro-batch
    if fp8:
        weight_gemms = passes * tokens * 2 * model.block_matmul_weights() / t * shape / flops
        linears = fp8_block_linears(model, t)
        block_compute += fp8_extra_time(fp8, cluster, weight_gemms, passes, linears, tokens, recompute)
        stage_ranks = lay.dp * cp * t
        amax = fp8_amax_time(fp8, cluster, stage_ranks, t, cluster.link(stage_ranks, 1), cluster.link(t, 1))
        block_fp8 = sum(count for count, _, _ in linears) * amax
        if fp8 == "tensorwise" and cluster.fp8_all_gather and lay.zero_stage == 3:
            # Weights gathered in float8: their amaxes leave the linears' forward all-reduces for one of each FSDP
            # unit per forward (`lightning_hybrid.parallel.float8_all_gather`; a block's, again when recomputed).
            block_fp8 += (2 if recompute else 1) * amax / 2
        head_fp8 = amax if cluster.fp8_head else 0.0
    tp_link = cluster.link(t, 1)
    tp_count = 6 if recompute else 4  # all-reduces (or AG + RS pairs) per block: forward, backward, recomputation
    block_tp = tp_count * ring_time(t, tokens * h * e, tp_link)
    if cluster.tp_comm_overlap and t > 1 and not cluster.compute_units and (
            cluster.tp_overlap_backward or lay.sequence_parallel):
        # The runtime pipelines TP's collectives with the block's GEMMs: what exceeds the GEMMs' time shows, and
        # each collective's latency (its first chunk) always does. Megatron-Core's --tp-comm-overlap overlaps every
        # pass; torch's async TP (`Cluster.tp_overlap_backward` False, sequence parallelism only) the forward's
        # (and a recomputed forward's) all-gathers and reduce-scatters with the forward's GEMMs, the backward's
        # two collectives showing whole.
        overlapped = tp_count if cluster.tp_overlap_backward else tp_count - 2
        under = block_matmul if cluster.tp_overlap_backward else block_matmul * (passes - 2) / passes
        one = block_tp / tp_count
        latency = overlapped * 2 * (t - 1) * tp_link.latency
        block_tp = (tp_count - overlapped) * one + latency + max(0.0, overlapped * one - latency - under)
    elif cluster.tp_grad_reduce_overlap and t > 1 and not cluster.compute_units and not (
            fp8 and not cluster.fp8_fused_casts):
        # The two units' input-gradient reductions under their column layers' weight-gradient GEMMs, whatever is
        # recomputed (`unit_backward`): two all-reduces, or under SP two reduce-scatters (half their pairs' time).
        # Not torchao's float8 linears (no fused casts): one op for both gradients, reduced after it.
        one = block_tp / tp_count
        hidden, steps = (one, 2 * (t - 1)) if lay.sequence_parallel else (2 * one, 4 * (t - 1))
        latency = steps * tp_link.latency
        under = model.block_column_weights() * tokens * 2 / t * shape / flops
        block_tp = block_tp - hidden + latency + max(0.0, hidden - latency - under)
        if lay.sequence_parallel and mode in ("none", "full") and cluster.tp_row_gather_overlap:
            # The row layers' eager backward (`unit_backward.sequence_row`; a selective checkpoint keeps them one op
            # each): the two all-gathers of their output gradients under this rank's part of their input gradients.
            rows = (model.block_matmul_weights() - model.block_column_weights()) * tokens * 2 / t / t * shape / flops
            block_tp = block_tp - one + latency + max(0.0, one - latency - rows)
    # per block, dense or MoE; a ring's transfers under its attention's steps (one forward pass's core)
    block_cp = kv_exchange_time(model, lay, cluster, core_flops / (flops * cluster.attention_speed))
    mask_cp = mask_gather_time(model, lay, cluster)  # per micro-batch: the positions, for its mask
    head_passes = 2 if model.lora_rank else 3  # (never recomputed; frozen under LoRA)
    head_gemms = 2 * head_passes * tokens * h * model.vocab / t / flops * (1 + cluster.matmul_k0 / h)
    head_compute = head_gemms + 3 * cluster.layer_overhead
    if fp8 and cluster.fp8_head:
        head_compute += fp8_extra_time(fp8, cluster, head_gemms, 3, [(1, h, model.vocab / t)], tokens, False)
    if lay.loss_parallel:  # vocab-parallel cross entropy: all-reduces of a max, a sum and the target logit
        head_tp = 3 * ring_time(t, tokens * 4, tp_link)
    else:  # the logits gathered
        head_tp = ring_time(t, tokens * model.vocab * 4, tp_link, "all_gather")
    # A MoE block: attention and shared experts split over TP, the router and the experts on the routed tokens;
    # TP's collectives for attention (and the shared experts); the all-to-alls over the EP group.
    moe_compute = moe_tp = moe_ep = 0.0
    moe_units = 2 if model.shared_ffn else 1  # TP regions of a MoE block (a dense block has 2)
    if model.experts:
        moe_compute, moe_ep = moe_block_time(
            model, lay, cluster, tokens=tokens, passes=passes, weight_passes=weight_passes, recompute=recompute,
            mode=mode, attention_flops=attention_flops, slower=slower,
            elementwise=passes * cluster.layer_overhead + 3 * (moe_act + cp_traffic) / bandwidth)
        moe_tp = moe_units / 2 * block_tp

    spec = SCHEDULES[lay.schedule] if lay.pp > 1 else SCHEDULES["1f1b"]
    per_rank = lay.virtual_stages if lay.pp > 1 else 1
    ranks = rank_layers(model, lay.pp, per_rank, spec.style)
    counts = rank_block_counts(model, lay.pp, per_rank, spec.style)  # (dense, MoE) blocks per rank
    head_index = model.n_layer + 1

    def rank_times(rank: int) -> tuple[float, float, float, float, float]:
        (dense, moe), head = counts[rank], head_index in ranks[rank]
        return (dense * block_compute + moe * moe_compute + (head_compute if head else 0.0),
                dense * block_tp + moe * moe_tp + (head_tp if head else 0.0), moe * moe_ep,
                (dense + moe) * block_cp + (mask_cp if dense + moe else 0.0),
                dense * block_fp8 + (head_fp8 if head else 0.0))

    times = [rank_times(rank) for rank in range(lay.pp)]
    compute_mb, tp_mb, ep_mb, cp_mb, fp8_mb = max(times, key=sum)
    runs = lay.accumulate  # pipeline schedules per optimizer step (1 without accumulation around the pipeline)
    m = lay.micro_batches * runs  # micro-batches per optimizer step
    t_mb = compute_mb + tp_mb + ep_mb + cp_mb + fp8_mb
    bubble = bubble_fraction(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages) * m * t_mb  # each run's
    ramp, steady = pipeline_p2p_time(model, lay, cluster)
    pp_mb = steady if cluster.compute_units else max(0.0, steady - compute_mb * (lay.schedule in _ASYNC_P2P))
    pp_comm = runs * ramp + m * pp_mb

    # DP: the fullest rank's parameters over the dp ring (ranks tp apart; dp cp ranks under CP), in gradient buckets
    # of ``bucket_cap_mb`` (stages 0-2) or FSDP2 units, one per block and one for the rest (stage 3). Under EP the
    # experts apart: over their own dp cp/ep ranks (ep tp apart), in their own buckets.
    fullest = max(range(lay.pp), key=lambda rank: rank_params(model, ranks[rank], t, ep))
    P = rank_params(model, ranks[fullest], t, ep)
    P_x = rank_expert_params(model, ranks[fullest], ep) if ep > 1 else 0.0
    n, edp = lay.shard, lay.edp
    dense_units, moe_units_dp = counts[fullest]

    def messages(params: float, units: int) -> int:
        if params <= 0:
            return 0
        return units if lay.zero_stage == 3 else max(1, math.ceil(params * gb / (bucket_cap_mb * 2**20)))

    if lay.zero_stage == 3:  # hybrid sharding: gathered and reduce-scattered within the dp_shard cp ranks
        n = lay.zero3_shard
    # Each group: (ranks, elements gathered, elements reduced, link, messages). LoRA: the adapters (on the dense
    # weights) alone are reduced, and gathered after the step by ZeRO 1-2; ZeRO-3 gathers the frozen weights too.
    trained = rank_trainable(model, ranks[fullest], t, ep) if model.lora_rank else None
    dense_units_all = dense_units + moe_units_dp + 1
    if trained is not None and lay.zero_stage < 3:
        (dense_t, experts_t), expert_units = trained, moe_units_dp
        groups = [(n, dense_t, dense_t, cluster.ring_link(n, t), messages(dense_t, dense_units_all)),
                  (edp, experts_t, experts_t, cluster.ring_link(edp, ep * lay.ep_stride),
                   messages(experts_t, expert_units))]
    else:
        dense_reduced, experts_reduced = (P - P_x, P_x) if trained is None else trained
        groups = [(n, P - P_x, dense_reduced, cluster.ring_link(n, t), messages(P - P_x, dense_units_all)),
                  (edp, P_x, experts_reduced, cluster.ring_link(edp, ep * lay.ep_stride), messages(P_x, moe_units_dp))]
    groups = [g for g in groups if g[0] > 1 and g[4] > 0]
    # ZeRO-3 with float8 all-gather (`Cluster.fp8_all_gather`, tensorwise): the converted weights at 1 byte.
    float8_gathered = 0.0
    if fp8 == "tensorwise" and cluster.fp8_all_gather and lay.zero_stage == 3:
        float8_gathered = (dense_units * model.block_matmul_weights()
                           + (h * model.vocab if cluster.fp8_head and head_index in ranks[fullest] else 0)) / t
    if lay.zero_stage == 0:
        reduce = sum(ring_time(size, r * gb, link, messages=k) for size, _, r, link, k in groups)
        gather = 0.0
    else:
        reduce = sum(ring_time(size, r * gb, link, "reduce_scatter", k) for size, _, r, link, k in groups)
        # (FP8 refuses experts: with float8 all-gather the only group is the dense one, P - P_x = P.)
        gather = sum(ring_time(size, p * pb - float8_gathered * (pb - 1), link, "all_gather", k)
                     for size, p, _, link, k in groups)
    if lay.zero_stage == 3 and lay.replicas > 1:  # then each shard all-reduced across the replicas (n t ranks apart)
        reduce += ring_time(lay.replicas, (P - P_x if trained is None else trained[0]) / n * gb,
                            cluster.ring_link(lay.replicas, n * t), messages=messages(P - P_x, dense_units_all))
    units = max(1, max((k for *_, k in groups), default=1))  # buckets (stages 0-2) or FSDP2 units (stage 3)
    # Each overlap once, only where the schedule allows it; what a compute window cannot hide shows, and so does
    # the one message that cannot start before the window ends (or must end before it starts): never 0 at scale.
    # F, B: a micro-batch's forward and backward (with the recomputation) on the fullest pipeline rank.
    forward = compute_mb / passes
    backward = compute_mb - forward
    if cluster.compute_units:  # on a CPU the transfers are the cores' own work: nothing overlaps computation
        reductions = m if lay.zero_stage == 3 and lay.pp == 1 and lay.grad_reduce == "micro_batch" else 1
        dp_comm = reductions * reduce + (gather if lay.zero_stage != 3 else (runs if lay.pp > 1 else 2 * m) * gather)
    elif lay.zero_stage == 3 and lay.pp > 1:  # a stage gathered once per schedule, reduced after the last
        dp_comm = reduce + runs * gather
    elif lay.zero_stage == 3:
        # FSDP2, per micro-batch: forward gathers unit by unit, each prefetched under the previous unit's forward
        # (the first shows: G/u); backward gathers again under the previous unit's backward, and in the window's
        # last micro-batch (gradients are reduced once per step) the reduce-scatters run in the same window, the
        # last unit's after it (R/u); reduce-scattering every micro-batch (``grad_reduce``), in each of them.
        reducing = m if lay.grad_reduce == "micro_batch" else 1
        dp_comm = (m * (gather / units + max(0.0, gather - forward))
                   + (m - reducing) * max(0.0, gather - backward)
                   + reducing * (max(0.0, gather + reduce - backward) + reduce / units))
    else:
        # Buckets launch during the backward that ends the accumulation window (nothing is reduced before it): the
        # last micro-batch's backward hides them, the last bucket's shows; under PP (this codebase reduces after
        # the schedule) only a runtime that reduces during the stage's last backward overlaps them. Stages 1-2
        # all-gather the updated parameters after the optimizer step (or, Megatron-Core, under the next forward).
        if cluster.param_gather_overlap:  # under the next step's first forward, the first bucket's exposed
            gather = max(gather / units, gather - forward)
        if lay.pp == 1 or cluster.grad_reduce_overlap_pp:
            dp_comm = max(reduce / units, reduce - backward) + gather
        else:
            dp_comm = reduce + gather
    per_param = cluster.optimizer_time_per_param or 2 * (pb + gb + ob) / cluster.memory_bandwidth
    # ZeRO 1-3 step a 1/dp slice (the experts' 1/(dp/ep)); dp cp under CP
    optimizer = (per_param * (P - P_x) / (n if lay.zero_stage else 1)
                 + per_param * P_x / (edp if lay.zero_stage else 1))
    if trained is not None:  # LoRA: the adapters alone are stepped
        sharded = lay.zero_stage > 0
        optimizer = per_param * (trained[0] / (n if sharded else 1) + trained[1] / (edp if sharded else 1))

    own = m * compute_mb + optimizer  # what a rank computes itself
    # Collectives the fullest rank takes part in per step, each costing ``collective_overhead`` beyond its
    # transfer. TP: per block and micro-batch 2 per pass of the forward and 2 in backward (with SP an
    # all-gather + reduce-scatter per unit in forward; a reduce-scatter, an all-gather and the regather of the
    # kept input per unit in backward), a MoE block's per its units (attention, shared experts), the head's 3
    # (vocab-parallel loss) or 1, the embedding's 1. EP: per MoE block and micro-batch the split sizes' exchange
    # and 2 all-to-alls per forward, 2 in backward. PP: a send and a receive per stage and micro-batch. DP: one
    # per bucket (ZeRO 1-2: and a gather), ZeRO-3 three per unit (gather in forward and in backward,
    # reduce-scatter), per micro-batch without a pipeline. CP: per block and micro-batch the all-gathers of K and
    # of V in forward, again in backward (`kv_exchanges`) and the reduce-scatters of their gradients; per
    # micro-batch the positions' all-gather.
    if t > 1:
        per_block = (10 if lay.sequence_parallel else 4) + (4 if lay.sequence_parallel else 2) * recompute
        per_moe = per_block * moe_units / 2
        tp_colls = m * (max(d * per_block + k * per_moe for d, k in counts) + (3 if lay.loss_parallel else 1) + 1)
    else:
        tp_colls = 0
    ep_colls = m * max(k for _, k in counts) * (5 + 3 * recompute) if ep > 1 else 0
    # a ring's steps, a send and receive each: cp - 1 per pass (forward, again where recomputed, backward) and the
    # gradients' last transfer home
    exchanges = (ring_forwards(lay) + 1) * (cp - 1) + cp if ring else 2 * kv_exchanges(lay)
    cp_colls = m * (max(d + k for d, k in counts) * exchanges + 1) if cp > 1 else 0
    pp_colls = m * 2 * per_rank if lay.pp > 1 else 0
    dp_messages = sum(k for *_, k in groups)
    if lay.zero_stage == 3:
        dp_colls = dp_messages * (2 * runs + 1 if lay.pp > 1 else 3 * m)
    else:
        dp_colls = dp_messages * (2 if lay.zero_stage else 1)
    sync = (tp_colls + ep_colls + cp_colls + pp_colls + dp_colls) * cluster.collective_overhead
    waits = m * (tp_mb + ep_mb + cp_mb + fp8_mb) + pp_comm + dp_comm + sync + cluster.step_overhead
    critical = own + bubble + waits
    if cluster.compute_units:
        # A node's ranks share its cores, and on a CPU all of a rank's work -- computing, moving the bytes of
        # its collectives, the training loop -- is the cores' work: more ranks than cores run that much slower.
        on_node = min(lay.devices, cluster.devices_per_node)
        critical = max(critical, (own + waits) * max(1.0, on_node / cluster.compute_units))
    return TimeEstimate(compute=m * compute_mb, tp_comm=m * tp_mb, pp_comm=pp_comm, bubble=bubble,
                        dp_comm=dp_comm, optimizer=optimizer, total=critical, ep_comm=m * ep_mb, cp_comm=m * cp_mb,
                        fp8_comm=m * fp8_mb)
