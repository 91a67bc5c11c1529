"""What the planner knows about the machines: devices per node, memory, achievable FLOP/s, and the links.

`Cluster` holds, for one kind of device, its memory, its achievable dense-matmul FLOP/s per dtype, and per link
level (``intra``: within a node, ``inter``: across nodes) the bandwidth and latency a collective sees
(`Link`). Presets (`CLUSTER_PRESETS`), every figure from a public datasheet times a stated efficiency:

* ``a100``: DGX A100 nodes: 8 x A100-SXM4-80GB, NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node.
  - 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32 (A100 datasheet); achievable = x `MATMUL_EFFICIENCY`, and
    by shape x ``K / (K + K0)`` for a GEMM whose reduction is ``K`` (``K0`` = `MATMUL_K0` on A100, scaled by the
    GPU's ridge point, FLOP/s over HBM bytes/s, on other GPUs: `matmul_k0`); attention's core (QK^T, softmax,
    AV: fused flash / SDPA kernels) at `Cluster.attention_speed` of that rate on its counted FLOPs.
    (FP32 matmuls run as TF32 at 156 TFLOP/s only when enabled; the planner uses plain FP32.)
  - 80 GB HBM2e, 2.0 TB/s (datasheet).
  - NVLink 3: 600 GB/s per GPU, both directions together (datasheet) -> 300 GB/s per direction; a ring
    collective reaches x `LINK_EFFICIENCY` of it (NCCL's bus bandwidth on DGX A100 ~ 230-240 GB/s).
  - InfiniBand HDR 200 Gb/s = 25 GB/s per GPU (one HCA per GPU), x `LINK_EFFICIENCY`; a ring over whole nodes
    gets the node's 8 HCAs together (`Cluster.ring_link`).
  - latencies: ~5 us per NVLink hop, ~10 us per InfiniBand hop (NCCL's small-message all-reduce latency
    orders of magnitude; they matter only for small messages).
* ``a100-40gb``: DGX A100 nodes with A100-SXM4-40GB: the same compute and links, 40 GB of HBM2 at 1.555 TB/s
  (datasheet; ``K0`` 1,026 by its ridge point).
* ``h100``: DGX H100 nodes: 8 x H100-SXM5-80GB; 989 TFLOP/s dense BF16, 1,979 FP8, 67 FP32 (datasheet); 3.35 TB/s HBM3
  (ridge 295 FLOP/byte against A100's 156: ``K0`` 1,514); NVLink 4: 900 GB/s per GPU -> 450 per direction;
  8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU. Attention at the GEMMs' rate (``attention_speed`` 1: a kernel
  written for Hopper, FlashAttention-3 or cuDNN's); `FA2_ON_HOPPER` for a runtime running FlashAttention-2 there.
* ``cpu``: this machine's processes (gloo), figures from `calibrate` when ``$LIGHTNING_HYBRID_CLUSTER``
  or ``~/.cache/lightning_hybrid/cluster_cpu.json`` holds them, else conservative defaults. CPU ranks share
  ``compute_units`` cores: more ranks than cores run at ``compute_units / ranks`` of their speed each.

`calibrate` (``python -m lightning_hybrid.planner calibrate [--out PATH]``) measures, in under a minute, each
figure the fastest of several repeats (the least disturbed by other processes): one process's fp32 matmul
FLOP/s, element-wise memory bandwidth and AdamW step time per parameter; how many cores other users leave
free (one matmul loop per core, together; noted only); the fixed cost of a small transformer block's forward
+ backward (Python and dispatch overhead the FLOP count does not see); gloo all-reduce latency and bandwidth
between two local processes; and what a collective costs beyond its transfer when it comes between computation
(two processes alternating a matmul and a small all-reduce, against each alone: ranks that arrive apart and
communication threads that wake, milliseconds on this machine). It writes them as a cluster JSON
(`Cluster.to_json`, read back by `load_cluster`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

__all__ = ["CLUSTER_PRESETS", "DEFAULT_CALIBRATION", "FA2_ON_HOPPER", "Cluster", "Link", "calibrate", "cpu_cluster",
           "load_cluster", "matmul_k0"]

#: Fraction of the datasheet's dense peak that large transformer GEMMs reach (cuBLAS on A100/H100 reaches
#: ~70-80% on Megatron's shapes; the 0.7 is this model's one free constant at cluster scale, chosen once, before
#: the comparison with published runs in docs/planner.md).
MATMUL_EFFICIENCY = 0.7
#: The reduction depth a GEMM's fixed per-tile cost is worth on A100 (`Cluster.matmul_k0`: a GEMM with reduction
#: ``K`` per device runs at ``MATMUL_EFFICIENCY K / (K + 800)`` of the peak: 0.74 at K = 2304, 0.91 at 8192). The
#: second shared constant at cluster scale, chosen once by the mean error over the first four published sources of
#: ``benchmarks/bench_planner.py`` (a grid of 0-1600; every source's error, not one row's; three of them on A100).
#: Other GPUs scale it by their ridge point (`matmul_k0`).
MATMUL_K0 = 800.0
#: A100's ridge point, FLOP per byte of HBM traffic: 312 TFLOP/s dense BF16 over 2.0 TB/s (datasheet).
A100_RIDGE = 312 / 2.0
#: FlashAttention-2's speed on H100 relative to a kernel written for Hopper: Shah et al. 2024 (FlashAttention-3),
#: Figure 5, forward, BF16, head dim 128, causal, sequence 16k: FlashAttention-2 335 TFLOP/s, FlashAttention-3 616
#: (cuDNN 539). FlashAttention-2 uses none of Hopper's new instructions (wgmma, TMA); its plateau, a third of H100's
#: peak, is what runs before FlashAttention-3 (July 2024) used it. `Cluster.attention_speed` for such a runtime.
FA2_ON_HOPPER = 335 / 616
#: Fraction of a link's datasheet bandwidth a ring collective reaches (NCCL bus bandwidth / link bandwidth).
LINK_EFFICIENCY = 0.8
#: Fraction of device memory the planner lets a layout use (allocator fragmentation, CUDA context, workspaces).
USABLE_MEMORY = 0.9
#: Where `calibrate` writes and the CPU preset reads this machine's figures (``$LIGHTNING_HYBRID_CLUSTER`` first).
DEFAULT_CALIBRATION = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_hybrid"
                       / "cluster_cpu.json")

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link level: ``bandwidth`` bytes/s per device per direction as a ring collective sees it; ``latency``
    seconds per ring step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind in nodes of ``devices_per_node``.

    ``flops``: dense-matmul peak FLOP/s per device by dtype (``"bf16"``, ``"fp32"``), of which ``matmul_efficiency``
    is achievable (MFU is against the peak); ``memory``: bytes per
    device; ``memory_bandwidth``: bytes/s (element-wise work); ``layer_overhead``: seconds per transformer block
    per micro-batch per pass that do not scale with FLOPs (kernel launches, Python; measured on CPU);
    ``step_overhead``: seconds per optimizer step of the training loop itself (Lightning, callbacks, logging);
    ``optimizer_time_per_param``: seconds of an AdamW step per parameter (measured on CPU; 0: memory bound,
    its states read and written once at ``memory_bandwidth``);
    ``collective_overhead``: seconds a rank loses per collective beyond its transfer when the collectives come
    between computation (the ranks arrive apart and the communication threads wake; measured on CPU, where it
    is milliseconds; 0 for the GPU presets, whose launch latency is in the links' latency);
    ``compute_units``: how many ranks can compute at once on one node (CPU: its cores; 0 = every device;
    `calibrate` notes how many were free of other users' work when it ran, ``cores_free_at_calibration``);
    ``matmul_k0``: the reduction depth a GEMM's fixed per-tile cost is worth (`lightning_hybrid.planner.time.
    matmul_time_factor`: a GEMM with reduction ``K`` runs at ``matmul_efficiency K / (K + K0)``; 0: every shape at
    ``matmul_efficiency``; the GPU presets' `matmul_k0`, by their ridge point); ``activation_scale``: measured /
    predicted activation bytes (``step_overhead`` and ``activation_scale`` are fitted by
    ``benchmarks/bench_planner.py`` from single-device runs and written into this machine's file).

    What the runtime overlaps (the defaults: this codebase, whose TP layers are synchronous): ``tp_comm_overlap``:
    TP's collectives run under the block's GEMMs (Megatron-Core's ``--tp-comm-overlap``, Transformer Engine's
    userbuffers) -- in every pass where ``tp_overlap_backward`` (``True``), the forward's alone and only under
    sequence parallelism where not (torch's micro-pipelined async TP: this codebase's ``async_tp=True``, the CLI's
    ``--async-tp``, torchtitan's -- what its published speed-ups agree with); ``tp_grad_reduce_overlap``
    (``True``): the backward's reduction of a TP unit's input gradient (an all-reduce; a reduce-scatter under
    sequence parallelism) runs under its column layers' weight-gradient GEMMs, whatever is recomputed (this
    codebase's units when not compiled; Megatron's asynchronous all-reduce and reduce-scatter; ``False`` for
    Megatron-LM 2021 and its forks and for torchtitan's DTensor TP); ``tp_row_gather_overlap`` (``True``, with
    ``tp_grad_reduce_overlap``): under sequence parallelism a row layer's backward all-gathers its output gradient
    under this rank's part of its input gradient, outside a selective checkpoint (this codebase; ``False`` for
    Megatron, whose row layer gathers, then computes); ``grad_reduce_overlap_pp``
    (``True``): under PP each stage's gradient buckets are reduced during its last micro-batch's backward (this
    codebase, Megatron-Core's ``--overlap-grad-reduce``; ``False`` for a runtime that reduces after the schedule,
    Megatron-LM 2021); ``param_gather_overlap`` (``True``): ZeRO 1-2's all-gather of the
    updated parameters runs under the next step's first forward, bucket by bucket (Megatron-Core's
    ``--overlap-param-gather``; this codebase's ``overlap_param_gather``, on unless compiled: the CLI's
    ``--compile`` and ``--async-tp`` turn it off; ``False`` for a runtime that gathers after the optimizer step,
    DeepSpeed's ZeRO-1); ``cp_gathers_kv_heads``
    (``True``): context parallelism all-gathers grouped-query attention's ``a_kv`` key/value heads and repeats them
    after (this codebase, Llama 3's CP); ``False`` for a runtime that repeats them to ``a`` heads first;
    ``attention_speed`` (``1``): the attention core's speed -- its counted ``4 h s`` FLOPs per token forward, twice
    that backward -- relative to the GEMMs' ``matmul_efficiency`` (its kernel is not a GEMM: on A100 the
    published runs the planner is checked on agree with 1, on H100 too for a kernel written for it; FlashAttention-2,
    whose kernels use no Hopper instructions, `FA2_ON_HOPPER` there);
    ``window_kernels`` (``False``): the attention kernel skips the key blocks a sliding window masks
    (FlashAttention's ``window_size``, flex attention's block mask, cuDNN's; transformers' ``flash_attention_2``):
    a windowed model's attention core costs `lightning_hybrid.planner.model.ModelSpec.attention_span` of causal
    attention's; without it (this codebase's SDPA, which takes the window as a mask) every key up to the query is
    computed;
    ``ep_comm_overlap``: expert parallelism's all-to-alls run under another micro-batch's computation of the same
    MoE block (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, its combined 1F1B; DeepSeek-V3's DualPipe):
    only what exceeds the block's compute and the latency show (this codebase's are synchronous); ``ep_folding``:
    the runtime can fold expert parallelism over the TP ranks (Megatron-Core's MoE parallel folding: the search
    tries `lightning_hybrid.planner.layout.Layout.ep_folding` layouts); ``ep_dispatcher``: ``"alltoall"`` (this
    codebase, Megatron-Core's alltoall dispatcher: every (token, expert) pair sent to its rank) or ``"deepep"``
    (DeepEP, Megatron-Core's flex dispatcher: a token crosses the network once per node holding its experts,
    `lightning_hybrid.planner.communication.deepep_node_copies`);
    ``pp_scatter_gather``: each TP rank sends ``1/tp`` of a pipeline boundary's tensor and the receiver all-gathers
    it over TP (Megatron-LM's scatter/gather, Narayanan et al. 2021, section 4.1; this codebase sends it whole
    without sequence parallelism). Set for published runs of those runtimes (`benchmarks/bench_planner.py`).

    FP8 (`lightning_hybrid.planner.float8`; ``flops["fp8"]``: the dense float8 peak, on GPUs that have float8
    tensor cores): ``fp8_amax_reduced`` (``True``: this codebase, exact against one device) -- every amax
    MAX-reduced over the ranks that split its operand, small synchronous all-reduces per linear; ``False``: each
    rank scales by its own amax (torchtitan); ``fp8_all_gather``: ZeRO-3 gathers converted weights in float8
    (torchtitan's ``enable_fsdp_float8_all_gather``; this codebase's ``fp8_all_gather=True``, off by default, one
    amax all-reduce per FSDP unit and forward: the CLI's ``--fp8-all-gather``, a recipe's
    ``parallel.fp8_all_gather``); ``fp8_head``
    (``True``): the LM head is converted too (this codebase, unless ``fp8_exclude`` names it; torchtitan leaves
    its ``output`` in bf16); ``fp8_fused_casts``: Transformer Engine's casts, fused into the kernels producing
    the operands and weights cast once per step (Megatron-Core, NeMo; `lightning_hybrid.planner.float8.
    FUSED_CAST_BYTES`; this codebase's torchao casts are kernels of their own).
    """

    name: str
    devices_per_node: int
    memory: float
    flops: dict
    memory_bandwidth: float
    intra: Link
    inter: Link
    matmul_efficiency: float = 1.0
    layer_overhead: float = 0.0
    step_overhead: float = 0.0
    optimizer_time_per_param: float = 0.0
    collective_overhead: float = 0.0
    compute_units: int = 0
    activation_scale: float = 1.0
    precision: str = "bf16-mixed"
    notes: dict = field(default_factory=dict)
    tp_comm_overlap: bool = False
    tp_overlap_backward: bool = True
    tp_grad_reduce_overlap: bool = True
    tp_row_gather_overlap: bool = True
    grad_reduce_overlap_pp: bool = True
    cp_gathers_kv_heads: bool = True
    pp_scatter_gather: bool = False
    matmul_k0: float = 0.0
    attention_speed: float = 1.0
    param_gather_overlap: bool = True
    fp8_amax_reduced: bool = True
    fp8_all_gather: bool = False
    fp8_head: bool = True
    fp8_fused_casts: bool = False
    window_kernels: bool = False
    ep_comm_overlap: bool = False
    ep_folding: bool = False
    ep_dispatcher: str = "alltoall"

    def link(self, group_size: int, stride: int) -> Link:
        """The link a collective over ``group_size`` ranks ``stride`` ranks apart uses: within a node when the
        group's span ``group_size * stride`` fits in one node, else across (the slowest hop sets a ring's pace).
        Across nodes: one NIC's bandwidth (``inter``) per rank -- right for point-to-point sends and for a group
        with one rank per node; a ring spanning whole nodes is `ring_link`."""
        return self.intra if group_size * stride <= self.devices_per_node else self.inter

    def ring_link(self, group_size: int, stride: int) -> Link:
        """The link a ring collective (all-reduce, reduce-scatter, all-gather) over ``group_size`` ranks ``stride``
        apart sees per rank. Within a node: `link`'s. Across nodes the group has ``k = devices_per_node // stride``
        ranks on each node (at least 1), and the ``stride`` groups of a node share its ``devices_per_node`` NICs
        (one per device): NCCL runs one ring per NIC (channel), each through all of the group's ranks, the node's
        ``k`` ranks consecutive in it so that one hop per ring leaves the node. Each ring carries ``1/k`` of the
        bytes; a rank's ``2 (n-1)/n B`` (all-reduce) leaves its node over ``k`` NICs at once, so the rank's
        bandwidth is ``k x inter`` -- the node's aggregate NIC bandwidth shared by its ``k`` ranks -- at most the
        intra-node link's (``min(intra, k x inter)``); the latency per ring step is the inter-node hop's. A group
        with one rank per node (``stride >= devices_per_node``) gets one NIC (``inter``), as `link`. Hierarchical
        (NCCL's tree, or reduce within a node then across) moves the same bytes per NIC; only the latency term
        would be ``O(log n)`` steps instead of the ring's ``n - 1`` -- the ring's is the one counted (an upper
        bound at thousands of ranks)."""
        if group_size * stride <= self.devices_per_node:
            return self.intra
        k = max(1, self.devices_per_node // stride)
        return Link(min(self.intra.bandwidth, k * self.inter.bandwidth), self.inter.latency)

    def achievable_flops(self, precision: str) -> float:
        """Matmul FLOP/s a device reaches at ``precision`` (fp32 for ``32-true``, else bf16)."""
        return self.flops["fp32" if precision == "32-true" else "bf16"] * self.matmul_efficiency

    def peak_flops(self, precision: str) -> float:
        return self.flops["fp32" if precision == "32-true" else "bf16"]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        data = dict(data)
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        return cls(**data)


def matmul_k0(tflops_bf16: float, hbm_tb_s: float) -> float:
    """The reduction depth a GEMM's fixed per-tile cost is worth on a GPU of ``tflops_bf16`` dense BF16 peak and
    ``hbm_tb_s`` memory bandwidth: `MATMUL_K0` x its ridge point (FLOP per byte) over A100's (`A100_RIDGE`).

    The fixed cost of an output tile is memory traffic -- its first operand slices loaded before the tensor cores
    start, its result written by the epilogue -- while its ``K``-deep reduction is tensor-core work; measured in
    reduction depth, the traffic is worth as much more as the GPU computes faster per byte it moves. H100 computes
    3.2x A100's FLOP/s with 1.7x its bandwidth (ridge 295 vs 156 FLOP/byte): ``K0`` 1,514 against 800, so a GEMM
    with a 2,048-deep reduction reaches 0.57 of H100's ``MATMUL_EFFICIENCY`` and 0.72 of A100's."""
    return MATMUL_K0 * (tflops_bf16 / hbm_tb_s) / A100_RIDGE


def _gpu(
    name: str, tflops_bf16: float, tflops_fp32: float, hbm_tb_s: float, nvlink_gb_s: float, ib_gb_s: float,
    memory: float, tflops_fp8: float = 0.0,
) -> Cluster:
    flops = {"bf16": tflops_bf16 * 1e12, "fp32": tflops_fp32 * 1e12}
    if tflops_fp8:
        flops["fp8"] = tflops_fp8 * 1e12
    return Cluster(
        name=name, devices_per_node=8, memory=memory, flops=flops, matmul_efficiency=MATMUL_EFFICIENCY,
        matmul_k0=matmul_k0(tflops_bf16, hbm_tb_s),
        memory_bandwidth=hbm_tb_s * 1e12,
        intra=Link(nvlink_gb_s / 2 * GB * LINK_EFFICIENCY, 5e-6),
        inter=Link(ib_gb_s * GB * LINK_EFFICIENCY, 10e-6),
    )


#: What CUDA reports of an "80GB" card (``torch.cuda.get_device_properties(0).total_memory``): A100-SXM4-80GB
#: 81,920 MiB (80 GiB), H100-SXM5-80GB 81,559 MiB -- binary gigabytes, not 80e9 bytes (74.5 GiB).
A100_80GB_BYTES = 81920 * 2**20
A100_40GB_BYTES = 40960 * 2**20
H100_80GB_BYTES = 81559 * 2**20

CLUSTER_PRESETS: dict[str, Cluster] = {
    "a100": _gpu("a100", 312, 19.5, 2.0, 600, 25, A100_80GB_BYTES),
    "a100-40gb": _gpu("a100-40gb", 312, 19.5, 1.555, 600, 25, A100_40GB_BYTES),
    "h100": _gpu("h100", 989, 67, 3.35, 900, 50, H100_80GB_BYTES, tflops_fp8=1979),
}

#: CPU ranks share the machine's RAM; the planner holds each rank to all of it (a loose bound).
_RAM = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
#: This machine before `calibrate` ran: one core ~20 GFLOP/s fp32, gloo over loopback ~1 GB/s, 100 us a step.
_CPU_DEFAULT = Cluster(name="cpu-default", devices_per_node=64, memory=_RAM, flops={"fp32": 20e9},
                       memory_bandwidth=10 * GB, intra=Link(1 * GB, 100e-6), inter=Link(1 * GB, 100e-6),
                       layer_overhead=1e-3, step_overhead=20e-3, compute_units=os.cpu_count() or 1, precision="32-true")


def cpu_cluster() -> Cluster:
    """This machine: the calibration file if there is one (``$LIGHTNING_HYBRID_CLUSTER``, else
    `DEFAULT_CALIBRATION`), else defaults (``cpu-default``)."""
    path = Path(os.environ.get("LIGHTNING_HYBRID_CLUSTER", DEFAULT_CALIBRATION))
    return load_cluster(str(path)) if path.is_file() else _CPU_DEFAULT


def load_cluster(text: str) -> Cluster:
    """A preset name (``a100``, ``h100``, ``cpu``) or the path of a cluster JSON (`calibrate`'s output)."""
    if text == "cpu":
        return cpu_cluster()
    if text in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[text]
    path = Path(text)
    if path.is_file():
        return Cluster.from_dict(json.loads(path.read_text()))
    raise ValueError(f"cluster {text!r} is neither a preset ({sorted([*CLUSTER_PRESETS, 'cpu'])}) nor a cluster"
                     " JSON file.")


# ------------------------------------------------------------------------------------------------ calibration
def _fastest(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` (after one warm-up): on a shared machine the fastest
    run is the one least disturbed by other processes."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_flops(n: int = 512, repeats: int = 50) -> float:
    """FLOP/s of an ``n x n`` fp32 matmul."""
    import torch

    a, b = torch.randn(n, n, device="cpu"), torch.randn(n, n, device="cpu")
    return 2 * n**3 / _fastest(lambda: a @ b, repeats)


def _memory_bandwidth(n: int = 2**23, repeats: int = 10) -> float:
    """Bytes/s of an element-wise op (``a + b`` into a new tensor: two reads and a write of ``4n`` bytes)."""
    import torch

    a, b = torch.randn(n, device="cpu"), torch.randn(n, device="cpu")
    return 3 * 4 * n / _fastest(lambda: a + b, repeats)


def _adamw_time_per_param(n: int = 2**20, repeats: int = 10) -> float:
    """Seconds per parameter of ``torch.optim.AdamW.step`` (fp32, the default foreach implementation)."""
    import torch

    p = torch.nn.Parameter(torch.randn(n, device="cpu"))
    p.grad = torch.randn(n, device="cpu")
    return _fastest(torch.optim.AdamW([p]).step, repeats) / n


def _block_overhead(flops: float, repeats: int = 30) -> float:
    """Seconds of a tiny block's forward + backward beyond its FLOPs at ``flops``, per pass (forward or
    backward), i.e. what a block costs whatever its size."""
    import torch

    from lightning_hybrid.models.gpt import Block, GPTConfig

    config = GPTConfig(n_embd=32, n_head=4, block_size=16)
    block, x = Block(config).to("cpu"), torch.randn(1, 16, 32, requires_grad=True, device="cpu")
    per_step = _fastest(lambda: block(x).sum().backward(), repeats)
    work = 6 * 16 * (12 * 32 * 32) / flops
    return max(0.0, per_step - work) / 3  # forward ~ 1 pass, backward ~ 2


def _allreduce_worker(sizes: list[int], repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    times = []
    for n in sizes:
        t = torch.zeros(n, device="cpu")
        dist.barrier()
        times.append(_fastest(lambda t=t: dist.all_reduce(t), repeats))
    return times


def _collective_overhead_worker(repeats: int) -> float:
    """Seconds per collective that alternating computation and small all-reduces cost beyond the two alone
    (medians of 5 timings)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    a, b, t = torch.randn(1024, 512, device="cpu"), torch.randn(512, 512, device="cpu"), torch.zeros(1024, device="cpu")

    def timed(fn) -> float:  # the median: a step pays the typical cost of its many collectives, not the least
        fn()
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[2]

    compute = timed(lambda: [a @ b for _ in range(repeats)])
    communicate = timed(lambda: [dist.all_reduce(t) for _ in range(repeats)])
    both = timed(lambda: [(a @ b, dist.all_reduce(t)) for _ in range(repeats)])
    return max(0.0, both - compute - communicate) / repeats


def calibrate(out: Optional[Union[str, Path]] = None) -> Cluster:
    """Measure this machine (< 60 s) and write it as a cluster JSON to ``out`` (default `DEFAULT_CALIBRATION`).

    All-reduce between 2 processes: ``t(n) = 2 (latency) + 2 * (1/2) * 4n / bandwidth`` (a ring of 2, `time.py`)
    fitted at 256 and 4M fp32 elements."""
    import torch

    from lightning_hybrid.testing import run_distributed

    torch.set_num_threads(1)  # ranks run with one thread each (as run_distributed and Lightning's CPU ranks)
    flops = _matmul_flops()
    bandwidth_mem = _memory_bandwidth()
    adamw = _adamw_time_per_param()
    overhead = _block_overhead(flops)
    cores = os.cpu_count() or 1
    together = sum(run_distributed(_matmul_flops, cores, 512, 10))  # all cores at once: what other users leave free
    small, large = 256, 4 * 2**20
    t_small, t_large = (max(r) for r in zip(*run_distributed(_allreduce_worker, 2, [small, large], 20)))  # slower rank
    latency = t_small / 2
    collective_overhead = max(run_distributed(_collective_overhead_worker, 2, 30))
    bandwidth = 4 * large / max(t_large - t_small, 1e-9)  # 2 (n-1)/n * bytes = bytes for n = 2
    cluster = dataclasses.replace(
        _CPU_DEFAULT, name="cpu-calibrated", flops={"fp32": flops}, memory_bandwidth=bandwidth_mem,
        optimizer_time_per_param=adamw, intra=Link(bandwidth, latency), collective_overhead=collective_overhead,
        inter=Link(bandwidth, latency), layer_overhead=overhead, compute_units=cores,
        notes={"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "matmul": "512x512 fp32, 1 thread",
               "allreduce_s": {str(small): t_small, str(large): t_large},
               "cores_free_at_calibration": round(together / flops, 2)},
    )
    path = Path(out) if out is not None else DEFAULT_CALIBRATION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cluster.to_json())
    return cluster
