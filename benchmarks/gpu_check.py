"""The prepared GPU check, version 2: one command, one table, under 8 minutes on one H200.

    python benchmarks/gpu_check.py                   # on a machine with a CUDA device
    python benchmarks/gpu_check.py --cpu-smoke       # the same sections on the CPU, tiny models (checks the script)

Every job runs in a subprocess of its own (its own CUDA context and memory, a time limit, and a crash or a
hang there is a row of the table, not the end of the script), one after another, within ``--budget-s``:

(a) tests: ``pytest -m cuda tests/strategy/test_cuda.py``, one row per test (its outcome and time; for a failure the
    exception and the last lines of its traceback, recorded as it happens by this file acting as a pytest
    plugin, so a run cut short by the time limit keeps what finished).
(b) throughput of a ~1B Llama (``--hidden 2048 --layers 16 --heads 32 --ffn 5632 --vocab 32000 --seq 2048
    --batch 4``, bf16-mixed, SDPA, fused AdamW, random tokens): `CausalLM` under `HybridStrategy()`, `CausalLM`
    under plain Lightning (``strategy="auto"``), and a hand-written LightningModule around
    ``transformers.LlamaForCausalLM`` (the baseline), each eager and compiled (``HybridStrategy(compile=True)``;
    otherwise ``layer.compile()`` of each decoder layer in ``configure_model``, as TorchTitan does): tokens/s and
    its ratio to the baseline of the same run, MFU (``flops_per_batch`` against Lightning's
    ``get_available_flops``), ``torch.cuda.max_memory_allocated`` during training, the warm-up's time; and
    ``HybridStrategy(compile=True, fp8="tensorwise")`` (torchao's float8 linears), with its ratio to the bf16
    compiled row; and ``HybridStrategy()`` eager on the same tokens as packed rows (documents of 64 to seq/2 tokens,
    their ``position_ids``: attention per document, `lightning_hybrid.hf.document_attention`), with its ratio to the
    eager row (goal >= 0.95).
(c) the multi-rank code paths on the one GPU: ranks sharing ``cuda:0`` over gloo, each a one-process "node"
    (`run_distributed(..., one_rank_per_node=True)`, ``Trainer(devices=1, num_nodes=world)``) under tp2, pp2,
    and dp2 with ZeRO 0, 1 and 3: the fp32 losses and global gradient norms of a small GPT against one device
    with plain Lightning (relative 1e-5), or the exception that stopped the layout; then tiny transformers models
    under bf16-mixed on the paths autocast changes (`MULTIRANK_BF16`: cp2 on packed documents -- each chunk attending
    per document -- plain, and with ring attention on packed documents (CUDA's memory-efficient kernel per chunk
    pair), tp2 with SP and selective recompute, ep2 with pointwise recompute on Mixtral): that they train (finite
    losses), or the exception.
(d) the planner's predicted peak memory (and step time) of the runs in (b), beside the measured peaks: dp=tp=pp=1,
    ZeRO 0, bf16-mixed, on the closest cluster preset (``h100`` for an H100 or H200: the same bf16 peak).

``--cpu-smoke`` runs what checks the script's plumbing: (b) the hand-written eager baseline and HybridStrategy's
compiled FP8 and packed rows only (`SMOKE_SKIPS`), (c) tp2, dp2 ZeRO-3 and the first bf16 path (`SMOKE_LAYOUTS`);
the suite's parity tests cover the rest on the CPU.

Writes the table (with the command and the date at its top) to ``--out`` (default ``benchmarks/GPU_CHECK.md``;
with ``--cpu-smoke`` a file in the temporary directory) and each job's output to ``--log-dir``. Exits 0 whatever
the rows say; without CUDA and without ``--cpu-smoke`` it prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GIB = 2**30
TAIL_LINES = 8  # lines of a traceback or a log kept in a table cell
NEWLINE = " ⏎ "  # how a cell shows a line break (the same in the console and in markdown)

# The ~1B Llama of (b) on a GPU, and the tiny one of --cpu-smoke.
GPU_MODEL = dict(hidden=2048, layers=16, heads=32, kv_heads=32, ffn=5632, vocab=32000, seq=2048, batch=4, warmup=5,
                 steps=15)
SMOKE_MODEL = dict(hidden=64, layers=2, heads=4, kv_heads=4, ffn=128, vocab=256, seq=64, batch=2, warmup=2, steps=3)
# Time limits (seconds) of each job; every one is also held to what is left of --budget-s, less what the sections
# after it need at the least (RESERVE).
# The sections run in the order d, a, c, b: the planner (no device, a second), the tests, the multi-rank paths, then
# the throughput runs, which take what is left (their compiled rows last).
LIMITS = {
    "gpu": {"tests": 200, "multirank": 200, "eager": 75, "compiled": 120},
    "cpu": {"tests": 90, "multirank": 170, "eager": 45, "compiled": 75},
}
RESERVE = {"gpu": {"multirank": 60, "throughput": 150}, "cpu": {"multirank": 50, "throughput": 60}}
# --cpu-smoke checks the script's plumbing: what the suite's parity tests cover already runs once, not per variant.
# (flex attention has no backward on CPU, FlashAttention is CUDA-only)
SMOKE_SKIPS = {"hand-compiled", "auto-compiled", "auto-eager", "hybrid-eager", "hybrid-compiled", "hybrid-packed-flex",
               "hybrid-packed-flash"}
SMOKE_LAYOUTS = ("tp2", "dp2 zero3")
MULTIRANK_LAYOUTS = {  # (c): name -> HybridStrategy arguments (world 2)
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "dp2 zero0": dict(dp=2, zero_stage=0),
    "dp2 zero1": dict(dp=2, zero_stage=1),
    "dp2 zero3": dict(dp=2, zero_stage=3),
    "cp2": dict(dp=1, cp=2),  # context parallelism: the zigzag split, K/V all-gathered, the mask built on the device
}
MULTIRANK_RTOL = 1e-5
# (c) then: name -> (transformers family, HybridStrategy arguments), bf16-mixed, trained 3 steps (no reference: bf16).
# The paths where autocast meets this codebase's own ops: the CP attention (rotary's fp32 queries and keys beside a
# bf16 value), the TP row layer as one op under a selective checkpoint, a MoE router's in-place topk weights.
MULTIRANK_BF16 = {  # ("packed": the batches are packed documents -- not a strategy argument)
    "bf16 llama cp2 packed documents": ("llama", dict(dp=1, cp=2, packed=True)),
    "bf16 llama cp2": ("llama", dict(dp=1, cp=2)),
    # ring attention: each chunk pair on SDPA's memory-efficient kernel with the pair's mask, in bf16, merged in fp32
    "bf16 llama cp2 ring packed documents": ("llama", dict(dp=1, cp=2, cp_attention="ring", packed=True)),
    "bf16 llama tp2 sp recompute=attention": ("llama", dict(tp=2, sequence_parallel=True, recompute="attention")),
    "bf16 mixtral dp2 ep2 recompute=pointwise": ("mixtral", dict(dp=2, ep=2, recompute="pointwise")),
}


# ================================================================================================ formatting
def cell(text: Any, limit: int = 2400) -> str:
    """``text`` as one markdown table cell: line breaks shown as ``⏎``, pipes escaped, at most ``limit`` chars."""
    lines = [line.rstrip() for line in str(text).strip().splitlines() if line.strip()]
    out = NEWLINE.join(lines).replace("|", "\\|")
    return out if len(out) <= limit else "…" + out[-limit:]


def tail(text: str, n: int = TAIL_LINES, width: int = 300) -> str:
    """The last ``n`` non-blank lines of ``text`` (a traceback, a log), each at most ``width`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not set(line.strip()) <= set("^~")]
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in lines[-n:])


def describe_exception() -> str:
    """The exception being handled: its type and message and the last lines of its traceback."""
    return tail(traceback.format_exc())


def size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def count(n: float) -> str:
    """A parameter count: ``1.10B``, ``953M``, ``72.6K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def log_tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        return tail(path.read_text(errors="replace"), n)
    except OSError as err:
        return f"(no log: {err})"


# ================================================================================================ pytest plugin
# `pytest -p gpu_check` loads this file as a plugin (section (a)): each test's outcome is appended to the JSON-lines
# file named by $GPU_CHECK_PYTEST_LOG as it happens. Without that variable the hooks do nothing.
def _pytest_log(record: dict) -> None:
    path = os.environ.get("GPU_CHECK_PYTEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _pytest_log({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _pytest_log({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report) -> None:
    record = {"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "duration": report.duration}
    if report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[2])
    elif report.failed:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
        record["reason"] = (tail(report.longreprtext, 12) if crash is None
                            else crash.splitlines()[0] + "\n" + tail(report.longreprtext, 12))
    _pytest_log(record)


def pytest_collectreport(report) -> None:
    if report.failed:
        _pytest_log({"event": "collect-error", "nodeid": report.nodeid, "reason": tail(report.longreprtext, 12)})


# ================================================================================================ the run
class Check:
    """The rows of the table, the time budget, and how jobs are started."""

    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.args, self.cuda = args, cuda
        self.kind = "cpu" if args.cpu_smoke else "gpu"
        self.accelerator = "cpu" if args.cpu_smoke else "cuda"
        self.rows: list[tuple[str, str, str, str]] = []
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="gpu_check_logs_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.model = dict(SMOKE_MODEL if args.cpu_smoke else GPU_MODEL)
        for key in self.model:
            value = getattr(args, key.replace("-", "_"), None)
            if value is not None:
                self.model[key] = value
        self.prediction: Optional[dict] = None

    # ------------------------------------------------------------------ rows and time
    def row(self, section: str, item: str, status: str, result: Any) -> None:
        self.rows.append((section, item, status, cell(result)))
        print(f"[gpu_check] {section} | {item} | {status} | {cell(result, 300)}", file=sys.stderr, flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, job: str, reserve: float = 0.0) -> float:
        """The time limit of the next job: its own, within what the budget leaves after ``reserve``."""
        return min(LIMITS[self.kind][job], self.left() - reserve)

    # ------------------------------------------------------------------ jobs
    def run_process(
        self, cmd: list[str], name: str, timeout: float, env: Optional[dict] = None,
    ) -> tuple[Optional[int], float, Path]:
        """Run ``cmd`` in a session of its own, output to ``<log dir>/<name>.log``; ``(exit code or None on the time
        limit, seconds, log path)``. Whatever the command left running (ranks, compile workers) is ended with it."""
        log = self.log_dir / f"{name}.log"
        start = time.monotonic()
        with open(log, "w") as out:
            out.write(f"$ {shlex.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                code: Optional[int] = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _end_session(proc)
        return code, time.monotonic() - start, log

    def job(
        self, name: str, kind: str, job_args: dict, timeout: float,
    ) -> tuple[Optional[int], float, Path, list[dict]]:
        """Run ``gpu_check.py --job kind`` (see `run_job`); its records (JSON lines) as well."""
        out = self.log_dir / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--job", kind, "--job-args", json.dumps(job_args),
               "--job-out", str(out)]
        code, seconds, log = self.run_process(cmd, name, timeout, env=_job_env())
        return code, seconds, log, read_records(out)


def _job_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.update(extra or {})
    return env


def _end_session(proc: subprocess.Popen) -> None:
    """End what is left of the job's process group (it leads one: ``start_new_session``; its ranks, fork server and
    compile workers are in it): SIGTERM, then SIGKILL to those still there after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=0.2)  # reap the leader (a zombie still counts as a member of its group)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


def read_records(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none if it is missing; a line cut short by a killed job is left out)."""
    records = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def _ended(code: Optional[int], seconds: float, log: Path) -> str:
    """Why a job gave no result: the time limit or its exit code, and its log's last lines."""
    why = f"time limit: stopped after {seconds:.0f} s" if code is None else f"exit code {code} after {seconds:.0f} s"
    return f"{why}; log {log}:\n{log_tail(log)}"


# ================================================================================================ (a) tests
def section_tests(check: Check) -> None:
    timeout = check.limit("tests", RESERVE[check.kind]["throughput"] + RESERVE[check.kind]["multirank"])
    if timeout < 20:
        check.row("a", "pytest -m cuda tests/strategy/test_cuda.py", "skipped",
                  f"time budget: {check.left():.0f} s left")
        return
    record_path = check.log_dir / "pytest.jsonl"
    record_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/strategy/test_cuda.py", "-q", "-rA", "--tb=short",
           "-p", "gpu_check", "-p", "no:cacheprovider"]
    code, seconds, log = check.run_process(cmd, "pytest", timeout,
                                           env=_job_env({"GPU_CHECK_PYTEST_LOG": str(record_path)}))
    records = read_records(record_path)
    collected: list[str] = next((r["nodeids"] for r in records if r["event"] == "collected"), [])
    started = [r["nodeid"] for r in records if r["event"] == "start"]
    results: dict[str, dict] = {}
    for r in records:
        if r["event"] == "collect-error":
            check.row("a", f"collecting {r['nodeid']}", "ERROR", r["reason"])
        if r["event"] != "report":
            continue
        res = results.setdefault(r["nodeid"], {"outcome": "passed", "duration": 0.0, "reason": ""})
        res["duration"] += r["duration"]
        if r["outcome"] == "failed":
            res["outcome"] = "FAIL" if r["when"] == "call" else "ERROR"
            res["reason"] += (f"[{r['when']}] " if r["when"] != "call" else "") + r.get("reason", "")
        elif r["outcome"] == "skipped" and res["outcome"] == "passed":
            res["outcome"], res["reason"] = "skipped", r.get("reason", "")
    names = list(dict.fromkeys(collected + started + list(results)))
    skipped = [results[n]["reason"] for n in names if n in results and results[n]["outcome"] == "skipped"]
    if names and len(skipped) == len(names) and len(set(skipped)) == 1:  # e.g. no CUDA here: one row
        status = "skipped (no CUDA)" if not check.cuda else "skipped"
        check.row("a", f"{len(names)} tests in tests/strategy/test_cuda.py", status, f"all skipped: {skipped[0]}")
    else:
        for name in names:
            short = name.split("::", 1)[-1]
            if name in results:
                res = results[name]
                text = f"{res['duration']:.1f} s" + (f"\n{res['reason']}" if res["reason"] else "")
                check.row("a", short, res["outcome"], text)
            elif name in started:
                check.row("a", short, "timeout", f"running when pytest stopped ({_ended(code, seconds, log)})")
            else:
                check.row("a", short, "not run", "pytest stopped before it (time limit or crash)")
    counts: dict[str, int] = {}
    for res in results.values():
        counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no test reported"
    if code is None or (code not in (0, 5) and not results):  # 5: no test collected
        check.row("a", "pytest", "ERROR", f"{summary}; {_ended(code, seconds, log)}")
    else:
        status = "ok" if code in (0, 5) else "FAIL"
        check.row("a", "pytest", status, f"exit code {code}: {summary} in {seconds:.0f} s (log {log})")


# ================================================================================================ (b) throughput
THROUGHPUT_ROWS = [  # (key, label, module kind, compiled); the first is the baseline of the ratios
    ("hand-eager", "hand-written LlamaForCausalLM, plain Lightning, eager (baseline)", "handwritten", False),
    ("hybrid-eager", "CausalLM, HybridStrategy(), eager", "hybrid", False),
    ("auto-eager", "CausalLM, plain Lightning (strategy='auto'), eager", "lightning", False),
    ("hybrid-compiled", "CausalLM, HybridStrategy(compile=True)", "hybrid", True),
    ("hybrid-compiled-fp8", "CausalLM, HybridStrategy(compile=True, fp8='tensorwise') (torchao float8)", "hybrid-fp8",
     True),
    ("hybrid-packed", "CausalLM, HybridStrategy(), eager, packed documents (position_ids: attention per document)",
     "hybrid-packed", False),
    # transformers' own kernels under packing, each verified on its first packed batch (`VerifiedAttention`).
    ("hybrid-packed-flex", "CausalLM(attn_implementation='flex_attention'), HybridStrategy(), eager, packed documents"
     " (flex attention's document BlockMask)", "hybrid-packed-flex", False),
    ("hybrid-packed-flash", "CausalLM(attn_implementation='flash_attention_2'), HybridStrategy(), eager, packed"
     " documents (FlashAttention's varlen path)", "hybrid-packed-flash", False),
    ("hand-compiled", "hand-written LlamaForCausalLM, plain Lightning, layer.compile() per decoder layer",
     "handwritten", True),
    ("auto-compiled", "CausalLM, plain Lightning, layer.compile() per decoder layer", "lightning", True),
]


def llama_fields(model: dict) -> dict:
    """The ``LlamaConfig`` fields of the (b) model."""
    return dict(hidden_size=model["hidden"], num_hidden_layers=model["layers"], num_attention_heads=model["heads"],
                num_key_value_heads=model["kv_heads"], intermediate_size=model["ffn"], vocab_size=model["vocab"],
                max_position_embeddings=model["seq"], tie_word_embeddings=False)


def section_throughput(check: Check) -> None:
    m = check.model
    shape = (f"Llama {m['layers']} layers x {m['hidden']} (heads {m['heads']}/{m['kv_heads']}, MLP {m['ffn']}, vocab"
             f" {m['vocab']}), batch {m['batch']} x {m['seq']} tokens, bf16-mixed, SDPA, fused AdamW,"
             f" {m['warmup']} warm-up + {m['steps']} timed steps")
    check.row("b", "model", "info", shape)
    baseline = None
    tokens: dict[str, float] = {}
    for key, label, kind, compiled in THROUGHPUT_ROWS:
        if check.kind == "cpu" and key in SMOKE_SKIPS:
            continue
        timeout = check.limit("compiled" if compiled else "eager")
        if timeout < 20:
            check.row("b", label, "skipped", f"time budget: {check.left():.0f} s left")
            continue
        job_args = {"kind": kind, "compile": compiled, "accelerator": check.accelerator, "llama": llama_fields(m),
                    "seq": m["seq"], "batch": m["batch"], "warmup": m["warmup"], "steps": m["steps"]}
        code, seconds, log, records = check.job(f"throughput-{key}", "throughput", job_args, timeout)
        result = records[-1] if records else None
        if result is None:
            check.row("b", label, "ERROR", _ended(code, seconds, log))
            continue
        if "error" in result:
            check.row("b", label, "ERROR", result["error"])
            continue
        if "skipped" in result:
            check.row("b", label, "skipped", result["skipped"])
            continue
        if key == "hand-eager":
            baseline = result["tokens_per_s"]
        tokens[key] = result["tokens_per_s"]
        text = _throughput_text(result, baseline, check.prediction, seconds)
        if key.startswith("hybrid-packed") and "hybrid-eager" in tokens:
            ratio = tokens[key] / tokens["hybrid-eager"]
            text += f"\npacked / unpacked, both eager, the same tokens per step: {ratio:.3f}x tokens/s (goal >= 0.95)"
        if key == "hybrid-compiled-fp8" and "hybrid-compiled" in tokens:
            text += (f"\nFP8 / bf16, both compiled: {tokens[key] / tokens['hybrid-compiled']:.3f}x tokens/s"
                     " (goal >= 1.2x on an H100/H200; emulated off CUDA)")
        check.row("b", label, "ok", text)


def _throughput_text(r: dict, baseline: Optional[float], prediction: Optional[dict], seconds: float) -> str:
    ratio = f" ({r['tokens_per_s'] / baseline:.3f}x baseline)" if baseline else " (no baseline)"
    mfu = (f"MFU {r['mfu']:.3f} ({r['peak_flops_source']})" if r.get("mfu") is not None
           else f"MFU n/a ({r['peak_flops_source']})")
    lines = [f"{r['tokens_per_s']:,.0f} tokens/s{ratio}, step {r['step_s'] * 1e3:.1f} ms, {mfu}"]
    pred = ""
    if prediction and "total" in prediction:
        pred = f"planner {size(prediction['total'])}"
    if r.get("peak_allocated") is not None:
        if pred:
            pred = f"; {pred} (measured / predicted {r['peak_allocated'] / prediction['total']:.2f})"
        lines.append(f"peak max_memory_allocated {size(r['peak_allocated'])}"
                     f" (reserved {size(r['peak_reserved'])}){pred}")
    else:
        lines.append("peak memory n/a (no CUDA)" + (f"; {pred}" if pred else ""))
    compiled = f"; compiled graphs {r['graphs']}, graph breaks {r['graph_breaks']}" if r.get("graphs") else ""
    lines.append(f"{count(r['params'])} params; warm-up {r['warmup_s']:.1f} s; fit {r['fit_s']:.0f} s"
                 f" (job {seconds:.0f} s); final loss {r['final_loss']:.3f}; optimizer {r['optimizer']}{compiled}")
    return "\n".join(lines)


# ================================================================================================ (c) multi-rank
def section_multirank(check: Check) -> None:
    timeout = check.limit("multirank", RESERVE[check.kind]["throughput"])
    if timeout < 20:
        check.row("c", "multi-rank layouts", "skipped", f"time budget: {check.left():.0f} s left")
        return
    layouts = []
    if check.kind == "gpu":
        what = "2 ranks on cuda:0, gloo, each a one-process node (Trainer(devices=1, num_nodes=2))"
        layouts = [(name, kwargs, True) for name, kwargs in MULTIRANK_LAYOUTS.items()]
        backend = "gloo"
    else:
        what = "2 CPU ranks, gloo, torchrun env (and one layout with the one-rank-per-node env)"
        layouts = [(name, kwargs, False) for name, kwargs in MULTIRANK_LAYOUTS.items() if name in SMOKE_LAYOUTS]
        layouts.append(("dp2 zero1, one rank per node", dict(dp=2, zero_stage=1), True))
        backend = None
    check.row("c", "set-up", "info", f"{what}; small GPT fp32, 6 steps, clipping 0.5; losses and grad norms against one"
                                     f" device (plain Lightning) within {MULTIRANK_RTOL:g} relative")
    devices = _cuda_devices() if check.kind == "gpu" else 0
    check.row("c", "async TP (tp2 + SP, compiled, async_tp=True)", "not run" if devices else "skipped (no CUDA)",
              "micro-pipelined TP needs >= 2 CUDA devices with NCCL (symmetric memory); this machine has"
              f" {devices}, and the rows here run 2 ranks on one device: whether it engages is not checked")
    bf16 = [(name, family, kwargs, check.kind == "gpu") for name, (family, kwargs) in MULTIRANK_BF16.items()]
    bf16 = bf16 if check.kind == "gpu" else bf16[:1]
    job_args = {"world": 2, "accelerator": check.accelerator, "backend": backend, "steps": 6, "bf16": bf16,
                "layouts": layouts, "layout_timeout_s": max(30.0, (timeout - 20) / max(1, len(layouts) + len(bf16)))}
    code, seconds, log, records = check.job("multirank", "multirank", job_args, timeout)
    done = {r["layout"]: r for r in records if "layout" in r}
    for r in records:
        if "error" in r:  # the job itself failed, outside any layout
            check.row("c", "multi-rank job", "ERROR", r["error"])
    for name in ["reference", *[n for n, _, _ in layouts], *[n for n, *_ in bf16]]:
        r = done.get(name)
        label = "one device (reference)" if name == "reference" else name
        if r is None:
            check.row("c", label, "not run",
                      _ended(code, seconds, log) if code != 0 else f"the job ended before it (log {log})")
        else:
            check.row("c", label, r["status"], r["text"])


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


# ================================================================================================ (d) planner
def planner_prediction(check: Check) -> dict:
    """The planner's prediction for the (b) runs: dp=tp=pp=1, ZeRO 0, bf16-mixed, one micro-batch of ``batch``."""
    from transformers import LlamaConfig

    from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, estimate_time, load_cluster

    name = _device_name(check).lower()
    preset = "a100" if "a100" in name else "h100"
    why = {"a100": "A100 preset", "h100": "h100 preset (DGX H100: 989 TFLOP/s bf16, 80 GB; there is no H200 preset,"
                                            " an H200 has the same bf16 peak and 141 GB)"}[preset]
    if not any(k in name for k in ("a100", "h100", "h200")):
        why = f"h100 preset (no preset for {name!r})"
    cluster = load_cluster(preset)
    m = check.model
    spec = ModelSpec.from_hf(LlamaConfig(**llama_fields(m)), seq_len=m["seq"])
    layout = Layout(dp=1, tp=1, pp=1, zero_stage=0, micro_batch=m["batch"], micro_batches=1)
    memory = estimate_memory(spec, layout, "bf16-mixed", cluster.activation_scale)
    step = estimate_time(spec, layout, cluster)
    return {**memory.as_dict(), "step_s": step.total, "tokens_per_s": m["batch"] * m["seq"] / step.total,
            "preset": preset, "why": why, "n_params": spec.params}


def section_planner(check: Check) -> None:
    try:
        p = planner_prediction(check)
    except Exception:
        check.row("d", "planner prediction for (b)", "ERROR", describe_exception())
        return
    check.prediction = p
    check.row("d", "planner peak for (b) (dp1 tp1 pp1 zero0, bf16-mixed)", "info",
              f"{size(p['total'])} = params {size(p['params'])} + grads {size(p['grads'])} + optimizer"
              f" {size(p['optimizer'])} + activations {size(p['activations'])} + buffers {size(p['buffers'])};"
              f" predicted step {p['step_s'] * 1e3:.1f} ms = {p['tokens_per_s']:,.0f} tokens/s\n"
              f"{count(p['n_params'])} params by the planner's count; {p['why']}; measured peaks: the rows of (b)")


# ================================================================================================ jobs (subprocesses)
def run_job(kind: str, job_args: dict, out: Path) -> int:
    """A job's body, in its own process: results (or the exception) appended to ``out`` as JSON lines."""
    def emit(record: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")

    try:
        if kind == "throughput":
            emit(job_throughput(job_args))
        elif kind == "multirank":
            job_multirank(job_args, emit)
        else:
            raise ValueError(f"unknown job {kind!r}")
    except BaseException:  # any failure is the job's result
        emit({"error": describe_exception()})
    return 0


class RandomTokens:
    """``n`` random token sequences (made once, on the CPU): ``(x, y)`` with ``y`` = ``x`` shifted by one."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        import torch

        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=generator, device="cpu")

    def __len__(self) -> int:
        return self.ids.size(0)

    def __getitem__(self, i: int):
        return self.ids[i, :-1], self.ids[i, 1:]


class PackedTokens(RandomTokens):
    """The same sequences as packed rows: each a run of documents of 64 to seq/2 tokens (seeded per row), their
    ``position_ids`` restarting at 0, the last document filling the row."""

    def __getitem__(self, i: int):
        import torch

        ids = self.ids[i, :-1]
        generator = torch.Generator(device="cpu").manual_seed(i)
        seq, positions, start = ids.size(0), [], 0
        while start < seq:
            length = min(seq - start, int(torch.randint(64, max(65, seq // 2), (1,), generator=generator)))
            positions.append(torch.arange(length, device="cpu"))
            start += length
        return {"input_ids": ids, "position_ids": torch.cat(positions)}


def _hand_written_module(llama: dict, compiled: bool, lr: float):
    """A LightningModule around ``transformers.LlamaForCausalLM`` as one would write it: the model built in
    ``configure_model`` (on the device Lightning makes ambient), cross entropy on fp32 logits, fused AdamW."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    class HandWrittenLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from transformers import AutoModelForCausalLM, LlamaConfig

            self.model = AutoModelForCausalLM.from_config(LlamaConfig(**llama), attn_implementation="sdpa")
            if compiled:
                for layer in self.model.model.layers:
                    layer.compile()
            self.n_params = sum(p.numel() for p in self.model.parameters())

        def on_train_batch_start(self, batch, batch_idx) -> None:
            x, _ = batch  # the count `CausalLM` uses: 6 N per token + attention's 12 L H T
            self.flops_per_batch = (6 * self.n_params
                                    + 12 * llama["num_hidden_layers"] * llama["hidden_size"] * x.size(1)) * x.numel()

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            self.log("train_loss", loss, prog_bar=True, sync_dist=True, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                     fused=True)

    return HandWrittenLlama()


def _causal_lm(llama: dict, compiled_layers: bool, lr: float, attention: str = "sdpa"):
    """`CausalLM` (its own init and optimizer) running ``attention``, with ``layer.compile()`` of each decoder layer
    if asked."""
    from lightning_hybrid.hf import CausalLM

    class LayerCompiledCausalLM(CausalLM):
        def configure_model(self) -> None:
            fresh = self.model is None
            super().configure_model()
            if fresh:
                for layer in self.model.model.layers:
                    layer.compile()

    cls = LayerCompiledCausalLM if compiled_layers else CausalLM
    return cls("llama", config=llama, lr=lr, attn_implementation=attention)


def _peak_flops(device) -> tuple[Optional[float], str]:
    """bf16 dense peak FLOP/s of ``device``: Lightning's table, else the planner's preset for an H100/H200."""
    import torch

    if device.type != "cuda":
        return None, "no bf16 peak for a CPU"
    from lightning.fabric.utilities.throughput import get_available_flops

    name = torch.cuda.get_device_name(device)
    try:
        flops = get_available_flops(device, torch.bfloat16)
    except Exception as err:  # an older Lightning
        flops, note = None, f"get_available_flops failed: {type(err).__name__}: {err}"
    else:
        note = f"Lightning's get_available_flops has no figure for {name!r}"
    if flops:
        return float(flops), f"peak {flops / 1e12:.0f} TFLOP/s, Lightning's table"
    if "h100" in name.lower() or "h200" in name.lower():
        from lightning_hybrid.planner import CLUSTER_PRESETS

        peak = CLUSTER_PRESETS["h100"].flops["bf16"]
        return peak, f"peak {peak / 1e12:.0f} TFLOP/s, the planner's h100 figure; {note}"
    return None, note


def job_throughput(a: dict) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_hybrid import HybridStrategy

    total = a["warmup"] + a["steps"]
    cuda = a["accelerator"] == "cuda"
    lr = 3e-4

    class Clock(L.Callback):
        """Synchronised times: training start, end of the warm-up, end of the last step; the training peak."""

        def _now(self, module) -> float:
            if module.device.type == "cuda":
                torch.cuda.synchronize(module.device)
            return time.perf_counter()

        def on_train_start(self, trainer, pl_module) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self.start = self._now(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == a["warmup"] - 1:
                self.warm = self._now(pl_module)
            elif batch_idx == total - 1:
                self.end = self._now(pl_module)
                self.final_loss = float(outputs["loss"])

    L.seed_everything(0, verbose=False)
    kind, compiled = a["kind"], a["compile"]
    if kind == "handwritten":
        module, strategy = _hand_written_module(a["llama"], compiled, lr), "auto"
    elif kind == "lightning":
        module, strategy = _causal_lm(a["llama"], compiled, lr), "auto"
    else:
        kernels = {"hybrid-packed-flex": "flex_attention", "hybrid-packed-flash": "flash_attention_2"}
        attention = kernels.get(kind, "sdpa")
        if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            return {"skipped": "the flash-attn package is not installed here"}
        module = _causal_lm(a["llama"], False, lr, attention)
        fp8 = {"fp8": "tensorwise"} if kind == "hybrid-fp8" else {}
        strategy = HybridStrategy(compile=True, **fp8) if compiled else HybridStrategy(**fp8)
    rows = (PackedTokens if kind.startswith("hybrid-packed") else RandomTokens)(total * a["batch"], a["seq"],
                                                                      a["llama"]["vocab_size"])
    data = DataLoader(rows, batch_size=a["batch"], shuffle=False, drop_last=True, pin_memory=cuda)
    clock = Clock()
    trainer = L.Trainer(
        accelerator=a["accelerator"], devices=1, precision="bf16-mixed", strategy=strategy, max_steps=total,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    from torch._dynamo.utils import counters

    graphs_before, breaks_before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    fit_s = time.perf_counter() - start
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    breaks = sum(counters["graph_break"].values()) - breaks_before
    device = trainer.strategy.root_device  # the module's own device: plain Lightning moves it to the CPU after fit
    elapsed = clock.end - clock.warm
    step_s = elapsed / a["steps"]
    flops = getattr(module, "flops_per_batch", None)
    peak, source = _peak_flops(device)
    optimizer = trainer.optimizers[0]
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "tokens_per_s": a["steps"] * a["batch"] * a["seq"] / elapsed, "step_s": step_s,
        "mfu": flops / step_s / peak if flops and peak else None, "peak_flops_source": source,
        "peak_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_reserved": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "params": sum(p.numel() for p in module.parameters()), "warmup_s": clock.warm - clock.start, "fit_s": fit_s,
        "final_loss": clock.final_loss, "device": str(device), "graphs": graphs, "graph_breaks": breaks,
        "optimizer": f"{type(inner).__name__}(fused={inner.defaults.get('fused')})",
    }


# ------------------------------------------------------------------------------------------------ (c) in the ranks
MR_BLOCK, MR_GLOBAL_BATCH, MR_CLIP = 32, 8, 0.5


def _small_gpt():
    from lightning_hybrid.models import GPTConfig, GPTLightningModule

    config = GPTConfig(vocab_size=256, block_size=MR_BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu",
                       dropout=0.0)
    return GPTLightningModule(config=config, lr=5e-4, weight_decay=0.1)


def multirank_fit(
    layout: Optional[dict], accelerator: str, backend: Optional[str], steps: int, timeout_s: float,
) -> dict:
    """Train the small GPT ``steps`` steps: under ``HybridStrategy(**layout)`` on this rank's process group, or
    (``layout`` None) on one device with plain Lightning (the ranks read its samples in its order).
    Returns the synced losses and the global gradient norms before clipping (the same on every rank)."""
    from datetime import timedelta

    import lightning as L
    import torch

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.data.corpus import ByteCorpusDataModule

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.grad_norms: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if not isinstance(trainer.strategy, HybridStrategy):
                grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
                self.grad_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(trainer.callback_metrics["train_loss"].item())
            strategy = trainer.strategy
            if isinstance(strategy, HybridStrategy) and strategy.last_grad_norm is not None:
                self.grad_norms.append(strategy.last_grad_norm.item())
                strategy.last_grad_norm = None

    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout is None:
        strategy, devices, num_nodes, dp = "auto", 1, 1, 1
        data = ByteCorpusDataModule(max_bytes=80_000, block_size=MR_BLOCK, batch_size=MR_GLOBAL_BATCH)
    else:
        strategy = HybridStrategy(**layout, process_group_backend=backend, timeout=timedelta(seconds=timeout_s))
        devices, num_nodes = _devices_and_nodes()
        dp = max(1, layout.get("dp", world // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))))
        data = ByteCorpusDataModule(max_bytes=80_000, block_size=MR_BLOCK, batch_size=MR_GLOBAL_BATCH // dp)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=steps,
        gradient_clip_val=MR_CLIP, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    module = _small_gpt()
    trainer.fit(module, data)
    import torch.distributed as dist

    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "device": str(trainer.strategy.root_device),
            "backend": dist.get_backend() if dist.is_initialized() else None, "rank": int(os.environ.get("RANK", "0")),
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")}}


def _devices_and_nodes() -> tuple[int, int]:
    """``Trainer(devices=, num_nodes=)`` for this rank of `run_distributed`'s world: one process per "node" where it
    was started so (``LOCAL_WORLD_SIZE`` 1), else every rank on one node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    one_per_node = os.environ.get("LOCAL_WORLD_SIZE") == "1" and world > 1
    return (1, world) if one_per_node else (world, 1)


def multirank_bf16_fit(family: str, layout: dict, accelerator: str, backend: Optional[str], steps: int,
                       timeout_s: float) -> dict:
    """Train a tiny transformers ``family`` model (`CausalLM`) ``steps`` steps under bf16-mixed and
    ``HybridStrategy(**layout)`` on this rank's process group (``layout["packed"]``: on packed documents, each row
    four, positions restarting); its losses."""
    from datetime import timedelta

    import lightning as L
    import torch
    import transformers as T

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.data.corpus import ByteCorpusDataModule
    from lightning_hybrid.hf import CausalLM

    sizes = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=64)
    config = (T.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2) if family == "mixtral"
              else T.LlamaConfig(**sizes))
    L.seed_everything(0, verbose=False)
    devices, num_nodes = _devices_and_nodes()
    layout = dict(layout)
    packed = layout.pop("packed", False)
    strategy = HybridStrategy(**layout, process_group_backend=backend, timeout=timedelta(seconds=timeout_s))

    class Packed(ByteCorpusDataModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            places = torch.arange(x.size(1), device=x.device)
            positions = places % (x.size(1) // 4)  # four documents a row
            labels = y.masked_fill(positions == positions.max(), -100)  # a document's last token: no target
            return {"input_ids": x, "labels": labels, "position_ids": positions.expand_as(x)}
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(trainer.callback_metrics["train_loss"].item())

    trainer = L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                        precision="bf16-mixed", max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Losses()])
    data = (Packed if packed else ByteCorpusDataModule)(max_bytes=20_000, block_size=16, batch_size=4)
    trainer.fit(CausalLM(config, lr=5e-4), data)
    return {"losses": losses, "device": str(trainer.strategy.root_device)}


def _max_rel(got: list[float], want: list[float]) -> float:
    return max((abs(g - w) / max(abs(w), 1e-30) for g, w in zip(got, want)), default=0.0)


def job_multirank(a: dict, emit: Callable[[dict], None]) -> None:
    import lightning_hybrid.testing as testing

    testing.WORKER_TIMEOUT_S = a["layout_timeout_s"]  # a layout that hangs is stopped, and the next one runs
    try:
        reference = multirank_fit(None, a["accelerator"], None, a["steps"], a["layout_timeout_s"])
    except BaseException:
        emit({"layout": "reference", "status": "ERROR", "text": describe_exception()})
        reference = None
    else:
        emit({"layout": "reference", "status": "ok", "text": f"losses {[round(x, 5) for x in reference['losses']]} on"
              f" {reference['device']}; grad norms {[round(x, 4) for x in reference['grad_norms']]}"})
    for name, layout, one_per_node in a["layouts"]:
        start = time.monotonic()
        try:
            ranks = testing.run_distributed(multirank_fit, a["world"], layout, a["accelerator"], a["backend"],
                                            a["steps"], a["layout_timeout_s"], one_rank_per_node=one_per_node)
        except BaseException:
            text = describe_exception()
            emit({"layout": name, "status": "ERROR", "text": f"HybridStrategy({_kwargs(layout)}): {_hint(text)}{text}"})
            continue
        seconds = time.monotonic() - start
        where = (f"ranks on {sorted({r['device'] for r in ranks})}, backend {ranks[0]['backend']},"
                 f" env {ranks[-1]['env']}")
        if reference is None:
            emit({"layout": name, "status": "no reference", "text": f"trained ({where}); losses {ranks[0]['losses']}"})
            continue
        errors = [max(_max_rel(r["losses"], reference["losses"]), _max_rel(r["grad_norms"], reference["grad_norms"]))
                  for r in ranks]
        counts_ok = all(len(r["losses"]) == len(reference["losses"]) == a["steps"]
                        and len(r["grad_norms"]) == len(reference["grad_norms"])
                        for r in ranks)
        worst = max(errors)
        if counts_ok and worst <= MULTIRANK_RTOL:
            emit({"layout": name, "status": "match", "text": f"max relative error {worst:.1e} (losses and grad norms,"
                  f" {a['steps']} steps, every rank); {where}; {seconds:.0f} s"})
        else:
            emit({"layout": name, "status": "MISMATCH", "text": f"max relative error {worst:.2e}"
                  f" (tolerance {MULTIRANK_RTOL:g}); steps {[len(r['losses']) for r in ranks]} of {a['steps']};"
                  f" rank 0 losses {ranks[0]['losses']} vs"
                  f" {reference['losses']}; {where}"})
    _bf16_rows(a, emit)


def _bf16_rows(a: dict, emit: Callable[[dict], None]) -> None:
    import math

    import lightning_hybrid.testing as testing

    for name, family, layout, one_per_node in a.get("bf16", []):
        start = time.monotonic()
        strategy = {k: v for k, v in layout.items() if k != "packed"}  # (a data choice, not an argument)
        data = " on packed documents" if layout.get("packed") else ""
        try:
            ranks = testing.run_distributed(multirank_bf16_fit, a["world"], family, layout, a["accelerator"],
                                            a["backend"], 3, a["layout_timeout_s"], one_rank_per_node=one_per_node)
        except BaseException:
            text = describe_exception()
            emit({"layout": name, "status": "ERROR",
                  "text": f"HybridStrategy({_kwargs(strategy)}){data}: {_hint(text)}{text}"})
            continue
        losses = ranks[0]["losses"]
        trained = len(losses) == 3 and all(math.isfinite(x) for r in ranks for x in r["losses"])
        emit({"layout": name, "status": "ok" if trained else "NOT TRAINED",
              "text": f"{family}, HybridStrategy({_kwargs(strategy)}){data}, bf16-mixed: losses"
                      f" {[round(x, 4) for x in losses]}"
                      f" on {sorted({r['device'] for r in ranks})}; {time.monotonic() - start:.0f} s"})


def _hint(text: str) -> str:
    """A line before an exception that a gloo group on CUDA tensors is known to raise."""
    low = text.lower()
    if "gloo" in low and "cuda" in low and any(w in low for w in ("unsupported", "not supported", "not implemented",
                                                                   "no support")):
        return "gloo does not implement this collective for CUDA tensors:\n"
    return ""


def _kwargs(d: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items())


# ================================================================================================ main
def _device_name(check: Check) -> str:
    import torch

    if check.cuda and not check.args.cpu_smoke:
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    return platform.processor() or "cpu"


def _versions() -> str:
    import torch

    parts = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    for name in ("lightning", "transformers"):
        try:
            parts.append(f"{name} {__import__(name).__version__}")
        except Exception as err:
            parts.append(f"{name}: {type(err).__name__}")
    return ", ".join(parts)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same sections on the CPU with tiny models (no CUDA needed)")
    p.add_argument("--out", default=None,
                   help="markdown table (default benchmarks/GPU_CHECK.md; smoke: a temporary file)")
    p.add_argument("--log-dir", default=None, help="each job's output (default: a new temporary folder)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time for all sections (default 440 on a GPU, 230 smoke)")
    p.add_argument("--sections", default="abcd", help="which sections to run (default abcd)")
    for key in GPU_MODEL:
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None,
                       help=f"(b) model / run size (default {GPU_MODEL[key]}; smoke {SMOKE_MODEL[key]})")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-args", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key in ("warmup", "steps"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key} must be at least 1")
    if args.budget_s is None:
        args.budget_s = 230.0 if args.cpu_smoke else 440.0
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.job:
        return run_job(args.job, json.loads(args.job_args), Path(args.job_out))
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device here; nothing to check. `python benchmarks/gpu_check.py --cpu-smoke` runs the"
              " same sections on the CPU with tiny models.")
        return 0
    check = Check(args, cuda)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "GPU_CHECK_cpu_smoke.md" if args.cpu_smoke
                                           else REPO_ROOT / "benchmarks" / "GPU_CHECK.md")
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    sections: dict[str, Callable[[Check], None]] = {
        "d": section_planner, "a": section_tests, "b": section_throughput, "c": section_multirank}
    for key in "dacb":  # the planner first (no device, a second): (b) shows its prediction beside each peak
        if key not in args.sections:
            continue
        try:
            sections[key](check)
        except Exception:  # a bug of this script in one section: the others still run
            check.row(key, "section", "ERROR", "gpu_check itself failed here: " + describe_exception())
    order = {"a": 0, "b": 1, "c": 2, "d": 3}
    rows = sorted(check.rows, key=lambda r: order.get(r[0], 9))  # stable: each section's rows in their order
    try:
        device = _device_name(check)
        versions = _versions()
    except Exception as err:
        device, versions = "?", f"versions unknown: {err}"
    lines = [
        "# GPU check" + (" (--cpu-smoke: CPU, tiny models)" if args.cpu_smoke else ""),
        "",
        f"- command: `{command}`",
        f"- date: {date}; host {platform.node()}; device: {device}; {versions}",
        f"- time: {time.monotonic() - check.start:.0f} s of a {args.budget_s:.0f} s budget; job logs: {check.log_dir}",
        "",
        "| section | check | status | result |",
        "|---|---|---|---|",
        *[f"| {s} | {cell(i, 200)} | {st} | {r} |" for s, i, st, r in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"(written to {out})")
    except OSError as err:
        print(f"(could not write {out}: {err})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
