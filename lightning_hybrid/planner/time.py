"""Predicted time of one optimizer step of a layout, by part.

Collectives (ring algorithms, Patarasuk & Yuan 2009; NCCL's bus bandwidth): over ``n`` ranks a ring
all-reduce of ``B`` bytes sends ``2 (n-1)/n B`` per rank in ``2 (n-1)`` steps; reduce-scatter and all-gather
``(n-1)/n B`` in ``n-1`` steps (`ring_time`). The link is the slowest hop of the group (`Cluster.link`).

Per micro-batch of ``b`` sequences (``T = b s`` tokens) and per block on one device:

* compute: forward ``2 W / tp`` FLOPs per token for the block's ``W`` matrix weights plus ``4 h s / tp`` for
  attention (the `ModelSpec.flops_per_token` count), backward twice that, a checkpointed block's forward
  again (so x4/3); at the cluster's achievable matmul FLOP/s, plus ``layer_overhead`` per pass, plus
  element-wise work: the block's activations written in forward, read and written in backward
  (3 x activation bytes / memory bandwidth);
* TP: two all-reduces of ``T h e`` bytes in forward and two in backward (Shoeybi et al. 2019; with sequence
  parallelism an all-gather + reduce-scatter pair each, the same volume; Korthikanti et al. 2022), two more
  when the block is recomputed; not overlapped with compute (as in this codebase's TP layers);
* PP: each stage boundary sends the activations forward and their gradients back (``T h e`` bytes, point to
  point), on the critical path.

The head adds ``6 h V / tp`` FLOPs per token and under TP either three all-reduces of one fp32 per token (the
vocab-parallel cross entropy's max, sum and target logit) or, without ``loss_parallel``, the logits'
all-gather (fp32).

Pipeline (Narayanan et al. 2021): ``step = (m + bubble) t_mb`` with the bubble ``(pp - 1)`` micro-batch
times for GPipe and 1F1B -- a bubble fraction ``(pp-1)/m`` of the ideal time -- ``(pp - 1)/v`` for the
interleaved schedule with ``v`` stages per rank, and a third of 1F1B's for zero-bubble (Qi et al. 2024, ZB-H1's
figure; a conservative bound for ZB-V).

DP (this codebase's buckets, `lightning_hybrid.zero`): stage 0 all-reduces the gradients, stages 1-2
reduce-scatter them and all-gather the updated parameters, stage 3 all-gathers the parameters in forward and
backward and reduce-scatters the gradients (ZeRO: 2 Psi vs 3 Psi of traffic). Gradient reduction overlaps the
last backward when there is no pipeline (buckets launch during backward; under PP they are reduced after the
schedule); the parameter all-gather of stages 1-2 follows the step; stage 3's gathers are prefetched under
compute, so only what exceeds it shows. The optimizer step reads and writes its states once (memory bound),
or takes the measured time per parameter (CPU).

A step also costs the cluster's ``step_overhead`` (the training loop's own time; measured on CPU).

Collectives between computation cost ``collective_overhead`` each beyond their transfer (ranks that arrive apart,
threads that wake; measured on CPU, milliseconds; 0 on the GPU presets), counted per step for TP, PP and DP.

CPU (``compute_units`` > 0): the transfers are the cores' own work, so nothing overlaps computation; and the
node's ranks share its cores: with more ranks than cores everything a rank does (computation, communication,
the training loop) runs ``ranks / cores`` times slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_hybrid.pipeline.executor import SCHEDULES
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB

from .cluster import Cluster, Link
from .layout import Layout
from .memory import KORTHIKANTI, PRECISIONS, block_activation_bytes, codebase_coefficients, rank_layers, rank_params
from .model import ModelSpec

__all__ = ["TimeEstimate", "bubble_fraction", "estimate_time", "ring_time", "ring_volume"]


def ring_volume(n: int, nbytes: float, op: str = "all_reduce") -> float:
    """Bytes each rank sends in a ring ``op`` over ``n`` ranks: ``2 (n-1)/n B`` for all-reduce, ``(n-1)/n B``
    for reduce-scatter and all-gather."""
    if n <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def ring_time(n: int, nbytes: float, link: Link, op: str = "all_reduce", messages: int = 1) -> float:
    """Seconds of a ring ``op`` of ``nbytes`` in all, sent as ``messages`` collectives: their steps' latency
    plus the volume at the link's bandwidth."""
    if n <= 1:
        return 0.0
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    return messages * steps * link.latency + ring_volume(n, nbytes, op) / link.bandwidth


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

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm, "bubble": self.bubble,
                "dp_comm": self.dp_comm, "optimizer": self.optimizer, "total": self.total}


def estimate_time(model: ModelSpec, layout: Layout, cluster: Cluster,
                  bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> TimeEstimate:
    lay, prec = layout, cluster.precision
    pb, gb, ob, e = PRECISIONS[prec]
    flops = cluster.achievable_flops(prec)
    s, h, t, b = model.seq_len, model.hidden, lay.tp, lay.micro_batch
    tokens = b * s
    recompute = lay.activation_checkpointing
    passes = 4 if recompute else 3  # forward, backward = 2 forwards, recomputed forward
    coeffs = KORTHIKANTI if prec == "megatron" else codebase_coefficients(model, e)
    block_act = block_activation_bytes(coeffs, s, b, h, model.heads, t, lay.sequence_parallel)

    block_flops = passes * tokens * (2 * model.block_matmul_weights() + 4 * h * s) / t
    block_compute = block_flops / flops + passes * cluster.layer_overhead + 3 * block_act / cluster.memory_bandwidth
    tp_link = cluster.link(t, 1)
    block_tp = (6 if recompute else 4) * ring_time(t, tokens * h * e, tp_link)
    head_compute = 6 * tokens * h * model.vocab / t / flops + 3 * cluster.layer_overhead
    if lay.loss_parallel:  # vocab-parallel cross entropy: all-reduces of a max, a sum and the target logit
        head_tp = 3 * ring_time(t, tokens * 4, tp_link)
    else:  # the logits gathered
        head_tp = ring_time(t, tokens * model.vocab * 4, tp_link, "all_gather")

    spec = SCHEDULES[lay.schedule] if lay.pp > 1 else SCHEDULES["1f1b"]
    per_rank = lay.virtual_stages if lay.pp > 1 else 1
    ranks = rank_layers(model, lay.pp, per_rank, spec.style)
    head_index = model.n_layer + 1

    def rank_times(layers: tuple[int, ...]) -> tuple[float, float]:
        blocks = sum(1 for i in layers if 0 < i < head_index)
        head = head_index in layers
        return (blocks * block_compute + (head_compute if head else 0.0),
                blocks * block_tp + (head_tp if head else 0.0))

    times = [rank_times(layers) for layers in ranks]
    compute_mb, tp_mb = max(times, key=lambda x: x[0] + x[1])
    pp_link = cluster.link(2, lay.dp * lay.tp)
    boundary = tokens * h * e / (t if lay.sequence_parallel else 1)
    pp_mb = 2 * per_rank * (pp_link.latency + boundary / pp_link.bandwidth) if lay.pp > 1 else 0.0
    m = lay.micro_batches
    t_mb = compute_mb + tp_mb + pp_mb
    bubble = bubble_fraction(lay.schedule, lay.pp, m, lay.virtual_stages) * m * t_mb

    # DP: the fullest rank's parameters over the dp ring (ranks tp apart), in gradient buckets of
    # ``bucket_cap_mb`` (stages 0-2) or FSDP2 units, one per block and one for the rest (stage 3).
    fullest = max(ranks, key=lambda layers: rank_params(model, layers, t))
    P = rank_params(model, fullest, t)
    dp_link = cluster.link(lay.dp, lay.tp)
    n = lay.dp
    messages = (sum(1 for i in fullest if 0 < i < head_index) + 1 if lay.zero_stage == 3
                else max(1, math.ceil(P * gb / (bucket_cap_mb * 2**20))))
    if lay.zero_stage == 0:
        reduce, gather = ring_time(n, P * gb, dp_link, messages=messages), 0.0
    else:
        reduce = ring_time(n, P * gb, dp_link, "reduce_scatter", messages)
        gather = ring_time(n, P * pb, dp_link, "all_gather", messages)
    # On a CPU the transfers are the cores' own work: nothing overlaps computation.
    overlap = 0.0 if lay.pp > 1 or cluster.compute_units else compute_mb * 2 / passes  # the last backward
    if lay.zero_stage == 3 and lay.pp > 1:  # a stage gathered once, reduced after the schedule
        dp_comm = reduce + gather
    elif lay.zero_stage == 3:  # gathered per block in forward and backward, prefetched under compute
        hidden = 0.0 if cluster.compute_units else compute_mb
        dp_comm = max(0.0, reduce - overlap) + max(0.0, m * (2 * gather - hidden))
    else:
        dp_comm = max(0.0, reduce - overlap) + gather
    per_param = cluster.optimizer_time_per_param or 2 * (pb + gb + ob) / cluster.memory_bandwidth
    optimizer = per_param * P / (n if lay.zero_stage else 1)  # ZeRO 1-3 step a 1/dp slice

    own = m * compute_mb + optimizer  # what a rank computes itself
    # Collectives the fullest rank takes part in per step, each costing ``collective_overhead`` beyond its
    # transfer. TP: per block and micro-batch 2 per pass of the forward and 2 in backward (with SP an
    # all-gather + reduce-scatter per unit in forward; a reduce-scatter, an all-gather and the regather of the
    # kept input per unit in backward), the head's 3 (vocab-parallel loss) or 1, the embedding's 1. PP: a send
    # and a receive per stage and micro-batch. DP: one per bucket (ZeRO 1-2: and a gather), ZeRO-3 three per
    # unit (gather in forward and in backward, reduce-scatter), per micro-batch without a pipeline.
    blocks = max(sum(1 for i in layers if 0 < i < head_index) for layers in ranks)
    if t > 1:
        per_block = (10 if lay.sequence_parallel else 4) + (4 if lay.sequence_parallel else 2) * recompute
        tp_colls = m * (blocks * per_block + (3 if lay.loss_parallel else 1) + 1)
    else:
        tp_colls = 0
    pp_colls = m * 2 * per_rank if lay.pp > 1 else 0
    if n == 1:
        dp_colls = 0
    elif lay.zero_stage == 3:
        dp_colls = 3 * messages * (1 if lay.pp > 1 else m)
    else:
        dp_colls = messages * (2 if lay.zero_stage else 1)
    sync = (tp_colls + pp_colls + dp_colls) * cluster.collective_overhead
    waits = m * (tp_mb + pp_mb) + dp_comm + sync + cluster.step_overhead
    critical = own + bubble + waits
    if cluster.compute_units:
        # A node's ranks share its cores, and on a CPU all of a rank's work -- computing, moving the bytes of
        # its collectives, the training loop -- is the cores' work: more ranks than cores run that much slower.
        on_node = min(lay.devices, cluster.devices_per_node)
        critical = max(critical, (own + waits) * max(1.0, on_node / cluster.compute_units))
    return TimeEstimate(compute=m * compute_mb, tp_comm=m * tp_mb, pp_comm=m * pp_mb, bubble=bubble,
                        dp_comm=dp_comm, optimizer=optimizer, total=critical)
