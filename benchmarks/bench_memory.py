"""Peak memory per rank and step time of `HybridStrategy` ZeRO 0-3 against Lightning's DDP and FSDP2, on CPU.

    python benchmarks/bench_memory.py [--dps 2 4 --measure-steps 3 --warmup 2 --steps 5 --bucket-cap-mb 4 ...]
    python benchmarks/bench_memory.py --quick        # small model, fewer steps: a smoke run
    python benchmarks/bench_memory.py --quick --dps 2 --only zero0 zero2 --plain-repeats 1 --out /tmp/MEMORY.md

Strategies, each at every ``--dps`` value (world size = dp, gloo, one thread per rank), each run in a fresh
process group (spawned like torchrun, `lightning_hybrid.testing.run_distributed`):

  Lightning DDPStrategy()                                 DDP
  Lightning DDPStrategy(gradient_as_bucket_view=True)     DDP (bucket view)
  Lightning ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=1) with ``fully_shard`` on every
      block and on the whole GPT in ``configure_model`` (FSDP2)
  HybridStrategy(dp=dp, zero_stage=s, bucket_cap_mb=--bucket-cap-mb), s = 0, 1, 2, 3

Same model (a SwiGLU GPT, default 8 layers x 512 wide, block 64), same data (per-rank batch 2), AdamW (fp32).

memory     = `lightning_hybrid.runs.memory.PeakMemoryMonitor` over the first ``--measure-steps`` training steps: the
             peak of live tensor bytes per rank and its breakdown by kind (parameters, gradients, optimizer
             state, activations + temporaries, the rest); a table shows the rank with the highest peak
resident   = each rank's resident-set peak (``VmHWM``, /proc/self/status) over its whole life (setup, fit, every
             step), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS: it sees what the
             tracker cannot, such as the buffers gloo allocates inside a collective; a second table shows it per
             rank and the ratio below on it beside the ratio on live tensors
plain      = the resident-set peak as a user's plain run sees it: Hybrid ZeRO 0-3 again, in a child process with
             glibc's default allocator (no MALLOC_* variable: its mmap threshold rises to up to 32 MiB as large
             blocks are freed, so most tensors come from the heap and what is freed there may stay resident),
             HybridStrategy's default bucket_cap_mb (``--plain-bucket-cap-mb``) and no memory tracker; that heap
             makes it vary from run to run, so each row is run ``--plain-repeats`` times and its median (over the
             runs, of the highest rank) is compared
saved      = peak of Hybrid ZeRO-0 - peak of the row (same dp), on each measure
promised   = what the ZeRO formulas save against stage 0, fp32 AdamW, Psi = parameter count, bytes per rank:
             stage 0: 16 Psi, 1: 4 Psi + 4 Psi + 8 Psi/dp, 2: 4 Psi + 12 Psi/dp, 3: 16 Psi/dp (FSDP2 row: stage 3)
step time  = on_train_batch_start -> on_train_batch_end, the slower rank per step, mean over the ``--steps``
             steps after the measured and ``--warmup`` steps (the memory tracker is off by then: it slows ops)
tokens/s   = dp * batch * block_size / step time

Goals: saved / promised >= 0.9 for ZeRO 1-3 on each measure (the plain run's included); Hybrid ZeRO-0 tokens/s >=
DDP (bucket view) and Hybrid ZeRO-3 tokens/s >= FSDP2 (ratio >= 1.0); peak of ZeRO-0 <= DDP (bucket view) and of
ZeRO-3 <= FSDP2. With dp ranks on fewer cores the step times are of an oversubscribed machine; each run reports how
many CPUs other processes kept busy meanwhile (`benchmarks/machine_load.py`), and a speed ratio with a run above
0.25 is flagged disturbed. The tables are printed and written to benchmarks/MEMORY.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine_load import cpu_s, system_busy_s  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.models import GPT, GPTConfig, GPTLightningModule  # noqa: E402
from lightning_hybrid.parallel.zero import DEFAULT_BUCKET_CAP_MB  # noqa: E402
from lightning_hybrid.runs.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

VAL_FRACTION = 0.05  # ByteCorpusDataModule's default hold-out
MIB = 2**20
RATIO_GOAL = 0.9
# Large allocations mmap'ed, so that a freed tensor leaves the resident set at once (glibc's default threshold
# adapts up to 32 MiB, and memory freed below it stays in the heap, blurring the resident peak).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
PLAIN_STRATEGIES = [f"zero{s}" for s in range(4)]  # the rows measured again as a plain run (glibc's defaults)
MAX_OTHER_LOAD = 0.25  # CPUs busy with other processes above which a run's timing is flagged as disturbed
# name: (label, ZeRO stage whose formula the row is held to)
STRATEGIES = {
    "ddp": ("Lightning DDP", 0),
    "ddp_view": ("Lightning DDP (bucket view)", 0),
    "fsdp2": ("Lightning FSDP2", 3),
    **{f"zero{s}": (f"Hybrid ZeRO-{s}", s) for s in range(4)},
}


class FSDP2GPT(GPTLightningModule):
    """The ModelParallelStrategy baseline: the reference GPT with FSDP2 (``fully_shard``) per block and at the root,
    over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        if getattr(self, "_fsdp_applied", False):
            return
        super().configure_model()
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self._fsdp_applied = True


class StepTimer(L.Callback):
    """perf_counter at the start and end of every training batch from ``first`` on."""

    def __init__(self, first: int) -> None:
        self.first, self.times = first, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.first:
            self.times.append(time.perf_counter() - self._t0)


def _make(name: str, dp: int, bucket_cap_mb: float | None):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if name.startswith("zero"):
        cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}  # None: the strategy's default
        return HybridStrategy(dp=dp, zero_stage=int(name[4:]), **cap), GPTLightningModule
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=1), FSDP2GPT
    return DDPStrategy(gradient_as_bucket_view=name == "ddp_view"), GPTLightningModule


def worker(name: str, dp: int, cfg: dict) -> dict:
    """Runs in each spawned rank: one fit; returns this rank's peak memory and timed step durations (with
    ``cfg["plain"]`` no tracker runs: its peak is ``None``)."""
    warnings.filterwarnings("ignore")
    for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(logger_name).setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    strategy, module_cls = _make(name, dp, cfg["bucket_cap_mb"])
    module = module_cls(config=GPTConfig(**cfg["model"]), lr=1e-3)
    data = ByteCorpusDataModule(max_bytes=cfg["max_bytes"], block_size=cfg["model"]["block_size"],
                                batch_size=cfg["batch"])
    timer = StepTimer(cfg["measure_steps"] + cfg["warmup"])
    monitor = None if cfg.get("plain") else PeakMemoryMonitor(steps=cfg["measure_steps"])
    trainer = L.Trainer(
        accelerator="cpu", devices=dp, strategy=strategy, max_steps=cfg["measure_steps"] + cfg["warmup"] + cfg["steps"],
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer] if monitor is None else [monitor, timer],
    )
    trainer.fit(module, data)
    loss = trainer.callback_metrics.get("train_loss")
    return {"total": monitor.peak.total if monitor else None, "breakdown": monitor.peak.breakdown if monitor else None,
            "times": timer.times,
            "resident": resident_peak(),
            "loss": float(loss) if loss is not None else float("nan"), "proc_cpu_s": cpu_s(resource.RUSAGE_SELF)}


def resident_peak() -> int:
    """This process's resident-set peak in bytes (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_one(name: str, dp: int, cfg: dict) -> dict:
    """One strategy at one dp in a fresh process group; a failure becomes ``{"error": last traceback line}``."""
    busy0, own0, t0 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        ranks = run_distributed(worker, dp, name, dp, cfg)
    except Exception as err:  # noqa: BLE001  (reported in the table)
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else repr(err))[:200], "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    busy1, own1 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    ours = max(own1 - own0, sum(r["proc_cpu_s"] for r in ranks))
    top = max(ranks, key=lambda r: r["total"] or 0)
    n = min(len(r["times"]) for r in ranks)
    return {
        "peaks": [r["total"] for r in ranks], "total": top["total"], "breakdown": top["breakdown"],
        "residents": [r["resident"] for r in ranks], "resident": max(r["resident"] for r in ranks),
        "step_s": statistics.fmean(max(r["times"][i] for r in ranks) for i in range(n)) if n else float("nan"),
        "loss": ranks[0]["loss"], "wall_s": wall,
        "other_load": max(0.0, (busy1 - busy0 - ours) / wall) if None not in (busy0, busy1) else float("nan"),
    }


def plain_pass(dps: list[int], names: list[str], cfg: dict, repeats: int) -> dict:
    """The plain runs (`PLAIN_STRATEGIES` among ``names``, each dp, ``repeats`` times) in a child process whose
    environment has no MALLOC_* variable: glibc reads them when a process starts, and the ranks are forked from a
    fork server that inherited this process's (`MALLOC_ENV`). Returns ``{dp: {name: [run_one result, ...]}}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"dps": dps, "names": names, "cfg": cfg, "repeats": repeats}))
        subprocess.run([sys.executable, __file__, "--plain-pass", str(spec), str(out)], env=env, check=True)
        return {int(dp): rows for dp, rows in json.loads(out.read_text()).items()}


def _plain_child(spec_path: str, out_path: str) -> int:
    """`plain_pass`'s child: run the rows it lists and write their results as JSON."""
    assert not any(k.startswith("MALLOC_") for k in os.environ), "the plain pass runs with glibc's defaults"
    spec = json.loads(Path(spec_path).read_text())
    cfg = dict(spec["cfg"], plain=True)
    results: dict[int, dict] = {}
    for dp in spec["dps"]:
        results[dp] = {}
        for name in spec["names"]:
            runs = results[dp][name] = [run_one(name, dp, cfg) for _ in range(spec["repeats"])]
            line = "  ".join(f"failed: {r['error']}" if "error" in r else
                             "/".join(f"{x / MIB:.1f}" for x in r["residents"]) for r in runs)
            print(f"  dp={dp} {STRATEGIES[name][0]:<28} plain resident/rank MiB, per run: {line}", flush=True)
    Path(out_path).write_text(json.dumps(results))
    return 0


def plain_summary(runs: list[dict]) -> dict:
    """One row of the plain runs: the median run by its highest rank's peak (of an even count the lower middle
    one) and the range of that peak over the runs; the first failure if every run failed."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["resident"])
    if not ok:
        return runs[0]
    median = ok[(len(ok) - 1) // 2]
    return {"resident": median["resident"], "residents": median["residents"], "low": ok[0]["resident"],
            "high": ok[-1]["resident"], "runs": len(ok)}


def formula(stage: int, psi: int, dp: int) -> float:
    """Bytes per rank of fp32 params + grads + AdamW state under ZeRO ``stage``."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / dp, 2: 4 * psi + 12 * psi / dp, 3: 16 * psi / dp}[stage]


def report(dp: int, res: dict, psi: int, tokens: int, plain: dict | None = None,
           plain_cap: float = DEFAULT_BUCKET_CAP_MB) -> list[str]:
    """The markdown tables of one dp (live tensors, resident set, and with ``plain`` -- `plain_summary` rows --
    the plain run's resident set) and its goal lines."""
    plain = plain or {}

    def ok(name: str, rows: dict | None = None) -> bool:
        """Whether ``rows`` (``res``, or the plain rows) has a result for ``name``."""
        rows = res if rows is None else rows
        return name in rows and "error" not in rows[name]

    def saving(name: str, measure: str, rows: dict | None = None) -> tuple[float, float, str]:
        """(saved MiB against Hybrid ZeRO-0, promised MiB, saved / promised) on ``measure`` (total, resident) of
        ``rows`` (``res``, or the plain rows)."""
        rows = res if rows is None else rows
        stage = STRATEGIES[name][1]
        promised = (formula(0, psi, dp) - formula(stage, psi, dp)) / MIB
        saved = (rows["zero0"][measure] - rows[name][measure]) / MIB if ok("zero0", rows) else float("nan")
        return saved, promised, f"{saved / promised:.3f}" if promised else "-"

    out = [f"### dp = {dp}", "",
           "| strategy | peak MiB | params | grads | optim | act+temp | rest | saved vs Hybrid ZeRO-0"
           " | ZeRO formula promises | ratio | step s | tokens/s | other load |", "|---|" + "---:|" * 12]
    resident = ["Resident set (VmHWM, MiB):", "",
                "| strategy | peak per rank | peak | saved vs Hybrid ZeRO-0 | ZeRO formula promises | ratio"
                " | live-tensor ratio |", "|---|" + "---:|" * 6]
    for name, (label, _stage) in STRATEGIES.items():
        r = res.get(name)
        if r is None:
            continue
        if "error" in r:
            out.append(f"| {label} | failed: {r['error'].replace('|', '/')} |" + " |" * 11)
            continue
        b = {k: v / MIB for k, v in r["breakdown"].items()}
        act = b["activations"] + b["temporary"]
        rest = r["total"] / MIB - b["parameters"] - b["gradients"] - b["optimizer_state"] - act
        saved, promised, ratio = saving(name, "total")
        out.append(f"| {label} | {r['total'] / MIB:.1f} | {b['parameters']:.1f} | {b['gradients']:.1f}"
                   f" | {b['optimizer_state']:.1f} | {act:.1f} | {rest:.1f} | {saved:.1f} | {promised:.1f} | {ratio}"
                   f" | {r['step_s']:.3f}"
                   f" | {tokens / r['step_s']:.0f} | {r['other_load']:.2f} |")
        rss_saved, _, rss_ratio = saving(name, "resident")
        resident.append(f"| {label} | {' / '.join(f'{x / MIB:.1f}' for x in r['residents'])}"
                        f" | {r['resident'] / MIB:.1f} | {rss_saved:.1f} | {promised:.1f} | {rss_ratio} | {ratio} |")
    out += [""] + resident + [""]
    if plain:
        runs = max(r.get("runs", 0) for r in plain.values())
        out += [f"Resident set of a plain run (VmHWM, MiB): glibc's default allocator (no MALLOC_* variable),"
                f" HybridStrategy's default bucket_cap_mb={plain_cap:g}, no memory tracker; the median of {runs}"
                f" runs (of each run's highest rank), their range beside it:", "",
                "| strategy | peak per rank (median run) | peak | range over runs | saved vs Hybrid ZeRO-0"
                " | ZeRO formula promises | ratio |", "|---|" + "---:|" * 6]
        for name in PLAIN_STRATEGIES:
            r = plain.get(name)
            if r is None:
                continue
            label = STRATEGIES[name][0]
            if "error" in r:
                out.append(f"| {label} | failed: {r['error'].replace('|', '/')} |" + " |" * 5)
                continue
            saved, promised, ratio = saving(name, "resident", plain)
            out.append(f"| {label} | {' / '.join(f'{x / MIB:.1f}' for x in r['residents'])}"
                       f" | {r['resident'] / MIB:.1f} | {r['low'] / MIB:.1f} - {r['high'] / MIB:.1f}"
                       f" | {saved:.1f} | {promised:.1f} | {ratio} |")
        out.append("")
    verdict = lambda good: "met" if good else "NOT MET"  # noqa: E731
    for s in (1, 2, 3):
        if ok(f"zero{s}") and ok("zero0"):
            for measure, what in (("total", "live tensors"), ("resident", "resident set")):
                saved, promised, _ = saving(f"zero{s}", measure)
                out.append(f"- ZeRO-{s} saved / promised, {what} = {saved / promised:.3f} (goal >= {RATIO_GOAL}):"
                           f" {verdict(saved / promised >= RATIO_GOAL)}")
        if ok(f"zero{s}", plain) and ok("zero0", plain):
            saved, promised, _ = saving(f"zero{s}", "resident", plain)
            out.append(f"- ZeRO-{s} saved / promised, resident set of a plain run (glibc defaults, median) ="
                       f" {saved / promised:.3f} (goal >= {RATIO_GOAL}): {verdict(saved / promised >= RATIO_GOAL)}")
    for hyb, lit in (("zero0", "ddp_view"), ("zero3", "fsdp2")):
        h, l_ = STRATEGIES[hyb][0], STRATEGIES[lit][0]
        if not (ok(hyb) and ok(lit)):
            out.append(f"- {h} vs {l_}: not compared (a run failed or was not run)")
            continue
        speed = res[lit]["step_s"] / res[hyb]["step_s"]
        mem_h, mem_l = res[hyb]["total"] / MIB, res[lit]["total"] / MIB
        load = max(res[hyb]["other_load"], res[lit]["other_load"])
        flag = f" (disturbed: other processes kept up to {load:.2f} CPUs busy)" if load > MAX_OTHER_LOAD else ""
        out.append(f"- {h} tokens/s / {l_} tokens/s = {speed:.3f} (goal >= 1.0): {verdict(speed >= 1.0)}{flag}")
        out.append(f"- {h} peak {mem_h:.1f} MiB vs {l_} peak {mem_l:.1f} MiB (goal <=): {verdict(mem_h <= mem_l)}")
    return out + [""]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dps", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (= world sizes)")
    p.add_argument("--measure-steps", type=int, default=3, help="first steps, measured by PeakMemoryMonitor")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the measured ones")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after measure-steps + warmup)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0, help="HybridStrategy(bucket_cap_mb=...)")
    p.add_argument("--only", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES), help="strategies to run")
    p.add_argument("--quick", action="store_true", help="smoke run: n_layer 4, n_embd 256, 2 + 1 + 2 steps")
    p.add_argument("--plain-repeats", type=int, default=3,
                   help="runs of each Hybrid row as a plain run (glibc's default allocator); 0: none")
    p.add_argument("--plain-bucket-cap-mb", type=float, default=None,
                   help=f"bucket_cap_mb of the plain runs (default: HybridStrategy's, {DEFAULT_BUCKET_CAP_MB:g})")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "MEMORY.md",
                   help="results file (overwritten)")
    p.add_argument("--plain-pass", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)  # `plain_pass`'s child
    args = p.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.measure_steps, args.warmup, args.steps = 4, 256, 2, 1, 2
    if min(args.dps) < 1 or args.measure_steps < 1 or args.warmup < 0 or args.steps < 1 or args.plain_repeats < 0:
        p.error("--dps >= 1, --measure-steps >= 1, --warmup >= 0, --steps >= 1, --plain-repeats >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plain_pass:
        return _plain_child(*args.plain_pass)
    model = dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, mlp="swiglu", dropout=0.0)
    psi = GPT(GPTConfig(**model)).num_parameters()
    total_steps = args.measure_steps + args.warmup + args.steps
    samples = total_steps * args.batch * max(args.dps) + 2  # one epoch covers every step at the largest dp
    max_bytes = int((samples * args.block_size + 1) / (1 - VAL_FRACTION)) + 4 * args.block_size
    cfg = dict(model=model, batch=args.batch, measure_steps=args.measure_steps, warmup=args.warmup, steps=args.steps,
               bucket_cap_mb=args.bucket_cap_mb, max_bytes=max_bytes)
    settings = (f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}"
                f" block_size={args.block_size} swiglu, Psi = {psi:,} parameters ({4 * psi / MIB:.1f} MiB fp32);"
                f" per-rank batch {args.batch};"
                f" AdamW fp32; {args.measure_steps} measured + {args.warmup} warm-up + {args.steps} timed steps;"
                f" Hybrid bucket_cap_mb={args.bucket_cap_mb:g}; CPU, gloo, 1 thread per rank;"
                f" torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs")
    plain_names = [n for n in args.only if n in PLAIN_STRATEGIES] if args.plain_repeats else []
    plain_cap = DEFAULT_BUCKET_CAP_MB if args.plain_bucket_cap_mb is None else args.plain_bucket_cap_mb
    if plain_names:
        settings += (f"; plain runs: Hybrid bucket_cap_mb={plain_cap:g}, glibc's default allocator,"
                     f" {args.plain_repeats} runs each")
    print(settings, flush=True)
    os.environ.update(MALLOC_ENV)  # before the first launch starts the fork server the ranks are forked from
    results: dict[int, dict] = {}
    t_start = time.perf_counter()
    for dp in args.dps:
        results[dp] = {}
        for name in args.only:
            r = results[dp][name] = run_one(name, dp, cfg)
            line = (f"failed: {r['error']}" if "error" in r else
                    f"peak/rank MiB {' '.join(f'{x / MIB:.1f}' for x in r['peaks'])}  step {r['step_s']:.3f}s"
                    f"  resident/rank MiB {' '.join(f'{x / MIB:.1f}' for x in r['residents'])}"
                    f"  loss {r['loss']:.4f}  other load {r['other_load']:.2f}")
            print(f"  dp={dp} {STRATEGIES[name][0]:<28} {line}  (run {r['wall_s']:.0f}s)", flush=True)
    plain: dict[int, dict] = {}
    if plain_names:
        print("plain runs (glibc's default allocator, in a child process):", flush=True)
        runs = plain_pass(args.dps, plain_names, dict(cfg, bucket_cap_mb=args.plain_bucket_cap_mb),
                          args.plain_repeats)
        plain = {dp: {name: plain_summary(rs) for name, rs in rows.items()} for dp, rows in runs.items()}
    total = time.perf_counter() - t_start

    from benchmarks.report import header, write_report

    lines = [header("Peak memory and step time: HybridStrategy ZeRO 0-3 vs Lightning DDP / FSDP2").rstrip(), "",
             settings + f"; total wall time {total:.0f}s.", "",
             "Peak = highest live tensor bytes over the measured steps (PeakMemoryMonitor), max over ranks; the"
             " breakdown (MiB) is that rank's; act+temp = activations + backward temporaries; rest = buffers,"
             " optimizer-step"
             " temporaries, other. Resident set = each rank's VmHWM over its whole run (setup included; the"
             " libraries alone are a constant part of it, the same in every row) with MALLOC_MMAP_THRESHOLD_=65536;"
             " ratio = its saving against Hybrid ZeRO-0 over the formula's. Resident set of a plain run = the same"
             " as a user's run sees it: glibc's default allocator (its mmap threshold rises to up to 32 MiB, so"
             " most tensors come from the heap, where freed memory may stay resident), the strategy's default"
             " bucket cap, no tracker. Step time = slower rank per"
             " step, mean over the timed steps; other load = CPUs that other processes kept busy during the run.", ""]
    for dp in args.dps:
        lines += report(dp, results[dp], psi, dp * args.batch * args.block_size, plain.get(dp), plain_cap)
    write_report(args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
