"""How much of Megatron-Core's communication overlap this codebase gives up, as the planner sees it.

    python benchmarks/bench_overlap.py [--out benchmarks/OVERLAP.md]
    python benchmarks/bench_overlap.py --cpu [--steps 8] [--rounds 4]    # also the CPU measurements (~8 min)

For each workload (Llama 3 8B on 8 and 64 H100, 70B on 64 and 512, 405B on 2,048; the global batches below), the
planner searches every layout twice on the same H100 preset: once as this codebase runs (`Cluster`'s defaults:
its overlaps as they are now) and once for a runtime with Megatron-Core's overlaps (``tp_comm_overlap``,
``grad_reduce_overlap_pp``, ``param_gather_overlap`` all on), and compares the best MFU of each. The same search as
the codebase before this change (``param_gather_overlap`` off: ZeRO 1-2 gathered the updated parameters in the
optimizer step) is the third column. Goal: this codebase's best >= 0.99x the overlapped runtime's on every workload.
These are the planner's predictions (`benchmarks/PLANNER.md` says how close they come to published runs).

``--cpu`` also measures on this machine (gloo, one thread per rank, the reference GPT, AdamW), each layout in a
fresh process group, every pair in the same run: ZeRO-1 against ZeRO-0 at dp2 (goal: <= 1.05x ZeRO-0's step), ZeRO-1
with its parameter gathers under the next forward against the same run gathering in the step,
dp2 x pp2 (ZeRO-1, 1F1B) with each stage's buckets reduced during its last backward against the same run reducing
them after the schedule (`GradientSync.reduce_during_last_backward`; goal: faster), tp2 (no sequence parallelism)
with the sum of each unit's column layers' input gradients all-reduced once under their weight gradients' GEMMs
(`lightning_hybrid.parallel.tensor_parallel.unit_backward`) against the same run all-reducing each layer's after the
layer's backward (`ColumnParallelLinear.overlap_backward`; goal: faster), and tp2 with sequence parallelism
with each unit's input gradient reduce-scattered under its column layers' weight-gradient GEMMs and each row layer's
output gradient all-gathered under this rank's part of its input gradient
(`lightning_hybrid.parallel.tensor_parallel.unit_backward`) against the same run reducing after the layers' backward
(goal: faster); each run's peak of live tensor bytes in its first step beside. Step time: the slower rank's
``on_train_batch_start -> end``, the median over the timed steps after two warm-up steps; ``--rounds`` rounds, each
running every layout once (every other round in reverse order), a pair's ratio taken within each round and its median
over the rounds reported (the machine is shared: its load drifts between rounds more than within one).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402

from benchmarks.bench_memory import StepTimer  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.grad_sync import GradientSync  # noqa: E402
from lightning_hybrid.models import GPTConfig, GPTLightningModule  # noqa: E402
from lightning_hybrid.planner import ModelSpec  # noqa: E402
from lightning_hybrid.planner.cluster import CLUSTER_PRESETS  # noqa: E402
from lightning_hybrid.planner.model import MODEL_PRESETS  # noqa: E402
from lightning_hybrid.planner.search import plan  # noqa: E402
from lightning_hybrid.runs.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

GOAL = 0.99


def _llama(name: str, n_layer: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name, n_layer, hidden, heads, 8, ffn, 128256, 8192, gated_mlp=True, bias=False,
                     learned_positions=False)


#: (model, devices, global batch in sequences of 8,192 tokens): 0.25M-16M tokens per step (Llama 3's 405B: 16M).
WORKLOADS = [
    (_llama("llama3-8b", 32, 4096, 32, 14336), 8, 32),
    (_llama("llama3-8b", 32, 4096, 32, 14336), 64, 256),
    (MODEL_PRESETS["llama3-70b"], 64, 256),
    (MODEL_PRESETS["llama3-70b"], 512, 512),
    (_llama("llama3-405b", 126, 16384, 128, 53248), 2048, 2048),
]
#: What each searched runtime overlaps, on the H100 preset.
RUNTIMES = {
    "this codebase": {},
    "Megatron-Core overlaps": {"tp_comm_overlap": True, "grad_reduce_overlap_pp": True, "param_gather_overlap": True},
    "codebase before (ZeRO 1-2 gathered in the step)": {"param_gather_overlap": False},
    # async_tp=True (CUDA, compiled, sequence parallel): torch's async TP, the forward's collectives overlapped;
    # compiled, ZeRO 1-2 gather in the step and TP's collectives are functional (none under a weight gradient).
    "this codebase with async_tp": {"tp_comm_overlap": True, "tp_overlap_backward": False,
                                    "param_gather_overlap": False, "tp_grad_reduce_overlap": False},
}


#: The CPU runs: name -> (world, HybridStrategy arguments, buckets reduced during the last backward, TP's input
#: gradients all-reduced under the weight gradients' GEMMs).
CPU_RUNS = {
    "dp2 zero0": (2, dict(dp=2, zero_stage=0), True, True),
    "dp2 zero1": (2, dict(dp=2, zero_stage=1), True, True),
    "dp2 zero1, gathered in the step": (2, dict(dp=2, zero_stage=1, overlap_param_gather=False), True, True),
    "dp2xpp2 zero1, reduced after the schedule": (4, dict(dp=2, pp=2, zero_stage=1, micro_batches=4), False, True),
    "dp2xpp2 zero1, reduced during the last backward": (4, dict(dp=2, pp=2, zero_stage=1, micro_batches=4), True,
                                                        True),
    "tp2, input gradients all-reduced after each layer's backward": (2, dict(tp=2), True, False),
    "tp2, input gradients all-reduced once a unit under the weight gradients' GEMMs": (2, dict(tp=2), True, True),
    "tp2 sp, gradients reduced after the layers' backward": (2, dict(tp=2, sequence_parallel=True), True, False),
    "tp2 sp, gradients reduced under the layers' GEMMs": (2, dict(tp=2, sequence_parallel=True), True, True),
}
#: (run, the run it is compared with, what the goal is, goal met when the ratio is below: None for no goal).
CPU_PAIRS = [
    ("dp2 zero1", "dp2 zero0", "ZeRO-1 dp2 step / ZeRO-0 dp2 step", 1.05),
    ("dp2 zero1", "dp2 zero1, gathered in the step",
     "ZeRO-1 dp2 step, gathered under the next forward / in the step", None),
    ("dp2xpp2 zero1, reduced during the last backward", "dp2xpp2 zero1, reduced after the schedule",
     "dp2xpp2 ZeRO-1 step, reduced during the last backward / after the schedule", 1.0),
    ("tp2, input gradients all-reduced once a unit under the weight gradients' GEMMs",
     "tp2, input gradients all-reduced after each layer's backward",
     "tp2 step, input gradients all-reduced once a unit under the weight gradients' GEMMs / after each layer's"
     " backward", 1.0),
    ("tp2 sp, gradients reduced under the layers' GEMMs", "tp2 sp, gradients reduced after the layers' backward",
     "tp2 SP step, the units' reduce-scatters and the row layers' all-gathers under GEMMs / after the backward", 1.0),
]
CPU_MODEL = dict(n_layer=8, n_embd=256, n_head=8, block_size=128, mlp="swiglu")


def _cpu_worker(kwargs: dict, during: bool, tp_overlap: bool, steps: int) -> tuple[list[float], int]:
    import logging
    import warnings

    import torch

    from lightning_hybrid.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    GradientSync.reduce_during_last_backward = during  # this process's runs only
    ColumnParallelLinear.overlap_backward = RowParallelLinear.overlap_backward = tp_overlap
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=GPTConfig(**CPU_MODEL), lr=1e-3)
    data = ByteCorpusDataModule(max_bytes=400_000, block_size=CPU_MODEL["block_size"], batch_size=8)
    timer = StepTimer(2)
    peak = PeakMemoryMonitor(steps=1)  # the first (warm-up) step's: the tracker's Python time stays out of the timing
    trainer = L.Trainer(accelerator="cpu", devices=len_world(kwargs), strategy=HybridStrategy(**kwargs),
                        max_steps=2 + steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[peak, timer])
    trainer.fit(module, data)
    return timer.times, peak.peak.total


def len_world(kwargs: dict) -> int:
    return kwargs.get("dp", 1) * kwargs.get("pp", 1) * kwargs.get("tp", 1)


def cpu_rows(steps: int, rounds: int) -> tuple[list[str], list[str]]:
    """Per run the median step time over the rounds (each round's: the median over its timed steps of the slower
    rank's), then per pair the median over the rounds of the ratio within a round and whether it meets its goal."""
    import statistics

    times: dict[str, list[float]] = {name: [] for name in CPU_RUNS}
    peaks: dict[str, int] = {}
    for round_ in range(rounds):  # every run once a round, every other round in reverse order
        for name in CPU_RUNS if round_ % 2 == 0 else reversed(CPU_RUNS):
            world, kwargs, during, tp_overlap = CPU_RUNS[name]
            ranks = run_distributed(_cpu_worker, world, kwargs, during, tp_overlap, steps)
            times[name].append(statistics.median(max(step) for step in zip(*(r[0] for r in ranks))))
            peaks[name] = max(r[1] for r in ranks)
            print(f"round {round_ + 1}, {name}: {times[name][-1]:.3f} s", flush=True)
    rows = [f"| {name} | {statistics.median(t):.3f} | {' '.join(f'{x:.3f}' for x in t)} |"
            f" {peaks[name] / 2**20:.1f} |" for name, t in times.items()]
    goals = []
    for run, base, what, goal in CPU_PAIRS:
        ratios = [a / b for a, b in zip(times[run], times[base])]
        ratio = statistics.median(ratios)
        verdict = "no goal" if goal is None else f"goal < {goal:g}: {'met' if ratio < goal else 'NOT MET'}"
        goals.append(f"- {what} = {ratio:.3f}, the median of the rounds' {' '.join(f'{r:.3f}' for r in ratios)}"
                     f" ({verdict})")
    return rows, goals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "OVERLAP.md"))
    p.add_argument("--cpu", action="store_true", help="also measure the CPU runs (CPU_RUNS)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per CPU run (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=4, help="CPU rounds: every run once a round")
    args = p.parse_args(argv)
    rows, met, met_async = [], True, True
    for model, devices, batch in WORKLOADS:
        best = {}
        for name, flags in RUNTIMES.items():
            cluster = dataclasses.replace(CLUSTER_PRESETS["h100"], **flags)
            start = time.perf_counter()
            result = plan(model, cluster, devices, batch)
            best[name] = (result.best, time.perf_counter() - start)
        ours, theirs, before, asynchronous = (best[n][0] for n in RUNTIMES)
        ratio, ratio_before = ours.mfu / theirs.mfu, before.mfu / theirs.mfu
        ratio_async = asynchronous.mfu / theirs.mfu
        met = met and ratio >= GOAL
        met_async = met_async and ratio_async >= GOAL
        rows.append(f"| {model.name} | {devices} | {batch} | {ours.layout.label()} | {ours.mfu:.3f} |"
                    f" {theirs.layout.label()} | {theirs.mfu:.3f} | **{ratio:.3f}** | {ratio_before:.3f} |"
                    f" {asynchronous.layout.label()} | {asynchronous.mfu:.3f} | **{ratio_async:.3f}** |"
                    f" {sum(t for _, t in best.values()):.1f} |")
        print(rows[-1], flush=True)
    lines = [
        "# Communication overlap: this codebase against Megatron-Core's overlaps, as the planner predicts",
        "",
        f"Written by `python benchmarks/bench_overlap.py` on {time.strftime('%Y-%m-%d %H:%M')}. Rerun it to refresh"
        " this file; nothing here is edited by hand.",
        "",
        "Each workload searched over every layout on the `h100` preset four times: as this codebase runs by default,"
        " as a runtime with Megatron-Core's overlaps (TP collectives under the GEMMs in every pass, ZeRO 1-2's"
        " parameter all-gather under the next forward, gradient buckets reduced during each pipeline stage's last"
        " backward), as the codebase ran before ZeRO 1-2 gathered the updated parameters under the next forward"
        " (`overlap_param_gather`; 'ratio before'), and as"
        " this codebase with `async_tp=True` (CUDA, compiled, sequence parallel: torch's async TP, the forward's TP"
        " collectives under the forward's GEMMs -- the model that matches torchtitan's published async TP pairs,"
        " `benchmarks/PLANNER.md`). bf16-mixed, sequences of 8,192 tokens.",
        "",
        "| model | H100 | global batch | this codebase's best layout | MFU | overlapped runtime's best layout | MFU |"
        " ratio | ratio before | with async_tp: best layout | MFU | ratio | search s |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|",
        *rows,
        "",
        f"- this codebase's best MFU / the overlapped runtime's >= {GOAL} on every workload:"
        f" {'met' if met else 'NOT MET'}; with async_tp: {'met' if met_async else 'NOT MET'}",
        "",
    ]
    if args.cpu:
        import os
        import platform

        import torch

        measured, goals = cpu_rows(args.steps, args.rounds)
        lines += [
            "## Measured on this machine (`--cpu`)",
            "",
            f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, one thread per rank;"
            f" GPT {CPU_MODEL}, AdamW, batch 8 per data-parallel rank, {args.steps} timed steps after"
            f" 2 warm-up, each run in a process group of its own; {args.rounds} rounds, every run once a round (every"
            " other round in reverse order), each compared with its pair within a round; the machine is shared (a run"
            " can be twice as slow as the last one).",
            "",
            "| run | step s (median over the rounds; a round's: the median step of the slower rank) | each round |"
            " peak MiB (live tensors, the first step, the highest rank) |",
            "|---|---:|---|---:|",
            *measured,
            "",
            *goals,
            "",
        ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
