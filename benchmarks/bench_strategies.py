"""Throughput of `HybridStrategy` against Lightning's own strategies, on CPU, 2 processes.

    python benchmarks/bench_strategies.py [--steps 20 --warmup 5 --repeats 3 --global-batch 8 ...]

Two comparisons, same model (a small SwiGLU GPT), same global batch, same number of steps:

  (a) data parallel:   HybridStrategy(dp=2)  vs  lightning DDPStrategy            (2 ranks)
  (b) tensor parallel: HybridStrategy(tp=2)  vs  lightning ModelParallelStrategy  (data_parallel_size=1,
      tensor_parallel_size=2) with a hand-written DTensor plan (`parallelize_module`: ColwiseParallel for
      q/k/v_proj and gate/up_proj (or fc1), RowwiseParallel for o_proj and down_proj (or fc2) of every block;
      embeddings, lm_head and LayerNorms stay replicated in that baseline).

Each configuration is a separate 2-process run (spawned like torchrun, one thread per rank; see
`lightning_hybrid.testing.run_distributed`). Repetitions are interleaved (A B, B A, A B, ...) and the median per
configuration is reported with the spread over repetitions. Because a 2-core machine is easily disturbed,
each run also measures how many CPUs *other* processes kept busy meanwhile (/proc/stat minus this run's
own CPU time); a repeat whose hybrid or baseline run was above ``--max-other-load`` is left out of both
medians of that comparison (unless every repeat was disturbed), and the per-step process CPU time is
reported as a contention-robust second view. A callback timestamps every training batch
(`time.perf_counter`) at on_train_batch_start, on_before_backward, on_after_backward,
on_before_optimizer_step and on_train_batch_end; the first ``--warmup`` steps are dropped.

step time  = on_train_batch_start -> on_train_batch_end (forward, backward, gradient reduction, optimizer
             step; not the data loading between batches), the slower rank per step, averaged over steps
tokens/s   = global tokens per step (global batch * block_size) / mean step time
ratio      = hybrid tokens/s / baseline tokens/s (goals: >= 0.97 for (a), >= 1.0 for (b))
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine_load import cpu_s, system_busy_s  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.models import GPT, GPTConfig, GPTLightningModule  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

WORLD_SIZE = 2
VAL_FRACTION = 0.05  # ByteCorpusDataModule's default hold-out
PHASES = ("fwd", "bwd", "post_bwd", "opt")  # see StepTimer
GOALS = {"a": 0.97, "b": 1.0}


# ---------------------------------------------------------------------------------------------- baseline TP
class DTensorTPGPT(GPTLightningModule):
    """The ModelParallelStrategy baseline: the reference GPT with a hand-written DTensor TP plan.

    Per block: ColwiseParallel for q/k/v_proj and gate/up_proj (fc1), RowwiseParallel for o_proj and
    down_proj (fc2). Embeddings, LayerNorms and lm_head are left replicated (plain tensors).
    """

    def configure_model(self) -> None:
        if self.model is not None and getattr(self, "_tp_applied", False):
            return
        super().configure_model()
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        for block in self.model.blocks:
            plan: dict[str, Any] = {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(),
            }
            if hasattr(block.mlp, "gate_proj"):
                plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                             "mlp.down_proj": RowwiseParallel()})
            else:
                plan.update({"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
            parallelize_module(block, tp_mesh, plan)
        self._tp_applied = True

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by the global norm (only with ``--clip``). Lightning's default (``clip_grad_norm_`` over all
        gradients at once) fails on this model's mix of DTensor and plain-tensor gradients."""
        if not gradient_clip_val:
            return
        from torch.distributed.tensor import DTensor
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        params = [p for p in self.parameters() if p.grad is not None]
        groups = [[p for p in params if isinstance(p.grad, DTensor) is dt] for dt in (True, False)]
        norms = [get_total_norm([p.grad for p in group]) for group in groups if group]
        total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
        for group in groups:
            if group:  # takes parameters (scales their .grad)
                clip_grads_with_norm_(group, float(gradient_clip_val), total)


# ---------------------------------------------------------------------------------------------- timing
class StepTimer(L.Callback):
    """perf_counter timestamps per training batch.

    fwd      = batch start -> on_before_backward   (training_step incl. the synced self.log, zero_grad)
    bwd      = on_before_backward -> on_after_backward  (autograd; DDP's overlapped all-reduce is inside)
    post_bwd = on_after_backward -> on_before_optimizer_step  (Strategy.post_backward: Hybrid's DP all-reduce)
    opt      = on_before_optimizer_step -> batch end  (gradient clipping if any, optimizer.step)
    """

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self.cpu: list[float] = []  # process CPU seconds (all threads) per batch
        self._cur: list[float] = []
        self._cpu0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cpu0 = time.process_time()
        self._cur = [time.perf_counter()]

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._cur.append(time.perf_counter())

    def on_after_backward(self, trainer, pl_module) -> None:
        self._cur.append(time.perf_counter())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._cur.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._cur.append(time.perf_counter())
        cpu = time.process_time() - self._cpu0
        if len(self._cur) == 5:
            self.rows.append(self._cur)
            self.cpu.append(cpu)


# ---------------------------------------------------------------------------------------------- one run
CONFIGS = {
    # name: (comparison, role, label)
    "hybrid_dp2": ("a", "hybrid", "HybridStrategy(dp=2)"),
    "ddp": ("a", "baseline", "DDPStrategy"),
    "hybrid_tp2": ("b", "hybrid", "HybridStrategy(tp=2)"),
    "modelparallel_tp2": ("b", "baseline", "ModelParallelStrategy(1x2)+DTensor"),
}
DP_OF = {"hybrid_dp2": 2, "ddp": 2, "hybrid_tp2": 1, "modelparallel_tp2": 1}


def _make_strategy(name: str):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if name == "hybrid_dp2":
        return HybridStrategy(dp=2)
    if name == "ddp":
        return DDPStrategy()
    if name == "hybrid_tp2":
        return HybridStrategy(tp=2)
    if name == "modelparallel_tp2":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    raise ValueError(name)


def bench_worker(name: str, cfg: dict) -> dict:
    """Runs in each spawned rank: one fit, returns the per-step timestamps and the peak RSS."""
    warnings.filterwarnings("ignore")
    for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(logger_name).setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    dp = DP_OF[name]
    module_cls = DTensorTPGPT if name == "modelparallel_tp2" else GPTLightningModule
    module = module_cls(config=GPTConfig(**cfg["model"]), lr=1e-3)
    data = ByteCorpusDataModule(
        max_bytes=cfg["max_bytes"], block_size=cfg["model"]["block_size"], batch_size=cfg["global_batch"] // dp
    )
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=_make_strategy(name),
        max_steps=cfg["warmup"] + cfg["steps"],
        gradient_clip_val=cfg["clip"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.fit(module, data)
    fit_s = time.perf_counter() - t0
    loss = trainer.callback_metrics.get("train_loss")
    return {
        "rows": timer.rows,
        "cpu": timer.cpu,
        "fit_s": fit_s,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # Linux: KiB
        "proc_cpu_s": cpu_s(resource.RUSAGE_SELF),
        "loss": float(loss) if loss is not None else float("nan"),
        "threads": torch.get_num_threads(),
        "local_params": sum(getattr(p, "_local_tensor", p).numel() for p in module.parameters()),  # DTensor: local
    }


def _wait_idle(timeout_s: float, max_load: float, window_s: float = 2.0) -> float:
    """Wait until the machine's busy CPUs over ``window_s`` drop to ``max_load`` (or ``timeout_s``); return the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        b0, own0 = system_busy_s(), cpu_s(resource.RUSAGE_SELF)
        time.sleep(window_s)
        b1, own1 = system_busy_s(), cpu_s(resource.RUSAGE_SELF)
        if b0 is None or b1 is None or (b1 - b0 - (own1 - own0)) / window_s <= max_load:
            break
    return time.perf_counter() - t0 if timeout_s > 0 else 0.0


def summarize_run(ranks: list[dict], warmup: int) -> dict:
    """Per step: the slower rank's duration (and phases); mean over the steps after warmup."""
    n = min(len(r["rows"]) for r in ranks)
    steps = range(warmup, n)
    if not steps:
        raise RuntimeError(f"no steady-state step recorded ({n} steps, warmup {warmup})")
    step_times, phases = [], {p: [] for p in PHASES}
    for i in steps:
        rows = [r["rows"][i] for r in ranks]
        step_times.append(max(row[4] - row[0] for row in rows))
        for k, p in enumerate(PHASES):
            phases[p].append(max(row[k + 1] - row[k] for row in rows))
    return {
        "step_s": statistics.fmean(step_times),
        "cpu_s": [statistics.fmean(r["cpu"][warmup:n]) for r in ranks],
        "step_s_median": statistics.median(step_times),
        "phases": {p: statistics.fmean(v) for p, v in phases.items()},
        "rss_mib": [r["rss_mib"] for r in ranks],
        "loss": ranks[0]["loss"],
        "fit_s": max(r["fit_s"] for r in ranks),
        "n_steady": len(step_times),
        "threads": ranks[0]["threads"],
        "local_params": [r["local_params"] for r in ranks],
    }


# ---------------------------------------------------------------------------------------------- driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run (after warmup)")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped from the measurement")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of each configuration")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all DP ranks")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--mlp", choices=("swiglu", "gelu"), default="swiglu")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val for every run (default: no clipping)")
    p.add_argument("--only", choices=("a", "b", "ab"), default="ab", help="which comparison(s) to run")
    p.add_argument("--max-other-load", type=float, default=0.25,
                   help="a repeat (hybrid run + baseline run) during which other processes kept more CPUs than this"
                        " busy is left out of the medians (unless every repeat was disturbed)")
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="before each run, wait up to this many seconds for other processes to use less than"
                        " --max-other-load CPUs (for shared machines; default: do not wait)")
    args = p.parse_args(argv)
    if args.global_batch % 2:
        p.error("--global-batch must be even (split over dp=2)")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps >= 1, --warmup >= 0, --repeats >= 1")
    return args


def _hybrid_plan_summary(model: dict) -> str:
    """What HybridStrategy(tp=2, tp_plan="auto") splits in this model (resolved without processes)."""
    try:
        from lightning_hybrid.parallel.tensor_parallel import resolve_tp_plan

        module = GPTLightningModule(config=GPTConfig(**model))
        module.configure_model()
        plan = resolve_tp_plan(module, 2, "auto")
        in_blocks = [n for n in plan.layers if ".blocks." in n]
        others = [f"{n} ({p.style}{', gathered' if p.gather_output else ''})" for n, p in plan.layers.items()
                  if ".blocks." not in n]
        return f"{len(in_blocks)} block projections split" + (f", plus {', '.join(others)}" if others else "")
    except Exception as err:  # informational only
        return f"(plan not resolved: {err!r})"


def _spread(values: list[float]) -> float:
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    model = dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, mlp=args.mlp, dropout=0.0)
    GPTConfig(**model)  # validate early
    total_steps = args.warmup + args.steps
    samples = total_steps * args.global_batch + 2  # one epoch covers every step: no epoch boundary inside
    max_bytes = int((samples * args.block_size + 1) / (1 - VAL_FRACTION)) + 4 * args.block_size
    cfg = dict(model=model, global_batch=args.global_batch, steps=args.steps, warmup=args.warmup,
               max_bytes=max_bytes, clip=args.clip)
    tokens_per_step = args.global_batch * args.block_size
    n_params = GPT(GPTConfig(**model)).num_parameters()

    pairs = [c for c in ("a", "b") if c in args.only]
    order = []  # interleaved; the hybrid goes first in even repeats and second in odd ones (A B, B A, ...)
    for rep in range(args.repeats):
        for c in pairs:
            pair = [name for name in CONFIGS if CONFIGS[name][0] == c]
            order += pair if rep % 2 == 0 else pair[::-1]
    print(f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} block_size={args.block_size}"
          f" mlp={args.mlp} ({n_params / 1e6:.2f}M params); global batch {args.global_batch} x {args.block_size}"
          f" = {tokens_per_step} tokens/step; {args.warmup} warmup + {args.steps} measured steps;"
          f" clip={args.clip}; {args.repeats} interleaved repeats; torch {torch.__version__},"
          f" lightning {L.__version__}, {os.cpu_count()} CPUs", flush=True)
    print(f"run order: {', '.join(order)}", flush=True)

    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    t_start = time.perf_counter()
    for i, name in enumerate(order):
        waited = _wait_idle(args.wait_idle, args.max_other_load)
        if waited > 3:
            print(f"  (waited {waited:.0f}s for the machine to go idle)", flush=True)
        busy0, own0, t0 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN), time.perf_counter()
        ranks = run_distributed(bench_worker, WORLD_SIZE, name, cfg)
        wall = time.perf_counter() - t0
        # the ranks have been joined (reaped)
        busy1, own1 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        summary = summarize_run(ranks, args.warmup)
        summary["wall_s"] = wall
        # CPUs kept busy by other processes during this run (machine busy time minus this run's own CPU time)
        ours = max(own1 - own0, sum(r["proc_cpu_s"] for r in ranks))
        summary["other_load"] = (max(0.0, (busy1 - busy0 - ours) / wall) if busy0 is not None and busy1 is not None
                                 else float("nan"))
        results[name].append(summary)
        print(f"  [{i + 1}/{len(order)}] {name:<18} step {summary['step_s'] * 1e3:7.1f} ms"
              f"  -> {tokens_per_step / summary['step_s']:8.0f} tok/s   (run {wall:.0f}s, other processes kept"
              f" {summary['other_load']:.2f} CPUs busy, final loss {summary['loss']:.4f})", flush=True)
    total = time.perf_counter() - t_start

    # ------------------------------------------------------------------ table
    # A repeat of a comparison counts when neither of its two runs was disturbed by other processes;
    # if no repeat is clean, all are used (and flagged).
    used_reps: dict[str, list[int]] = {}
    for cmp_ in pairs:
        names = [n for n, c in CONFIGS.items() if c[0] == cmp_]
        clean = [rep for rep in range(args.repeats)
                 if all(not results[n][rep]["other_load"] > args.max_other_load for n in names)]
        used_reps[cmp_] = clean or list(range(args.repeats))
    agg = {}
    for name, all_runs in results.items():
        if not all_runs:
            continue
        reps = used_reps[CONFIGS[name][0]]
        runs = [all_runs[rep] for rep in reps]
        tps = [tokens_per_step / r["step_s"] for r in runs]
        n_clean = sum(not r["other_load"] > args.max_other_load for r in runs)
        agg[name] = {
            "used": f"{len(reps)}/{len(all_runs)}" + ("" if n_clean == len(runs) else " (disturbed)"),
            "tps": statistics.median(tps),
            "best": max(tps),
            "tps_all": tps,
            "spread": _spread(tps),
            "step_ms": statistics.median(r["step_s"] for r in runs) * 1e3,
            "phases": {p: statistics.median(r["phases"][p] for r in runs) * 1e3 for p in PHASES},
            "cpu_ms": [statistics.median(r["cpu_s"][k] for r in runs) * 1e3 for k in range(WORLD_SIZE)],
            "rss": [max(r["rss_mib"][k] for r in runs) for k in range(WORLD_SIZE)],
            "loss": runs[0]["loss"],
            "local_params": runs[0]["local_params"],
            "other_load": max(r["other_load"] for r in runs),
        }

    print()
    print(f"Results: median over the undisturbed repeats (both runs of the pair with other processes <="
          f" {args.max_other_load} CPUs busy; all repeats if none); step time = slower rank per step, mean of"
          f" {args.steps} steps after {args.warmup} warmup")
    print("| cmp | strategy | runs used | tokens/s (median) | best run | spread | step ms | fwd ms | bwd ms |"
          " post_bwd ms | opt ms | CPU ms/step r0/r1 | peak RSS MiB r0/r1 | params/rank | final loss |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (cmp_, _role, label) in CONFIGS.items():
        if name not in agg:
            continue
        a = agg[name]
        ph = a["phases"]
        print(f"| {cmp_} | {label} | {a['used']} | {a['tps']:.0f} | {a['best']:.0f} | {a['spread'] * 100:.0f}% |"
              f" {a['step_ms']:.1f} |"
              f" {ph['fwd']:.1f} | {ph['bwd']:.1f} | {ph['post_bwd']:.1f} | {ph['opt']:.1f} |"
              f" {a['cpu_ms'][0]:.0f} / {a['cpu_ms'][1]:.0f} | {a['rss'][0]:.0f} / {a['rss'][1]:.0f} |"
              f" {a['local_params'][0] / 1e6:.2f}M | {a['loss']:.4f} |")
    print()
    for cmp_ in pairs:
        hyb = next(n for n, c in CONFIGS.items() if c[0] == cmp_ and c[1] == "hybrid")
        base = next(n for n, c in CONFIGS.items() if c[0] == cmp_ and c[1] == "baseline")
        h, b = agg[hyb], agg[base]
        ratio = h["tps"] / b["tps"]
        per_rep = [y["step_s"] / x["step_s"] for x, y in zip(results[hyb], results[base])]
        verdict = "meets" if ratio >= GOALS[cmp_] else "MISSES"
        marked = ", ".join(f"{r:.3f}" + ("" if i in used_reps[cmp_] and "disturbed" not in h["used"] else "*")
                           for i, r in enumerate(per_rep))
        print(f"ratio ({cmp_}) {CONFIGS[hyb][2]} / {CONFIGS[base][2]}: {ratio:.3f} (medians; goal >= {GOALS[cmp_]:.2f}:"
              f" {verdict})  per repeat (all, * = disturbed): {marked};"
              f" best/best: {h['best'] / b['best']:.3f}; CPU-time ratio (baseline/hybrid CPU s per step):"
              f" {sum(b['cpu_ms']) / sum(h['cpu_ms']):.3f}")
    loads = [r["other_load"] for runs in results.values() for r in runs if r["other_load"] == r["other_load"]]
    if loads and max(loads) > 0.25:
        print(f"warning: other processes kept up to {max(loads):.2f} of the {os.cpu_count()} CPUs busy during some runs"
              f" ({sum(x > args.max_other_load for x in loads)} of {len(loads)} runs above {args.max_other_load}):"
              " their wall-clock figures are noisy; see 'runs used', 'best run' and the CPU-time ratio.")
    if "b" in pairs:
        print("note (b): the ModelParallelStrategy baseline splits only the block projections (DTensor"
              " Colwise/Rowwise); the embeddings, LayerNorms and lm_head stay replicated there."
              f" HybridStrategy(tp=2) uses its 'auto' plan: {_hybrid_plan_summary(model)}.")
    print(f"total wall time {total:.0f}s")
    return 0


if __name__ == "__main__":
    from benchmarks.report import printed_to

    with printed_to(REPO_ROOT / "benchmarks" / "STRATEGIES.md",
                    "HybridStrategy against Lightning's strategies (benchmarks/bench_strategies.py)"):
        code = main()
    sys.exit(code)
