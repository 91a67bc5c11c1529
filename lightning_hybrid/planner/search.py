"""The search: every valid layout of a model on ``devices`` devices for a global batch, predicted and ranked.

Dimensions: ``tp`` (a divisor of the devices within one node that divides the heads, key/value heads, MLP
size and vocabulary: `tp_divides`), ``pp`` (at most one stage per pipeline layer), context parallelism ``cp``
(`cp_choices`: a divisor of what ``tp pp`` leave such that the sequence length divides by ``2 cp`` and each rank
keeps at least `MIN_CP_TOKENS` tokens of a sequence; those that do not are counted as turned away), ``dp`` = the
rest (it must divide the global batch), ZeRO stage (1-3 only with ``dp cp > 1``: ZeRO shards over the ``dp cp``
ranks), the micro-batch size (a divisor of a replica's batch; the count is then a pipeline's micro-batches or,
without PP, gradient accumulation), the schedule and its virtual stages (checked by the strategy's own
`resolve_schedule`), recomputation (none, full, or selective -- the attention core, or it and the element-wise ops
-- `RECOMPUTE_CHOICES`; not ``"pointwise"`` at the ``megatron`` precisions, which stand for Megatron-LM runs and
whose memory model refuses it), sequence parallelism
(``tp > 1``), under context parallelism how attention meets the other ranks' keys and values (all-gathered or
around a ring: `Layout.cp_attention`), and for a mixture-of-experts
model expert parallelism ``ep`` (`ep_choices`: the divisors of ``dp cp`` that divide the number of experts, 1
included; with every ZeRO stage, `EP_ZERO_STAGES`; for a runtime that folds it over TP, `Cluster.ep_folding`, the
divisors of ``dp cp tp`` too, folded). Each candidate gets `estimate_memory`; those that fit the
device (`USABLE_MEMORY` of it) get `estimate_time` and are ranked by step time (then memory).

The partition of the layers over stages is cached per stage count (`rank_layers`), so 1,024 devices search in
one to two seconds (`benchmarks/bench_planner.py` times it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from lightning_hybrid.core.dims import ParallelDims, divisors
from lightning_hybrid.parallel.context_parallel.ring import CP_ATTENTION
from lightning_hybrid.parallel.pipeline.executor import SCHEDULES, resolve_schedule

from .cluster import USABLE_MEMORY, Cluster
from .float8 import check_fp8
from .layout import Layout
from .memory import MEGATRON_PRECISIONS, MemoryEstimate, estimate_memory, resolve_grad_reduce
from .model import ModelSpec
from .time import TimeEstimate, estimate_time

__all__ = ["Candidate", "EP_ZERO_STAGES", "MIN_CP_TOKENS", "Plan", "RECOMPUTE_CHOICES",
           "cp_choices", "enumerate_layouts", "ep_choices",
           "evaluate", "plan", "tp_divides"]

GIB = 2**30
#: ZeRO stages the search combines with ``ep > 1``: all of them (0-2: the experts' buckets reduced and sharded over
#: their own dp/ep group; 3: the experts ``fully_shard``-ed over that group,
#: `lightning_hybrid.parallel.zero.apply_fsdp_experts`; tests/context_expert/test_moe.py).
EP_ZERO_STAGES = (0, 1, 2, 3)
#: Recompute modes searched, as ``(activation_checkpointing, recompute)``: none, full (the whole layer), selective
#: (``recompute="attention"``: the attention core only) and pointwise selective (``recompute="pointwise"``: the
#: attention core and every element-wise op; not at the ``megatron`` precisions, `MEGATRON_PRECISIONS`);
#: `Layout.recompute_mode`.
RECOMPUTE_CHOICES = ((False, "full"), (True, "full"), (False, "attention"), (False, "pointwise"))
#: The fewest tokens of a sequence the search leaves a context-parallel rank (``seq_len / cp``): context parallelism
#: is for sequences too long for one device's activations. Below this the time model, which takes every GEMM at the
#: same efficiency and every attention tile as large, would credit splitting a short sequence as a finer
#: micro-batch (smaller pipeline bubble) that real kernels do not deliver; it also keeps the search of ordinary
#: sequence lengths (<= 2048: no ``cp`` at all) the size it was. ``enumerate_layouts(min_cp_tokens=...)`` changes it.
MIN_CP_TOKENS = 2048


@dataclass(frozen=True)
class Candidate:
    """A layout with its predictions; ``reason`` says why it does not fit (empty when it does)."""

    layout: Layout
    memory: MemoryEstimate
    time: Optional[TimeEstimate]
    tokens_per_s: float
    mfu: float
    reason: str = ""

    @property
    def fits(self) -> bool:
        return not self.reason

    def as_dict(self) -> dict:
        return {"layout": self.layout.label(), **self.layout.as_dict(), "fits": self.fits, "reason": self.reason,
                "memory_bytes": self.memory.as_dict(), "memory_rank": self.memory.rank,
                "time_s": self.time.as_dict() if self.time else None, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu}


@dataclass
class Plan:
    """``ranked``: the layouts that fit, fastest first; ``too_big``: those that do not, smallest first;
    ``invalid``: how many sizes each rule turned away."""

    model: ModelSpec
    cluster: Cluster
    devices: int
    global_batch: int
    ranked: list[Candidate] = field(default_factory=list)
    too_big: list[Candidate] = field(default_factory=list)
    invalid: Counter = field(default_factory=Counter)

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            smallest = self.too_big[0].reason if self.too_big else "no valid layout"
            raise ValueError(f"No layout of {self.model.name} fits {self.devices} x {self.cluster.name} at global batch"
                             f" {self.global_batch}: the smallest {smallest}. Rules that turned sizes away:"
                             f" {dict(self.invalid)}.")
        return self.ranked[0]

    def rank_of(self, layout: Layout) -> Optional[int]:
        """1-based rank of ``layout`` among those that fit (None if it is not among them)."""
        return next((i + 1 for i, c in enumerate(self.ranked) if c.layout == layout), None)


def tp_divides(model: ModelSpec, tp: int) -> bool:
    """Whether ``tp`` splits every TP'd size evenly: heads, key/value heads, MLP size, vocabulary, and the shared
    experts' MLP (the experts themselves stay whole across TP)."""
    return all(n % tp == 0 for n in (model.heads, model.kv_heads, model.ffn, model.vocab, model.shared_ffn))


def ep_choices(model: ModelSpec, dp: int) -> list[int]:
    """Expert-parallel sizes for ``dp`` ranks (``dp cp`` under context parallelism: the expert-parallel ranks are
    carved out of those): its divisors that divide the number of experts (``[1]`` for a dense model)."""
    return [ep for ep in divisors(dp) if model.experts and model.experts % ep == 0] if model.experts else [1]


def cp_choices(model: ModelSpec, ranks: int, invalid: Optional[Counter] = None,
               min_tokens: int = MIN_CP_TOKENS) -> list[int]:
    """Context-parallel sizes out of ``ranks`` (the devices ``tp pp`` leave): 1 and its divisors ``cp`` such that
    the model's sequence length divides by ``2 cp`` (the zigzag split's chunks) and leaves each rank at least
    ``min_tokens`` of it; the others counted in ``invalid``."""
    invalid = Counter() if invalid is None else invalid
    choices = [1]
    for cp in divisors(ranks)[1:]:
        if model.seq_len % (2 * cp):
            invalid["seq_len not divisible by 2*cp"] += 1
        elif model.seq_len // cp < min_tokens:
            invalid[f"cp: fewer than {min_tokens} tokens of a sequence per rank"] += 1
        else:
            choices.append(cp)
    return choices


def enumerate_layouts(model: ModelSpec, cluster: Cluster, devices: int, global_batch: int, *,
                      sequence_parallel: bool = True, schedules: Sequence[str] = tuple(SCHEDULES),
                      max_virtual_stages: int = 4, invalid: Optional[Counter] = None,
                      pipeline: bool = True, whole_batch_loss: bool = False,
                      context_parallel: bool = True, min_cp_tokens: int = MIN_CP_TOKENS,
                      ring_attention: bool = True) -> Iterator[Layout]:
    """Every valid layout (see the module docstring); the sizes turned away are counted in ``invalid``.
    ``context_parallel=False``: ``cp = 1`` only (a strategy without context parallelism); ``min_cp_tokens``: the
    fewest tokens of a sequence a context-parallel rank may keep (`MIN_CP_TOKENS`); ``ring_attention=False``:
    context parallelism all-gathers the keys and values only (a model with attention dropout, which ring attention
    refuses); else each ring layout comes right after its all-gather twin (`plan` relies on it).
    ``pipeline=False``: ``pp = 1`` only (a model that cannot train under a pipeline). ``whole_batch_loss``: the
    model adds a loss of the whole batch (its routers' load-balancing loss), which a pipeline computes under GPipe
    only, without sequence parallelism (`lightning_hybrid.parallel.pipeline.aux`)."""
    invalid = Counter() if invalid is None else invalid
    pipeline_layers = model.n_layer + 2
    recomputes = tuple(c for c in RECOMPUTE_CHOICES
                       if c[1] != "pointwise" or cluster.precision not in MEGATRON_PRECISIONS)
    for tp in divisors(devices):
        if tp > cluster.devices_per_node:
            invalid[f"tp > {cluster.devices_per_node} devices of a node"] += 1
            continue
        if not tp_divides(model, tp):
            invalid["tp does not divide heads/kv heads/MLP/vocabulary"] += 1
            continue
        for pp in divisors(devices // tp):
            if pp > pipeline_layers:
                invalid[f"pp > {pipeline_layers} pipeline layers"] += 1
                continue
            if pp > 1 and not pipeline:
                invalid["pp > 1: the model does not train under a pipeline"] += 1
                continue
            for cp in cp_choices(model, devices // (tp * pp), invalid, min_cp_tokens) if context_parallel else (1,):
                dims = ParallelDims.resolve(-1, tp, pp, world_size=devices // cp)  # dp: what tp, pp and cp leave
                if global_batch % dims.dp:
                    invalid["dp does not divide the global batch"] += 1
                    continue
                replica_batch = global_batch // dims.dp
                for b in divisors(replica_batch):
                    m = replica_batch // b
                    if pp > 1 and whole_batch_loss:
                        yield from _schedules(model, dims, cp, b, m, pipeline_layers, False,
                                              [s for s in schedules if s == "gpipe"], max_virtual_stages, invalid,
                                              recomputes, ring_attention=ring_attention)
                        continue
                    yield from _schedules(model, dims, cp, b, m, pipeline_layers, sequence_parallel, schedules,
                                          max_virtual_stages, invalid, recomputes,
                                          _node_shard(dims.dp, tp, cp, cluster.devices_per_node), cluster.ep_folding,
                                          ring_attention)


def _node_shard(dp: int, tp: int, cp: int, devices_per_node: int) -> Optional[int]:
    """The ``dp_shard`` of hybrid sharding within one node (TorchTitan's and Accelerate's usual HSDP): the data-parallel
    ranks of a node, where they are fewer than ``dp`` and divide it; else ``None`` (not searched)."""
    per_node = devices_per_node // (tp * cp)
    return per_node if 1 <= per_node < dp and dp % per_node == 0 and per_node * tp * cp == devices_per_node else None


def _schedules(model, dims, cp, b, m, pipeline_layers, sequence_parallel, schedules, max_virtual_stages, invalid,
               recomputes=RECOMPUTE_CHOICES, node_shard: Optional[int] = None, ep_folding: bool = False,
               ring_attention: bool = True):
    tp, pp, dp = dims.tp, dims.pp, dims.dp
    choices = [("1f1b", 1)] if pp == 1 else []
    attentions = CP_ATTENTION if cp > 1 and ring_attention else CP_ATTENTION[:1]
    for name in (schedules if pp > 1 else ()):
        per_rank = SCHEDULES[name].stages_per_rank
        for v in (range(2, max_virtual_stages + 1) if per_rank == 0 else (per_rank,)):
            if pp * v > pipeline_layers:
                invalid["pp x virtual stages > pipeline layers"] += 1
                continue
            try:
                resolve_schedule(name, pp, m, v)
            except ValueError:
                invalid[f"{name}: micro-batch count (resolve_schedule)"] += 1
                continue
            choices.append((name, v))
    # Expert parallelism within dp cp; for a runtime that folds it over TP (`Cluster.ep_folding`), also over dp cp tp
    # (sequence parallel only).
    eps = [(ep, False) for ep in ep_choices(model, dp * cp)]
    if ep_folding and tp > 1 and sequence_parallel:
        eps += [(ep, True) for ep in ep_choices(model, dp * cp * tp) if ep > 1]
    for name, v in choices:
        for ep, fold in eps:
            for zero in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):
                if ep > 1 and zero not in EP_ZERO_STAGES:
                    continue
                # what `resolve_grad_reduce` would choose where there is nothing to choose (no ZeRO-3 accumulation):
                # the search's candidates need no resolving copy then
                reduce = "auto" if zero == 3 and pp == 1 and m > 1 else "window"
                shards = (None, node_shard) if zero == 3 and ep == 1 and node_shard is not None else (None,)
                for ac, recompute in recomputes:
                    for sp in ((True,) if fold else (False, True) if tp > 1 and sequence_parallel else (False,)):
                        for dp_shard in shards:
                            for attention in attentions:
                                yield Layout(dp, tp, pp, zero, b, m, name, v, ac, sp, ep=ep, cp=cp,
                                             recompute=recompute, dp_shard=dp_shard, ep_folding=fold,
                                             cp_attention=attention, grad_reduce=reduce)


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int,
             documents: bool = False, compile: bool = False, fp8: str | None = None) -> Candidate:
    """Predictions for one layout: memory always, time when it fits (``documents``, ``compile``, ``fp8``: `plan`'s).
    ``grad_reduce="auto"`` is resolved first, as the strategy resolves it (`resolve_grad_reduce`)."""
    layout = resolve_grad_reduce(model, layout, cluster.precision, cluster.memory)
    memory = estimate_memory(model, layout, cluster.precision, cluster.activation_scale, documents=documents,
                             compile=compile)
    usable = USABLE_MEMORY * cluster.memory
    if memory.total > usable:
        reason = (f"needs {memory.total / GIB:.2f} GiB on pipeline rank {memory.rank} > {usable / GIB:.2f} GiB usable"
                  f" (params {memory.params / GIB:.1f}, grads {memory.grads / GIB:.1f}, optimizer"
                  f" {memory.optimizer / GIB:.1f}, activations {memory.activations / GIB:.1f})")
        return Candidate(layout, memory, None, 0.0, 0.0, reason)
    time = estimate_time(model, layout, cluster, documents=documents, fp8=fp8)
    tokens = global_batch * model.seq_len
    tokens_per_s = tokens / time.total
    mfu = model.flops_per_token() * tokens_per_s / (layout.devices * cluster.peak_flops(cluster.precision))
    return Candidate(layout, memory, time, tokens_per_s, mfu)


def plan(model: ModelSpec, cluster: Cluster, devices: int, global_batch: int, *, documents: bool = False,
         compile: bool = False, fp8: str | None = None, **search: object) -> Plan:
    """All layouts of ``model`` on ``devices`` of ``cluster`` for ``global_batch`` sequences per optimizer step,
    ranked. ``documents``: the batches hold documents (packed, left padding), whose attention takes a mask -- SDPA's
    float copy of the model's kept per layer without cp, one call's block under cp (`estimate_memory`); default
    plain causal batches. ``compile``: the strategy's ``compile=True``, whose
    ZeRO-3 units are whole layers (`estimate_memory`; the time model is unchanged). ``fp8``: the strategy's FP8
    recipe (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``; `lightning_hybrid.planner.float8`: the time
    model; memory as bf16's, the casts transient; MFU stays against the bf16 peak). ``search``:
    `enumerate_layouts`'s options (``sequence_parallel``, ``schedules``, ...)."""
    if devices < 1 or global_batch < 1:
        raise ValueError(f"devices={devices}, global_batch={global_batch}: both must be positive integers.")
    check_fp8(fp8, cluster, model)
    result = Plan(model, cluster, devices, global_batch)
    usable, twin = USABLE_MEMORY * cluster.memory, None
    for layout in enumerate_layouts(model, cluster, devices, global_batch, invalid=result.invalid, **search):
        # A ring's layout comes right after its all-gather twin (`enumerate_layouts`), whose memory differs in
        # activations alone: where the twin's model states and buffers do not fit by themselves, neither do the
        # ring's (not evaluated).
        if layout.cp_attention == "ring" and twin is not None and (
                twin.memory.total - twin.memory.activations > usable):
            result.invalid["ring attention: the model states alone do not fit"] += 1
            continue
        candidate = evaluate(model, layout, cluster, global_batch, documents, compile, fp8)
        twin = candidate if layout.cp_attention == "all_gather" and layout.cp > 1 else None
        (result.ranked if candidate.fits else result.too_big).append(candidate)
    result.ranked.sort(key=lambda c: (c.time.total, c.memory.total))
    result.too_big.sort(key=lambda c: c.memory.total)
    return result
