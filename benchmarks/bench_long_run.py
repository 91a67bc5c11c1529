"""A long run: 1,000 steps with a checkpoint every 100, one rank killed in the middle and the job resumed, against
the same run uninterrupted; and the resident set of each rank from step 100 to step 1,000 (no leak).

    python benchmarks/bench_long_run.py                      # dp2 ZeRO-1, tp2, pp2: ~6 min on 2 cores
    python benchmarks/bench_long_run.py --layouts dp2-zero1 --steps 300 --every 50 --kill-at 137   # a smoke run
    python benchmarks/bench_long_run.py --layouts dp2-zero1 --steps 600 --every 136 --kill-at 450
        # the resume from a checkpoint saved at the last batch of an epoch (step 408)

Each layout is three jobs of `benchmarks/long_run_job.py` (CPU, 2 ranks started by Lightning's own launcher from a
process without LOCAL_RANK / RANK / WORLD_SIZE / MASTER_PORT, ``OMP_NUM_THREADS=1``,
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set):

  uninterrupted  ``--steps`` steps, ``ModelCheckpoint(every_n_train_steps=--every, save_last=True)``
  killed         the same, with rank 1 SIGKILLing itself at the end of step ``--kill-at`` (between two
                 checkpoints): the job must end by itself (within ``--hang-timeout`` s) and leave the checkpoint
                 of the step before the kill whole (`lightning_hybrid.checkpoint.read_meta`, `verify_files`,
                 no unfinished save folder)
  resumed        ``fit(ckpt_path="last")`` in the killed job's folder, up to ``--steps``

Compared: every step's ``train_loss`` (``trainer.callback_metrics``, as float64, rank 0) of the resumed job against
the uninterrupted one's (goal: max |difference| = 0.0), the final weights of both (consolidated from ``last.ckpt``
with `consolidated_state_dict`; goal 0.0), and each rank's resident set (``VmRSS``, /proc/self/status, read at
the end of the step, before that step's checkpoint is saved) at step ``--steps`` against step ``--every`` of the
uninterrupted job (goal: within 2%). Beside it, glibc's heap in use (``mallinfo2``) and, at the census steps, the
count of Python objects by type and the bytes of the live tensors they hold, to tell a leak from the allocator.
The tables go to benchmarks/LONG_RUN.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.machine_load import system_busy_s  # noqa: E402
from lightning_hybrid.checkpoint import PARTIAL_MARK, consolidated_state_dict, read_meta, verify_files  # noqa: E402

JOB = Path(__file__).resolve().parent / "long_run_job.py"
MIB = 1024  # the records are in KiB
RSS_GOAL = 1.02
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
# name: arguments of long_run_job.py (the same global batch of 8 sequences in each)
LAYOUT_TEXT = {
    "dp2-zero1": "HybridStrategy(dp=2, zero_stage=1), 4 sequences per rank",
    "tp2": "HybridStrategy(tp=2), 8 sequences",
    "pp2": "HybridStrategy(pp=2, micro_batches=2), 8 sequences",
}
LAYOUTS = {
    "dp2-zero1": ["--dp", "2", "--tp", "1", "--pp", "1", "--zero-stage", "1", "--batch", "4"],
    "tp2": ["--dp", "1", "--tp", "2", "--pp", "1", "--zero-stage", "0", "--batch", "8"],
    "pp2": ["--dp", "1", "--tp", "1", "--pp", "2", "--zero-stage", "0", "--batch", "8", "--micro-batches", "2"],
}


def _proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of a live process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def read_records(record: Path, ranks: int = 2) -> list[list[dict]]:
    """Each rank's entries, in the order written (a job resumed in the same folder appends to a new record)."""
    out = []
    for r in range(ranks):
        path = Path(f"{record}.rank{r}.jsonl")
        out.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return out


def launch(args: argparse.Namespace, layout: str, root: Path, record: Path, *extra: str,
           deadline: float) -> dict:
    """One job of long_run_job.py; waits for it (killing its process group at ``deadline`` seconds) and returns
    rc, wall time, whether it was stopped by the deadline, the CPUs other processes kept busy meanwhile, and
    its stderr's tail."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(MALLOC_ENV)
    cmd = [sys.executable, str(JOB), str(root), str(record), "--steps", str(args.steps), "--every", str(args.every),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--block-size", str(args.block_size),
           "--max-bytes", str(args.max_bytes), "--census", *map(str, census_steps(args)), *LAYOUTS[layout], *extra]
    busy0, t0 = system_busy_s(), time.time()
    job = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # its own process group: both ranks can be stopped together
    cpu: dict[int, float] = {}
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(job.stdout), daemon=True)
    reader.start()
    stopped = False
    while job.poll() is None:
        pids = {job.pid} | {e["pid"] for rank in read_records(record) for e in rank if "pid" in e}
        for pid in pids:
            seen = _proc_cpu_s(pid)
            if seen is not None:
                cpu[pid] = seen
        if time.time() - t0 > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            stopped = True
        time.sleep(0.5)
    job.wait()
    reader.join(timeout=5)
    wall = time.time() - t0
    busy1 = system_busy_s()
    other = (busy1 - busy0 - sum(cpu.values())) / wall if None not in (busy0, busy1) else float("nan")
    try:  # a rank left behind (the job's group outlives its first process)
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return {"rc": job.returncode, "wall_s": wall, "end": time.time(), "stopped_by_deadline": stopped,
            "other_load": max(0.0, other), "tail": "".join(out)[-3000:]}


def census_steps(args: argparse.Namespace) -> list[int]:
    return sorted({args.every, 2 * args.every, args.kill_at // args.every * args.every, args.steps})


def losses(entries: list[dict]) -> dict[int, float]:
    return {e["step"]: float(e["loss"]) for e in entries if "loss" in e}


def epoch_starts(entries: list[dict]) -> list[int]:
    """The steps that began a new epoch (the first recorded step's epoch counts as begun before it)."""
    epochs = {e["step"]: e["epoch"] for e in entries if "epoch" in e}
    return [s for s in sorted(epochs) if s - 1 in epochs and epochs[s] != epochs[s - 1]]


def rss(entries: list[dict]) -> dict[int, dict]:
    return {e["step"]: e["rss"] for e in entries if "rss" in e}


def censuses(entries: list[dict]) -> dict[int, dict]:
    return {e["step"]: e["census"] for e in entries if "census" in e}


def checkpoint_state(root: Path) -> dict:
    """What the killed job left in its folder: each checkpoint's step and whether its files check out."""
    out = {"entries": sorted(p.name for p in root.iterdir()) if root.exists() else [], "checkpoints": {}}
    out["partial"] = [name for name in out["entries"] if PARTIAL_MARK in name]
    for name in out["entries"]:
        if name.endswith(".ckpt"):
            try:
                meta = read_meta(root / name)
                verify_files(root / name, meta)
                out["checkpoints"][name] = {"step": meta["global_step"], "whole": True}
            except Exception as err:  # noqa: BLE001  (reported)
                out["checkpoints"][name] = {"step": None, "whole": False, "error": f"{type(err).__name__}: {err}"}
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """max |a - b| over every tensor, and whether the two have the same keys and every tensor is bit-equal."""
    if a.keys() != b.keys():
        return float("inf"), False
    diff = max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel()), default=0.0)
    return diff, all(torch.equal(a[k], b[k]) for k in a)


def run_layout(args: argparse.Namespace, layout: str, work: Path) -> dict:
    base = work / layout
    base.mkdir(parents=True, exist_ok=True)
    res: dict = {"layout": layout}
    print(f"[{layout}] uninterrupted: {args.steps} steps", flush=True)
    res["full"] = launch(args, layout, base / "full", base / "full", deadline=args.timeout)
    print(f"[{layout}]   rc {res['full']['rc']}, {res['full']['wall_s']:.0f}s, other load"
          f" {res['full']['other_load']:.2f}", flush=True)
    print(f"[{layout}] killed: rank 1 SIGKILLs itself at the end of step {args.kill_at}", flush=True)
    res["killed"] = launch(args, layout, base / "resumable", base / "killed", "--kill-rank", "1", "--kill-at",
                           str(args.kill_at), deadline=args.timeout)
    killed_records = read_records(base / "killed")
    kill_time = next((e["time"] for e in killed_records[1] if "killed_at" in e), None)
    res["killed"]["killed_at"] = next((e["killed_at"] for e in killed_records[1] if "killed_at" in e), None)
    res["killed"]["end_after_kill_s"] = res["killed"]["end"] - kill_time if kill_time is not None else float("nan")
    res["killed"]["ended_by_itself"] = (kill_time is not None and not res["killed"]["stopped_by_deadline"]
                                       and res["killed"]["end_after_kill_s"] <= args.hang_timeout)
    res["folder"] = checkpoint_state(base / "resumable")
    print(f"[{layout}]   rc {res['killed']['rc']}, ended {res['killed']['end_after_kill_s']:.1f}s after the kill;"
          f" folder: {res['folder']['entries']}", flush=True)
    print(f"[{layout}] resumed from last.ckpt", flush=True)
    res["resumed"] = launch(args, layout, base / "resumable", base / "resumed", "--resume", deadline=args.timeout)
    print(f"[{layout}]   rc {res['resumed']['rc']}, {res['resumed']['wall_s']:.0f}s", flush=True)

    full, killed, resumed = read_records(base / "full"), killed_records, read_records(base / "resumed")
    res["records"] = {"full": full, "killed": killed, "resumed": resumed}
    a, k, b = losses(full[0]), losses(killed[0]), losses(resumed[0])
    res["resumed"]["trained"] = len(b)
    last_line = [line for line in res["killed"]["tail"].splitlines() if line.strip()][-1:]
    res["killed"]["last_line"] = last_line[0].strip()[:200] if last_line else ""
    common = sorted(set(a) & set(b))
    res["loss_steps"] = (min(common), max(common), len(common)) if common else None
    res["loss_diff"] = max((abs(a[s] - b[s]) for s in common), default=float("nan"))
    res["loss_equal"] = sum(a[s] == b[s] for s in common)
    res["first_diff"] = next((s for s in common if a[s] != b[s]), None)
    res["epoch_starts"] = (epoch_starts(full[0]), epoch_starts(resumed[0]))
    before = sorted(set(a) & set(k))
    res["killed_loss_diff"] = max((abs(a[s] - k[s]) for s in before), default=float("nan"))
    res["final_losses"] = (a.get(args.steps), b.get(args.steps))
    try:
        weights = max_abs_diff(consolidated_state_dict(base / "full" / "last.ckpt"),
                               consolidated_state_dict(base / "resumable" / "last.ckpt"))
        res["weights"] = {"diff": weights[0], "equal": weights[1],
                          "steps": (read_meta(base / "full" / "last.ckpt")["global_step"],
                                    read_meta(base / "resumable" / "last.ckpt")["global_step"])}
    except Exception as err:  # noqa: BLE001  (reported)
        res["weights"] = {"error": f"{type(err).__name__}: {err}"}
    return res


# ----------------------------------------------------------------------------------------------- the report
def _verdict(good: bool) -> str:
    return "met" if good else "NOT MET"


def _mib(kib: float) -> str:
    return f"{kib / MIB:.1f}"


def report(args: argparse.Namespace, results: list[dict]) -> list[str]:
    steps = [s for s in (args.every, 2 * args.every, args.kill_at // args.every * args.every, args.steps)]
    steps = sorted(set(steps))
    out = ["## Kill and resume", "",
           "| layout | uninterrupted: rc, s | killed at | job ended (s after the kill), rc | checkpoints left"
           " (step, whole) | resumed from | resumed: rc, s, steps trained | losses compared | equal | max abs diff |"
           " first differing step | new epoch at step (uninterrupted; resumed) | final weights max abs diff"
           " | other load |", "|---|" + "---|" * 13]
    goals = []
    for r in results:
        f, kl, rs = r["full"], r["killed"], r["resumed"]
        cks = ", ".join(f"{n}: {c['step']}{'' if c['whole'] else ' DAMAGED'}"
                        for n, c in r["folder"]["checkpoints"].items())
        if r["folder"]["partial"]:
            cks += f"; unfinished: {', '.join(r['folder']['partial'])}"
        ended = (f"{kl['end_after_kill_s']:.1f}, rc {kl['rc']}" if kl["ended_by_itself"] else
                 f"HUNG: stopped after {kl['wall_s']:.0f}s")
        lo = r["loss_steps"]
        w = r["weights"]
        wtxt = w.get("error") or (f"{w['diff']:.3g}" + (" (bit-equal)" if w["equal"] else ""))
        resumed_from = r["folder"]["checkpoints"].get("last.ckpt", {}).get("step")
        out.append(f"| {r['layout']} | {f['rc']}, {f['wall_s']:.0f} | {kl['killed_at']} | {ended} | {cks} |"
                   f" step {resumed_from} | {rs['rc']}, {rs['wall_s']:.0f}, {rs['trained']} |"
                   f" {f'{lo[0]}..{lo[1]}' if lo else '-'} | {r['loss_equal']}/{lo[2] if lo else 0} |"
                   f" {r['loss_diff']:.3g} | {r['first_diff'] or '-'} |"
                   f" {', '.join(map(str, r['epoch_starts'][0]))}; {', '.join(map(str, r['epoch_starts'][1]))} |"
                   f" {wtxt} |"
                   f" {max(f['other_load'], kl['other_load'], rs['other_load']):.2f} |")
        last = r["folder"]["checkpoints"].get("last.ckpt", {})
        saved_step = args.kill_at // args.every * args.every
        kept = (kl["ended_by_itself"] and kl["rc"] != 0 and last.get("whole", False) and last.get("step") == saved_step
                and not r["folder"]["partial"])
        goals.append(f"- {r['layout']}: the killed job ended by itself"
                     f" ({kl['end_after_kill_s']:.1f}s after the kill, rc {kl['rc']}, limit {args.hang_timeout:g}s;"
                     f" its last line: `{kl['last_line']}`) and left last.ckpt whole at step {last.get('step')}"
                     f" (expected {saved_step}), no unfinished save: {_verdict(kept)}")
        ok_losses = (lo is not None and lo[0] == saved_step + 1 and lo[1] == args.steps and r["loss_diff"] == 0.0
                     and r["loss_equal"] == lo[2])
        goals.append(f"- {r['layout']}: the resumed job's losses of steps {saved_step + 1}..{args.steps} equal the"
                     f" uninterrupted run's ({rs['trained']} steps trained, {r['loss_equal']} equal, max abs diff"
                     f" {r['loss_diff']:.3g}; steps before the kill, killed vs uninterrupted: max abs diff"
                     f" {r['killed_loss_diff']:.3g}): {_verdict(ok_losses)}")
        final = args.steps // args.every * args.every  # the step of both runs' last.ckpt
        steps_txt = f"last.ckpt at steps {w['steps'][0]} and {w['steps'][1]}, " if "steps" in w else ""
        goals.append(f"- {r['layout']}: final weights equal ({steps_txt}max abs diff {wtxt}):"
                     f" {_verdict('error' not in w and w['equal'] and w['steps'] == (final, final))}")
    out += [""]

    out += ["## Resident set of the uninterrupted run", "",
            f"VmRSS MiB per rank at the end of each step (before that step's checkpoint is saved); ratio = step"
            f" {args.steps} / step {args.every}. heap = glibc's bytes in use (mallinfo2 uordblks + hblkhd, MiB).", "",
            "| layout | rank | " + " | ".join(f"step {s}" for s in steps) + f" | ratio {args.steps}/{args.every}"
            f" | ratio {args.steps}/{2 * args.every} | heap " + " / ".join(str(s) for s in steps) + " |",
            "|---|---:|" + "---:|" * (len(steps) + 3)]
    for r in results:
        for rank, entries in enumerate(r["records"]["full"]):
            m = rss(entries)
            if not all(s in m for s in steps):
                out.append(f"| {r['layout']} | {rank} | (no record of every step) |")
                continue
            v = {s: m[s]["VmRSS"] for s in steps}
            heap = " / ".join(_mib(m[s].get("malloc_uordblks", 0) + m[s].get("malloc_hblkhd", 0)) for s in steps)
            ratio, ratio2 = v[args.steps] / v[args.every], v[args.steps] / v[2 * args.every]
            out.append(f"| {r['layout']} | {rank} | " + " | ".join(_mib(v[s]) for s in steps)
                       + f" | {ratio:.4f} | {ratio2:.4f} | {heap} |")
            goals.append(f"- {r['layout']} rank {rank}: resident set at step {args.steps} / step {args.every} ="
                         f" {ratio:.4f} (goal <= {RSS_GOAL}): {_verdict(ratio <= RSS_GOAL)}")
    out += [""]

    out += ["## Python objects and live tensors (uninterrupted run)", "",
            "gc-tracked objects and the bytes of the distinct storages of the live tensors among them, at the census"
            " steps (taken after the resident set is read).", "",
            "| layout | rank | " + " | ".join(f"step {s}" for s in census_steps(args)) + " | types grown most,"
            f" step {2 * args.every} -> {args.steps} |", "|---|---:|" + "---:|" * len(census_steps(args)) + "---|"]
    for r in results:
        for rank, entries in enumerate(r["records"]["full"]):
            c = censuses(entries)
            cells = " | ".join(f"{c[s]['objects']:,} obj, {c[s]['tensor_bytes'] / 2**20:.2f} MiB" if s in c else "-"
                               for s in census_steps(args))
            grown = "-"
            if 2 * args.every in c and args.steps in c:
                x, y = c[2 * args.every]["by_type"], c[args.steps]["by_type"]
                delta = sorted(((y.get(t, 0) - x.get(t, 0), t) for t in set(x) | set(y)), reverse=True)[:5]
                grown = ", ".join(f"{t} {d:+d}" for d, t in delta if d)
            out.append(f"| {r['layout']} | {rank} | {cells} | {grown or 'none'} |")
    return out + ["", "## Goals", ""] + goals + [""]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="checkpoint every this many steps")
    p.add_argument("--kill-at", type=int, default=537, help="rank 1 kills itself at the end of this step")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-bytes", type=int, default=110_000,
                   help="corpus bytes: 110,000 is an epoch of 408 steps (shuffled): the run crosses two epoch ends, one"
                   " before the kill and one after the resume, which comes in the first half of an epoch")
    p.add_argument("--timeout", type=float, default=600, help="seconds a job may run before it is stopped")
    p.add_argument("--hang-timeout", type=float, default=120, help="seconds the killed job may take to end")
    p.add_argument("--work", type=Path, default=None, help="keep the checkpoints and records here (default: a"
                   " temporary folder, removed)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "LONG_RUN.md",
                   help="results file (overwritten)")
    args = p.parse_args(argv)
    if not (0 < args.every and 2 * args.every < args.kill_at < args.steps and args.kill_at % args.every):
        p.error("need 0 < 2 * --every < --kill-at < --steps, --kill-at between two checkpoints")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # consolidation, on one process
    import lightning as L

    settings = (f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head=4 block_size={args.block_size} gelu;"
                f" layouts: {'; '.join(f'{n} = {LAYOUT_TEXT[n]}' for n in args.layouts)};"
                f" global batch 8 sequences; ByteCorpusDataModule(max_bytes={args.max_bytes:,}, shuffle=True);"
                f" AdamW fp32; {args.steps} steps, ModelCheckpoint(every_n_train_steps={args.every}, save_last=True),"
                f" no validation; CPU, gloo, 2 ranks by Lightning's launcher, OMP_NUM_THREADS=1,"
                f" MALLOC_MMAP_THRESHOLD_=65536; torch {torch.__version__}, lightning {L.__version__},"
                f" {os.cpu_count()} CPUs")
    print(settings, flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="long_run_") as tmp:
        work = args.work or Path(tmp)
        results = [run_layout(args, layout, work) for layout in args.layouts]
    total = time.time() - t0

    from benchmarks.report import header, write_report

    loads = [x[k]["other_load"] for x in results for k in ("full", "killed", "resumed")]
    lines = [header("A long run: kill, resume, resident set").rstrip(), "",
             settings + f"; total wall time {total:.0f}s.", "",
             "Each layout: one uninterrupted job; one job in which rank 1 SIGKILLs itself at the end of step"
             f" {args.kill_at} (the job must end by itself and leave the last checkpoint whole); one job resumed"
             " from it with `fit(ckpt_path=\"last\")`. Losses are `trainer.callback_metrics[\"train_loss\"]` as float64"
             " on rank 0 at every step; weights are consolidated from each run's `last.ckpt`"
             " (`consolidated_state_dict`). Other load = CPUs that other processes kept busy during a job (the"
             f" highest of the three); the highest here: {max(loads):.2f}.", ""]
    lines += report(args, results)
    write_report(args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
