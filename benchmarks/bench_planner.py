"""The planner's predictions against measurements on this machine, its search time at 1,024 devices, and its
prediction of published large-scale runs.

    python benchmarks/bench_planner.py [--layouts single,dp2,...] [--n-layer 4 --n-embd 256 --block-size 128]
    python benchmarks/bench_planner.py --quick          # two layouts of a tiny GPT: a smoke run

1. Calibration (``python -m lightning_hybrid.planner calibrate``, < 60 s): this machine's matmul FLOP/s, a
   block's fixed cost, gloo all-reduce latency and bandwidth, the cost of a collective between computation -> a
   cluster JSON (``--cluster-file``).
2. Each layout of the reference GPT (fp32, AdamW, global batch ``--global-batch`` sequences, bucket
   ``--bucket-cap-mb``) runs in a fresh process group (`lightning_hybrid.testing.run_distributed`): peak memory =
   `PeakMemoryMonitor` over the first ``--measure-steps`` steps, max over ranks; step time = the slower rank's
   ``on_train_batch_start -> end``, the fastest of ``--steps`` steps after the measured ones and ``--warmup``
   (the machine is shared: the fastest step is the one least disturbed by other processes), and the fastest
   of two such runs, the second pass in the reverse order of layouts.
3. The first layout (``single``) fits the two constants that are not first principles on this machine: the
   activation bytes measured / predicted (``activation_scale``: the peak minus the predicted model states,
   over the predicted activations) and the training loop's time per step (``step_overhead``: measured minus
   predicted step time); both are written into the cluster JSON, which the planner then uses everywhere.
4. Every layout's predicted peak (`estimate_memory`) and step time (`estimate_time`) beside the measured ones;
   goals: |predicted / measured - 1| <= 15% for the peak, Spearman >= 0.8 for the step times.
5. The search over every layout of GPT-3 175B on 1,024 A100s (timed: goal < 10 s) and the predicted throughput
   of Narayanan et al. 2021's published configurations (Table 1 and GPT-3 175B on 1,024 GPUs), counted as they
   count it (FLOPs with full recomputation, ``96 B s l h^2 (1 + s/6h + V/(16 l h))`` per step).

Tables are printed and written to ``benchmarks/PLANNER.md``; the measured peaks and every timed step of both
passes to ``benchmarks/PLANNER.json`` (to check a change of the time model against them without measuring again).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402

from benchmarks.bench_memory import StepTimer  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.models import GPTConfig, GPTLightningModule  # noqa: E402
from lightning_hybrid.planner import Cluster, Layout, ModelSpec, calibrate, estimate_memory, estimate_time, evaluate  # noqa: E402
from lightning_hybrid.planner import load_cluster, model_spec, plan  # noqa: E402
from lightning_hybrid.sweep import spearman  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

MIB = 2**20
VAL_FRACTION = 0.05
#: name -> (dp, tp, pp, zero stage, micro-batches per replica, schedule, activation checkpointing)
LAYOUTS = {
    "single": (1, 1, 1, 0, 1, "1f1b", False),
    "dp2": (2, 1, 1, 0, 1, "1f1b", False),
    "dp2-zero2": (2, 1, 1, 2, 1, "1f1b", False),
    "dp2-zero3": (2, 1, 1, 3, 1, "1f1b", False),
    "tp2-ac": (1, 2, 1, 0, 1, "1f1b", True),
    "single-ac": (1, 1, 1, 0, 1, "1f1b", True),
    "tp2": (1, 2, 1, 0, 1, "1f1b", False),
    "pp2-1f1b": (1, 1, 2, 0, 4, "1f1b", False),
    "dp2xtp2-zero1": (2, 2, 1, 1, 1, "1f1b", False),
    "dp2xtp2xpp2-zero1": (2, 2, 2, 1, 2, "1f1b", False),
}
#: Narayanan et al. 2021 (Megatron-LM on A100 clusters), Table 1 rows and the GPT-3 175B run of section 5.1:
#: (model preset, GPUs, global batch, tp, pp, published TFLOP/s per GPU)
PUBLISHED = [("gpt-1.7b", 32, 512, 1, 1, 137), ("gpt-18b", 256, 1024, 8, 1, 135), ("gpt-39b", 512, 1536, 8, 2, 138),
             ("gpt-145b", 1536, 2304, 8, 8, 148), ("gpt3-175b", 1024, 1536, 8, 8, 140),
             ("gpt-1t", 3072, 3072, 8, 64, 163)]


def layout_of(name: str, global_batch: int) -> Layout:
    dp, tp, pp, zero, m, schedule, ac = LAYOUTS[name]
    return Layout(dp, tp, pp, zero, global_batch // dp // m, m, schedule, 1, ac)


def worker(layout: Layout, cfg: dict) -> dict:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(name).setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    kwargs = layout.strategy_kwargs()
    strategy = HybridStrategy(bucket_cap_mb=cfg["bucket_cap_mb"], **kwargs)
    module = GPTLightningModule(config=GPTConfig(**cfg["model"]), lr=1e-3)
    batch = layout.micro_batch * (layout.micro_batches if layout.pp > 1 else 1)
    data = ByteCorpusDataModule(max_bytes=cfg["max_bytes"], block_size=cfg["model"]["block_size"], batch_size=batch)
    monitor, timer = PeakMemoryMonitor(steps=cfg["measure_steps"]), StepTimer(cfg["measure_steps"] + cfg["warmup"])
    trainer = L.Trainer(accelerator="cpu", devices=layout.devices, strategy=strategy, limit_val_batches=0,
                        max_steps=cfg["measure_steps"] + cfg["warmup"] + cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor, timer])
    trainer.fit(module, data)
    return {"peak": monitor.peak.total, "breakdown": monitor.peak.breakdown, "times": timer.times}


def measure(layout: Layout, cfg: dict) -> dict:
    t0 = time.perf_counter()
    ranks = run_distributed(worker, layout.devices, layout, cfg)
    n = min(len(r["times"]) for r in ranks)
    top = max(ranks, key=lambda r: r["peak"])
    steps = [max(r["times"][i] for r in ranks) for i in range(n)]
    return {"peak": top["peak"], "breakdown": top["breakdown"], "wall_s": time.perf_counter() - t0,
            "step_s": min(steps), "steps": steps}


def predict(model: ModelSpec, layout: Layout, cluster: Cluster, bucket_cap_mb: float):
    return (estimate_memory(model, layout, cluster.precision, cluster.activation_scale, bucket_cap_mb),
            estimate_time(model, layout, cluster, bucket_cap_mb))


def fit_constants(model: ModelSpec, layout: Layout, measured: dict, cluster: Cluster, bucket_cap_mb: float) -> Cluster:
    """``activation_scale`` and ``step_overhead`` from one measured layout (see the module docstring)."""
    raw = dataclasses.replace(cluster, activation_scale=1.0, step_overhead=0.0)
    mem, step = predict(model, layout, raw, bucket_cap_mb)
    states = mem.total - mem.activations
    return dataclasses.replace(cluster, activation_scale=(measured["peak"] - states) / mem.activations,
                               step_overhead=max(0.0, measured["step_s"] - step.total))


def published_rows() -> list[str]:
    a100 = dataclasses.replace(load_cluster("a100"), precision="megatron")  # fp16 weights + fp32 master (K = 12)
    rows = ["| model | GPUs | batch | layout (tp x pp, micro-batch 1, full recomputation) | published TFLOP/s/GPU |"
            " predicted | predicted / published | planner's best layout (predicted speed-up) |",
            "|---|---:|---:|---|---:|---:|---:|---|"]
    for name, gpus, batch, tp, pp, published in PUBLISHED:
        m = model_spec(name)
        dp = gpus // (tp * pp)
        schedule = "interleaved_1f1b" if pp > 2 else "1f1b"
        layout = Layout(dp, tp, pp, 0, 1, batch // dp, schedule, 2 if pp > 2 else 1, True, False)
        c = evaluate(m, layout, a100, batch)
        # Megatron counts 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step: the forward recomputed.
        h, s, layers, V = m.hidden, m.seq_len, m.n_layer, m.vocab
        megatron_flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
        predicted = megatron_flops / (c.time.total * gpus) / 1e12 if c.time else float("nan")
        best = plan(m, a100, gpus, batch, sequence_parallel=False).best  # Megatron 2021 had no sequence parallelism
        rows.append(f"| {name} | {gpus} | {batch} | {layout.label()} | {published} | {predicted:.0f} |"
                    f" {predicted / published:.2f} | {best.layout.label()}"
                    f" ({best.tokens_per_s / c.tokens_per_s:.2f}x) |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, first = fit (of {list(LAYOUTS)})")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=2.0)
    p.add_argument("--measure-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cluster-file", type=Path, default=Path(__file__).with_name("cluster_cpu.json"))
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("PLANNER.md"))
    p.add_argument("--quick", action="store_true", help="tiny GPT, layouts single and dp2")
    args = p.parse_args(argv)
    if args.quick:
        args.layouts, args.n_layer, args.n_embd, args.n_head, args.block_size = "single,dp2", 1, 32, 4, 32
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    t_start = time.perf_counter()
    model_cfg = dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dropout=0.0)
    model = ModelSpec.from_gpt(model_cfg)
    steps = args.measure_steps + args.warmup + args.steps
    max_bytes = int(((steps * args.global_batch + 2) * args.block_size + 1) / (1 - VAL_FRACTION)) + 4 * args.block_size
    cfg = dict(model=model_cfg, bucket_cap_mb=args.bucket_cap_mb, measure_steps=args.measure_steps,
               warmup=args.warmup, steps=args.steps, max_bytes=max_bytes)

    t0 = time.perf_counter()
    cluster = calibrate(args.cluster_file)
    calibration_s = time.perf_counter() - t0
    calibrated = {k: v for k, v in dataclasses.asdict(cluster).items() if k != "notes"}
    print(f"calibrated in {calibration_s:.0f}s: {json.dumps(calibrated)}", flush=True)

    results = {}
    for i, name in enumerate(names):
        layout = layout_of(name, args.global_batch)
        results[name] = measure(layout, cfg)
        if i == 0:
            # The fit run is timed again at once: the fastest step of both, as for every layout (second pass below).
            results[name]["step_s"] = min(results[name]["step_s"], measure(layout, cfg)["step_s"])
            cluster = fit_constants(model, layout, results[name], cluster, args.bucket_cap_mb)
            args.cluster_file.write_text(cluster.to_json())
            print(f"fitted on {name}: activation_scale={cluster.activation_scale:.3f}"
                  f" step_overhead={cluster.step_overhead * 1e3:.1f} ms -> {args.cluster_file}", flush=True)
        mem, step = predict(model, layout, cluster, args.bucket_cap_mb)
        results[name].update(layout=layout, pred_peak=mem.total, pred_step=step.total, pred_mem=mem, pred_time=step)
        r = results[name]
        print(f"  {name:<20} peak {r['peak'] / MIB:7.1f} MiB (pred {mem.total / MIB:7.1f})  step {r['step_s']:.3f}s"
              f" (pred {step.total:.3f})  run {r['wall_s']:.0f}s", flush=True)

    for name in reversed(names[1:]):  # a second timing pass in the reverse order: load that comes and goes
        results[name]["step_s1"] = results[name]["step_s"]
        again_run = measure(results[name]["layout"], cfg)
        results[name]["step_s2"], results[name]["steps2"] = again_run["step_s"], again_run["steps"]
        results[name]["step_s"] = min(results[name]["step_s"], results[name]["step_s2"])
        print(f"  {name:<20} second pass step {results[name]['step_s2']:.3f}s", flush=True)
    raw = {n: {"peak": results[n]["peak"], "steps": results[n]["steps"], "steps2": results[n].get("steps2")}
           for n in names}
    args.out.with_suffix(".json").write_text(json.dumps({"layouts": raw, "global_batch": args.global_batch,
                                                        "model": model_cfg}, indent=1))
    # How well the measurement orders itself: the two passes' step times, rank-correlated (the noise ceiling).
    again = [n for n in names[1:]]
    self_rho = (spearman([-results[n]["step_s1"] for n in again], [-results[n]["step_s2"] for n in again])
                if len(again) > 2 else float("nan"))

    t0 = time.perf_counter()
    big = plan(model_spec("gpt3-175b"), load_cluster("a100"), 1024, 1536)
    search_s = time.perf_counter() - t0
    tokens = args.global_batch * args.block_size
    rows = ["| layout | measured peak MiB | predicted | pred / meas | measured step s | predicted | measured tokens/s |"
            " predicted | measured rank | planner rank |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    meas_rank = sorted(names, key=lambda n: results[n]["step_s"])
    pred_rank = sorted(names, key=lambda n: results[n]["pred_step"])
    within = 0
    for name in names:
        r = results[name]
        ratio = r["pred_peak"] / r["peak"]
        within += abs(ratio - 1) <= 0.15
        rows.append(f"| {r['layout'].label()}{' (fit)' if name == names[0] else ''} | {r['peak'] / MIB:.1f} |"
                    f" {r['pred_peak'] / MIB:.1f} | {ratio:.2f} | {r['step_s']:.3f} | {r['pred_step']:.3f} |"
                    f" {tokens / r['step_s']:.0f} | {tokens / r['pred_step']:.0f} | {meas_rank.index(name) + 1} |"
                    f" {pred_rank.index(name) + 1} |")
    rho = (spearman([-results[n]["step_s"] for n in names], [-results[n]["pred_step"] for n in names])
           if len(names) > 2 else float("nan"))
    settings = (f"Reference GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}"
                f" block_size={args.block_size}"
                f" (GELU, {model.params:,} parameters), fp32 AdamW, global batch {args.global_batch} sequences,"
                f" bucket_cap_mb={args.bucket_cap_mb:g}; {args.measure_steps} measured + {args.warmup} warm-up +"
                f" {args.steps} timed steps; CPU ({cluster.compute_units} cores, shared), gloo, 1 thread per rank.")
    lines = [settings, "", f"Calibration: {calibration_s:.0f} s; fitted on the first layout: activation_scale ="
             f" {cluster.activation_scale:.3f}, step_overhead = {cluster.step_overhead * 1e3:.1f} ms.", "", *rows, "",
             f"Peak memory within 15%: {within} of {len(names)} layouts. Spearman rank correlation of predicted and"
             f" measured step times: {rho:.2f}; of the two measured passes with each other (layouts 2-{len(names)}):"
             f" {self_rho:.2f}.", "",
             f"Search over every layout of GPT-3 175B on 1,024 A100s (global batch 1536): {search_s:.2f} s,"
             f" {len(big.ranked) + len(big.too_big)} candidates ({len(big.ranked)} fit); best:"
             f" {big.best.layout.label()}, {big.best.tokens_per_s:.4g} tokens/s, MFU {big.best.mfu:.2f}.", "",
             "## Published runs (Narayanan et al. 2021: Megatron-LM on DGX A100 nodes, fp16)", "",
             *published_rows(), "",
             f"Total wall time {time.perf_counter() - t_start:.0f} s."]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    from benchmarks.report import header

    args.out.write_text(header("The planner against measurements (benchmarks/bench_planner.py)") + text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
