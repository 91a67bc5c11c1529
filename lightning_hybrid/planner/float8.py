"""FP8 training in the planner: what `HybridStrategy(fp8=...)` (`lightning_hybrid.parallel.float8`, torchao's
float8 recipes) changes in a step's time.

A converted linear (fwd + bwd, ``M`` tokens, reduction ``K``, ``N`` outputs on the device) runs its GEMMs on the
float8 tensor cores and pays for the casts (torchao's roofline, ``torchao/float8/README.md``: a float8 linear costs
its float8 GEMMs plus the amax and cast kernels, memory bound):

* GEMMs: the forward, grad-input and grad-weight GEMMs run at ``FP8_GEMM_EFFICIENCY[recipe]`` of the float8 peak
  over the bf16 peak times faster than at bf16 (`fp8_gemm_speedup`; on H100 1,979 / 989 TFLOP/s; the same shape
  factor `matmul_time_factor` applies to both); ``rowwise_with_gw_hp`` keeps the grad-weight GEMM in high
  precision (`FP8_GRAD_WEIGHT_HP`);
* casts: each of the three operands (input ``M K``, weight ``K N``, output gradient ``M N``) is read for its amax
  and cast once for each float8 GEMM it enters, the second layout transposed: `CAST_BYTES` per element (2 bf16 bytes
  read per amax, then per cast 2 read and 1 written: tensorwise 2 + 2 x 3 = 8; rowwise scales along the other
  axis for the transposed layout, a second amax: 10; ``rowwise_with_gw_hp`` casts the input and the output gradient
  once, for the GEMMs that are float8: 5); a recomputed forward casts its input and weight again (`RECAST_BYTES`);
  at the cluster's memory bandwidth;
* a fixed ``FP8_LINEAR_OVERHEAD`` seconds per linear and micro-batch (the amax and cast kernels' launches).

The two constants that are not first principles, ``FP8_GEMM_EFFICIENCY["tensorwise"]`` and ``FP8_LINEAR_OVERHEAD``,
are fitted on torchao's two published H100 microbenchmark points for a tensorwise linear under compile (M, K, N
= 1024, 2048, 1024: 0.80x bf16; 4096, 8192, 16384: 1.39x; `MICROBENCHMARKS`); the rowwise GEMMs' efficiency on
torchao's end-to-end rowwise run (Llama 3 8B on 8 H100, 1.10x). `benchmarks/bench_planner.py` checks the model
against the end-to-end tensorwise runs it was not fitted to (`benchmarks/PLANNER.md`, "FP8").

This codebase's distributed FP8 is exact against one device: every amax is MAX-reduced over the ranks that split
its operand (`Cluster.fp8_amax_reduced`): with tensorwise scaling two small all-reduces per linear and micro-batch
over the stage's ``dp cp tp`` ranks (the input's and weight's amaxes in forward, the output gradient's in
backward); rowwise one over those ranks (the grad-weight GEMM's scales, along the tokens) and one over TP (the
split features); ``rowwise_with_gw_hp`` only the one over TP. They are latency, synchronous and on the critical
path: ``2 ceil(log2 n)`` hops of the group's link (NCCL's tree for small messages) plus the cluster's
``collective_overhead``. A runtime that scales each rank's activations by their own amax (torchtitan) pays none.
ZeRO-3 with float8 all-gather (`Cluster.fp8_all_gather`, torchtitan's ``enable_fsdp_float8_all_gather``; this
codebase's ``fp8_all_gather=True``) gathers a converted weight at 1 byte per element; here the weights' amaxes then
leave the linears' forward all-reduces for one all-reduce per FSDP unit and forward.
"""

from __future__ import annotations

import math

from .cluster import Cluster, Link
from .model import ModelSpec

__all__ = ["CAST_BYTES", "FP8_GEMM_EFFICIENCY", "FP8_LINEAR_OVERHEAD", "FP8_RECIPES", "FUSED_CAST_BYTES",
           "MICROBENCHMARKS", "check_fp8", "fp8_amax_time", "fp8_block_linears", "fp8_extra_time", "fp8_gemm_factor",
           "fp8_gemm_speedup", "fp8_linear_speedup", "fp8_traffic"]

#: The recipes the planner models (`HybridStrategy`'s ``fp8`` names).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: The fraction of the float8 peak's advantage over bf16's a float8 GEMM gets at the same shape (`fp8_gemm_speedup`):
#: tensorwise fitted on `MICROBENCHMARKS`, rowwise (cuBLAS's rowwise-scaled GEMM, slower than the tensorwise one)
#: on torchao's end-to-end rowwise run (Llama 3 8B, 8 H100: 1.10x).
FP8_GEMM_EFFICIENCY = {"tensorwise": 0.81, "rowwise": 0.69, "rowwise_with_gw_hp": 0.69}
#: Recipes whose grad-weight GEMM stays in high precision.
FP8_GRAD_WEIGHT_HP = ("rowwise_with_gw_hp",)
#: HBM bytes per element of the input, the weight and the output gradient: per amax 2 read, per cast 2 read and 1
#: written (module docstring).
CAST_BYTES = {"tensorwise": (8, 8, 8), "rowwise": (10, 10, 10), "rowwise_with_gw_hp": (5, 10, 5)}
#: ... and per element of the input and weight when a recomputed forward casts them again (an amax and one cast).
RECAST_BYTES = 5
#: Transformer Engine's casts (`Cluster.fp8_fused_casts`: Megatron-Core, NeMo): the input's cast is fused into the
#: kernel producing it (LayerNormLinear's norm, the fused activation), the weights are cast once per optimizer step
#: (kept in float8 between micro-batches), the output gradient read once and written in both layouts by one
#: cast-transpose kernel (2 + 1 + 1 bytes); no launches of their own.
FUSED_CAST_BYTES = (0, 0, 4)
#: Seconds per converted linear and micro-batch that do not scale with its size (the amax and cast kernels'
#: launches; fitted with the tensorwise speedup on `MICROBENCHMARKS`).
FP8_LINEAR_OVERHEAD = 8e-6
#: torchao's published H100 speedups of one tensorwise float8 linear (fwd + bwd, compiled) over bf16:
#: ``(M, K, N) -> speedup`` (pytorch/ao torchao/float8/README.md, "Performance", examples 1 and 2).
MICROBENCHMARKS = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}


def check_fp8(fp8: str | None, cluster: Cluster, model: ModelSpec | None = None) -> None:
    """``ValueError`` unless ``fp8`` is None or a modelled recipe on a cluster with float8 tensor cores (a dense
    model: the strategy's FP8 leaves experts out, so a MoE model's FP8 run is not modelled)."""
    if fp8 is None:
        return
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8={fp8!r} is not a recipe the planner models: use one of {list(FP8_RECIPES)} or None.")
    if "fp8" not in cluster.flops:
        raise ValueError(f"fp8={fp8!r}: cluster {cluster.name!r} has no float8 tensor cores (its flops name"
                         f" {sorted(cluster.flops)}); FP8 training needs compute capability 8.9+ (H100, H200, L40S).")
    if model is not None and model.experts:
        raise ValueError(f"fp8={fp8!r}: {model.name} has experts, whose FP8 the planner does not model (the strategy"
                         " refuses FP8 with expert parallelism); plan it in bf16.")


def fp8_gemm_speedup(fp8: str, cluster: Cluster) -> float:
    """How many times faster a float8 GEMM runs than the bf16 one of the same shape: ``FP8_GEMM_EFFICIENCY`` of the
    peaks' ratio."""
    return FP8_GEMM_EFFICIENCY[fp8] * cluster.flops["fp8"] / cluster.flops["bf16"]


def fp8_gemm_factor(fp8: str, passes: int, cluster: Cluster) -> float:
    """A converted linear's GEMM time over its bf16 GEMM time, over ``passes`` GEMM passes (3: forward,
    grad-input, grad-weight; 4 with a recomputed forward): the grad-weight pass at bf16 for `FP8_GRAD_WEIGHT_HP`."""
    hp = 1 if fp8 in FP8_GRAD_WEIGHT_HP else 0
    return ((passes - hp) / fp8_gemm_speedup(fp8, cluster) + hp) / passes


def fp8_block_linears(model: ModelSpec, tp: int) -> list[tuple[int, float, float]]:
    """A dense block's linears on one TP rank as ``(count, K, N)`` (per linear): q, k, v (or the attention's
    matrices but one), o, the MLP's up (and gate) and down. The column-parallel ones keep ``K = h`` and split ``N``,
    the row-parallel ones split ``K``."""
    h, d = model.hidden, model.head_dim
    out_width = model.heads * d
    in_attn = model.attention_weights() - h * out_width  # q, k, v: h x (a + 2 a_kv) d
    ups = 2 if model.gated_mlp else 1
    return [(3, h, in_attn / h / 3 / tp), (1, out_width / tp, h),
            (ups, h, model.ffn / tp), (1, model.ffn / tp, h)]


def fp8_traffic(fp8: str, linears: list[tuple[int, float, float]], tokens: float, recompute: bool,
                fused: bool = False) -> float:
    """HBM bytes the casts of ``linears`` (`fp8_block_linears`) move per micro-batch of ``tokens`` on the rank
    (``fused``: Transformer Engine's, `FUSED_CAST_BYTES`)."""
    x, w, g = FUSED_CAST_BYTES if fused else CAST_BYTES[fp8]
    recompute = recompute and not fused
    total = 0.0
    for count, k, n in linears:
        total += count * (x * tokens * k + w * k * n + g * tokens * n
                          + (RECAST_BYTES * (tokens * k + k * n) if recompute else 0.0))
    return total


def fp8_extra_time(fp8: str, cluster: Cluster, gemms: float, passes: int, linears: list[tuple[int, float, float]],
                   tokens: float, recompute: bool) -> float:
    """Seconds ``linears`` (`fp8_block_linears`) take in float8 beyond their bf16 GEMM time ``gemms`` (over
    ``passes`` GEMM passes), per micro-batch of ``tokens``: the GEMMs' change (`fp8_gemm_factor`), the casts' traffic
    at the memory bandwidth (`fp8_traffic`) and the launches (`FP8_LINEAR_OVERHEAD` a linear)."""
    fused = cluster.fp8_fused_casts
    return (gemms * (fp8_gemm_factor(fp8, passes, cluster) - 1)
            + fp8_traffic(fp8, linears, tokens, recompute, fused) / cluster.memory_bandwidth
            + (0 if fused else sum(count for count, _, _ in linears) * FP8_LINEAR_OVERHEAD))


def fp8_amax_time(fp8: str, cluster: Cluster, stage_ranks: int, tp: int, stage_link: Link, tp_link: Link) -> float:
    """Seconds per converted linear and micro-batch of this codebase's amax all-reduces (module docstring): each
    ``2 ceil(log2 n)`` hops of its link plus ``collective_overhead``; 0 for a runtime that does not reduce them."""
    if not cluster.fp8_amax_reduced:
        return 0.0

    def one(n: int, link: Link) -> float:
        return 2 * math.ceil(math.log2(n)) * link.latency + cluster.collective_overhead if n > 1 else 0.0

    if fp8 == "tensorwise":
        return 2 * one(stage_ranks, stage_link)
    if fp8 == "rowwise":
        return one(stage_ranks, stage_link) + one(tp, tp_link)
    return one(tp, tp_link)


def fp8_linear_speedup(m: int, k: int, n: int, cluster: Cluster, fp8: str = "tensorwise") -> float:
    """One converted linear's predicted bf16 / float8 time (fwd + bwd) on ``cluster``: what `MICROBENCHMARKS`
    measured, from the same terms `estimate_time` adds up."""
    check_fp8(fp8, cluster)
    gemms = 3 * 2 * m * k * n / cluster.achievable_flops("bf16-mixed") * (1 + cluster.matmul_k0 / k)
    return gemms / (gemms + fp8_extra_time(fp8, cluster, gemms, 3, [(1, k, n)], m, False))
