"""Expert parallelism on a Mixtral-style model: tokens/s, expert parameters and peak memory per rank, and the
all-to-all traffic per step, of ``ep=2`` against ``ep=1`` at the same ``dp``, ``tp`` and ZeRO stage, on CPU.

    python benchmarks/bench_moe.py                         # ZeRO-1 (each layout twice) and ZeRO-0 (once): ~6 min
    python benchmarks/bench_moe.py --zero-stages 1 --repeats 1   # ZeRO-1 only, once: ~2 min
    python benchmarks/bench_moe.py --quick                 # small model, fewer steps: a smoke run

Layouts (gloo, one thread per rank, each run a fresh process group started like torchrun,
`lightning_hybrid.testing.run_distributed`), at every ``--zero-stages`` value:

  dp2 ep1, dp2 ep2              2 ranks: HybridStrategy(dp=2, ep=1|2, zero_stage=s)
  dp2xtp2 ep1, dp2xtp2 ep2      4 ranks: HybridStrategy(dp=2, tp=2, ep=1|2, zero_stage=s) (attention split over TP,
                                experts whole per TP rank, an EP group per TP rank)

Model: ``transformers.MixtralConfig`` (vocabulary 256, untied embeddings, ``output_router_logits=False``) built by
`lightning_hybrid.hf.CausalLM` (random init, seed 0; the same weights in every layout), default hidden 256,
intermediate 512, 4 layers, 8 heads (8 KV heads), 8 experts, top-2: the experts hold ~92% of the parameters. Data:
`ByteCorpusDataModule` (stdlib bytes), block T=128, per-rank batch 4 (TP ranks share their DP rank's batch).
AdamW fp32. Every rank takes, in order, one untracked step (it creates the optimizer state), ``--measure-steps``
steps under the live-tensor tracker, ``--count-steps`` steps under the all-to-all counter, ``--warmup`` untimed
steps and ``--steps`` timed steps. The layouts of the first ``--zero-stages`` value run ``--repeats`` times, ep1
and ep2 interleaved (ep1 ep2, ep2 ep1, ...); the other stages once (their memory and traffic).

tokens/s       global tokens per step (dp * batch * T) / step time; step time = on_train_batch_start ->
               on_train_batch_end, the slower rank per step, mean over the timed steps (no tracker is on then),
               mean over the runs; beside it the CPU time per step of all ranks together (process time)
ep2 / ep1      tokens/s of the ep=2 row over the ep=1 row of the same dp, tp and stage, measured in this run
expert params  the parameters of the experts modules on the rank
               (`lightning_hybrid.parallel.expert_parallel.find_experts` on its model after setup) against the formula
               total / ep, total = layers * experts * 3 * H * I
               (gate_up (E, 2I, H) + down (E, H, I) per layer, counted on a one-device build)
peak           `lightning_hybrid.runs.memory.PeakMemoryMonitor`: the highest live tensor bytes of the rank over the
               measured steps (the first step left out), with its breakdown by kind; "state" = parameters +
               gradients (and their buckets) + optimizer state live when the last measured step ended (what the
               rank holds between steps)
expected       what ep saves of the experts' state per rank, fp32 AdamW, Pe = expert parameters, edp = dp / ep (the
               ranks sharing an expert): params 4 Pe/ep (ZeRO-3: 4 Pe/dp), grads 4 Pe/ep (ZeRO-2/3: 4 Pe/dp),
               optimizer 8 Pe/ep (ZeRO-1/2/3: 8 Pe/dp), minus the same at ep=1; ZeRO-1 at ep=2: 4 Pe bytes (the
               optimizer state of the experts is split over dp either way), ZeRO-0: 8 Pe bytes
measured       the ep=1 row's peak (and state) minus the ep=2 row's, rank by rank
all-to-all     a TorchDispatchMode over the counted steps sees every ``c10d::alltoall_base_`` (forward and
               backward) and keeps those on the rank's EP group: the elements of their input tensors, floating
               point (the tokens and their outputs and gradients) apart from the integer split-size exchanges, and
               the part not sent to the rank itself (from the input split sizes). Formula: each (token, expert)
               pair is sent to its expert once in forward and back once, and both again in backward:
               4 * L_moe * N * k * H elements per rank per step, N = tokens this rank routes (batch * T), self-sends
               included. Under uniform routing (ep-1)/ep of it leaves the rank.
other load     CPUs that other processes kept busy during the run (`benchmarks/machine_load.py`); above 0.25 the
               timing is marked disturbed

The tables are printed and written to benchmarks/MOE.md.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.machine_load import cpu_s, system_busy_s  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.parallel.expert_parallel import find_experts, iter_expert_modules  # noqa: E402
from lightning_hybrid.runs.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

VAL_FRACTION = 0.05  # ByteCorpusDataModule's default hold-out
MIB = 2**20
MAX_OTHER_LOAD = 0.25  # CPUs busy with other processes above which a run's timing is flagged as disturbed
# Large allocations mmap'ed, so that a freed tensor leaves the resident set at once (as bench_memory.py).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
LAYOUTS = {"dp2": dict(dp=2, tp=1), "dp2xtp2": dict(dp=2, tp=2)}
ALLTOALL_OPS = ("c10d::alltoall_base_", "c10d::alltoall_")


def mixtral_config(m: dict):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["heads"], num_local_experts=m["experts"],
        num_experts_per_tok=m["top_k"], max_position_embeddings=m["block_size"], output_router_logits=False,
    )
    config.tie_word_embeddings = False
    for name in ("attention_dropout", "hidden_dropout", "router_jitter_noise"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    return config


# ---------------------------------------------------------------------------------------------- in each rank
class StepTimer(L.Callback):
    """Wall time (perf_counter) and this process's CPU time (all threads) from the start to the end of every
    training batch from ``first`` on."""

    def __init__(self, first: int) -> None:
        self.first, self.times, self.cpu = first, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.first:
            self.times.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)


class SteadyPeakMemoryMonitor(PeakMemoryMonitor):
    """`PeakMemoryMonitor` over the batches after the first ``skip`` (the first step creates the optimizer state
    inside its optimizer step, a moment no later step has): the peak of a steady training step."""

    def __init__(self, steps: int, skip: int) -> None:
        super().__init__(steps=steps)
        self.skip = skip

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx >= self.skip:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class AllToAllCounter(TorchDispatchMode):
    """Per step, what the all-to-alls on the rank's EP groups (``ep_groups``: group name -> this rank's index in
    it) move. Integer ones are the split-size exchanges (one per MoE layer, forward), each followed by the
    layer's dispatch, whose output split sizes give ``received``, the (token, expert) rows the rank's experts get.
    Floating-point ones move rows of H: they come in pairs, per layer, in forward (dispatch: the rank's own pairs
    to their experts' ranks; combine: the outputs of the rows it received back to their tokens' ranks) and in
    backward (the combine's backward: gradients of the rank's own pairs to the experts' ranks; the dispatch's:
    gradients of the received rows back). So the first of each pair sends the rank's own pairs (``own_out``:
    its input) and the second returns them (``own_back``: its output); ``misordered`` counts calls whose split
    sizes contradict that. ``sent``: every input element; ``leaving``: those not addressed to the rank itself.
    All-to-alls on any other group, or of lists of tensors: ``elsewhere``."""

    def __init__(self, ep_groups: dict[str, int]) -> None:
        super().__init__()
        self.ep_groups = ep_groups
        self.calls = self.sent = self.leaving = self.own_out = self.own_back = 0
        self.splits = self.received = self.elsewhere = self.misordered = 0
        self._out_signatures: set[tuple] = set()  # (input splits, output splits) of the sending call of each pair
        self._after_splits = False  # the next floating-point call is a forward dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name == "c10d::alltoall_base_":
            self._count(args)
        elif name == "c10d::alltoall_":
            self.elsewhere += sum(t.numel() for t in args[1])  # not what the experts issue: counted apart
        return out

    def _count(self, args: tuple) -> None:
        output, inputs, group = args[0], args[1], dist.ProcessGroup.unbox(args[2])
        if group.group_name not in self.ep_groups:
            self.elsewhere += inputs.numel()
            return
        if not inputs.is_floating_point():  # (its output is not read here: the op returns before it completes)
            self.splits += inputs.numel()
            self._after_splits = True
            return
        rank_here = self.ep_groups[group.group_name]
        out_splits, in_splits = list(args[3]), list(args[4])
        row = inputs[0].numel() if inputs.size(0) else 0
        self.sent += inputs.numel()
        self.leaving += inputs.numel() - (in_splits[rank_here] * row if in_splits else inputs.numel() // group.size())
        signature = (tuple(in_splits), tuple(out_splits))
        if self._after_splits:
            self.received += sum(out_splits)
            self._after_splits = False
        if self.calls % 2 == 0:  # sends this rank's own pairs
            self.own_out += inputs.numel()
            self._out_signatures.add(signature)
        else:  # returns them: the output holds this rank's pairs
            self.own_back += output.numel()
            if signature in self._out_signatures and in_splits != out_splits:
                self.misordered += 1
        self.calls += 1


class CountAllToAll(L.Callback):
    """Runs `AllToAllCounter` over the training batches ``first`` .. ``first + steps - 1`` (not those of the memory
    tracker: dispatch modes are a stack, and the two would not nest)."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.per_step: list[dict[str, int]] = []
        self._mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first <= batch_idx < self.first + self.steps:
            groups = {m.group.group_name: dist.get_rank(m.group) for m in iter_expert_modules(pl_module)}
            self._mode = AllToAllCounter(groups)
            self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            m, self._mode = self._mode, None
            self.per_step.append({k: getattr(m, k) for k in (
                "calls", "sent", "leaving", "own_out", "own_back", "splits", "received", "elsewhere", "misordered")})


def resident_peak() -> int:
    """This process's resident-set peak in bytes (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(layout: dict, cfg: dict) -> dict:
    """Runs in each spawned rank: one fit; returns this rank's measurements."""
    warnings.filterwarnings("ignore")
    for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid", "transformers"):
        logging.getLogger(logger_name).setLevel(logging.ERROR)
    from lightning_hybrid.hf import CausalLM

    L.seed_everything(0, verbose=False)
    strategy = HybridStrategy(dp=layout["dp"], tp=layout["tp"], ep=layout["ep"], zero_stage=layout["zero"])
    module = CausalLM(mixtral_config(cfg["model"]), lr=1e-3)
    data = ByteCorpusDataModule(max_bytes=cfg["max_bytes"], block_size=cfg["model"]["block_size"],
                                batch_size=cfg["batch"])
    m, c, w, s = cfg["measure_steps"], cfg["count_steps"], cfg["warmup"], cfg["steps"]
    # batch 0: untracked; 1 .. m: memory; then c counted, w warm-up, s timed
    monitor, counter, timer = SteadyPeakMemoryMonitor(m, skip=1), CountAllToAll(1 + m, c), StepTimer(1 + m + c + w)
    trainer = L.Trainer(
        accelerator="cpu", devices=layout["dp"] * layout["tp"], strategy=strategy, max_steps=1 + m + c + w + s,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor, counter, timer],
    )
    trainer.fit(module, data)
    loss = trainer.callback_metrics.get("train_loss")
    expert_params = sum(p.numel() for _, e in find_experts(module.model) for p in e.parameters(recurse=False))
    state_kinds = ("parameters", "gradients", "optimizer_state")
    ep_ranks = sorted({tuple(dist.get_process_group_ranks(e.group)) for e in iter_expert_modules(module)})
    return {
        "rank": dist.get_rank(), "expert_params": expert_params, "ep_ranks": list(ep_ranks[0]) if ep_ranks else [],
        "params": sum(p.numel() for p in module.parameters()),
        "total": monitor.peak.total, "breakdown": monitor.peak.breakdown,
        "state": sum(monitor.peak.after_step[k] for k in state_kinds),
        "state_breakdown": {k: monitor.peak.after_step[k] for k in state_kinds},
        "a2a": counter.per_step, "times": timer.times, "cpu": timer.cpu, "resident": resident_peak(),
        "loss": float(loss) if loss is not None else float("nan"), "proc_cpu_s": cpu_s(resource.RUSAGE_SELF),
    }


# ---------------------------------------------------------------------------------------------- in the parent
def run_one(layout: dict, cfg: dict) -> dict:
    """One layout in a fresh process group; a failure becomes ``{"error": last traceback line}``."""
    world = layout["dp"] * layout["tp"]
    busy0, own0, t0 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        ranks = run_distributed(worker, world, layout, cfg)
    except Exception as err:  # noqa: BLE001  (reported in the table)
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else repr(err))[:300], "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    busy1, own1 = system_busy_s(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    ours = max(own1 - own0, sum(r["proc_cpu_s"] for r in ranks))
    n = min(len(r["times"]) for r in ranks)
    return {
        "ranks": ranks, "wall_s": wall,
        "step_s": statistics.fmean(max(r["times"][i] for r in ranks) for i in range(n)) if n else float("nan"),
        "cpu_s": statistics.fmean(sum(r["cpu"][i] for r in ranks) for i in range(n)) if n else float("nan"),
        "other_load": max(0.0, (busy1 - busy0 - ours) / wall) if None not in (busy0, busy1) else float("nan"),
    }


def expert_state_bytes(stage: int, ep: int, dp: int, pe: int) -> float:
    """Bytes per rank of the experts' fp32 params + grads + AdamW state under ZeRO ``stage`` and ``ep``."""
    params = 4 * pe / (dp if stage >= 3 else ep)
    grads = 4 * pe / (dp if stage >= 2 else ep)
    optim = 8 * pe / (dp if stage >= 1 else ep)
    return params + grads + optim


def layout_name(layout: dict) -> str:
    name = "dp2" if layout["tp"] == 1 else "dp2xtp2"
    return f"{name} ep{layout['ep']} ZeRO-{layout['zero']}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--zero-stages", type=int, nargs="+", default=[1, 0], choices=[0, 1, 2, 3],
                   help="ZeRO stages; the first is timed --repeats times, the others run once")
    p.add_argument("--repeats", type=int, default=2, help="runs of each layout at the first stage, interleaved")
    p.add_argument("--measure-steps", type=int, default=2, help="first steps, measured by PeakMemoryMonitor")
    p.add_argument("--count-steps", type=int, default=1, help="steps after those, under the all-to-all counter")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the counted ones")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: hidden 64, intermediate 128, 2 layers, T=32,"
                   " 1 + 1 + 1 + 2 steps")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "MOE.md", help="results file (overwritten)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.block_size = 64, 128, 2, 32
        args.measure_steps, args.count_steps, args.warmup, args.steps = 1, 1, 1, 2
    if min(args.measure_steps, args.count_steps, args.steps) < 1 or args.warmup < 0 or args.experts % 2:
        p.error("--measure-steps, --count-steps, --steps >= 1, --warmup >= 0, an even --experts (ep=2)")
    return args


def one_device_counts(model_cfg: dict) -> tuple[int, int]:
    """(all parameters, expert parameters) of the model built whole on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mixtral_config(model_cfg))
    experts = sum(p.numel() for _, e in find_experts(model) for p in e.parameters(recurse=False))
    return sum(p.numel() for p in model.parameters()), experts


def main(argv=None) -> int:
    args = parse_args(argv)
    model = dict(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                 experts=args.experts, top_k=args.top_k, block_size=args.block_size)
    psi, pe_built = one_device_counts(model)
    pe = args.layers * args.experts * 3 * args.hidden * args.intermediate
    total_steps = 1 + args.measure_steps + args.count_steps + args.warmup + args.steps
    samples = total_steps * args.batch * 2 + 2  # one epoch covers every step at dp=2
    max_bytes = int((samples * args.block_size + 1) / (1 - VAL_FRACTION)) + 4 * args.block_size
    cfg = dict(model=model, batch=args.batch, measure_steps=args.measure_steps, count_steps=args.count_steps,
               warmup=args.warmup, steps=args.steps, max_bytes=max_bytes)
    import transformers

    n_routed = args.batch * args.block_size
    settings = (f"model: transformers MixtralConfig hidden {args.hidden}, intermediate {args.intermediate},"
                f" {args.layers} layers, {args.heads} heads ({args.heads} KV), {args.experts} experts,"
                f" top-{args.top_k},"
                f" vocabulary 256, untied; {psi:,} parameters, of which experts Pe = {pe:,}"
                f" ({pe / psi:.1%}, {4 * pe / MIB:.1f} MiB fp32; formula L*E*3*H*I, counted on the one-device model:"
                f" {pe_built:,}); block T={args.block_size}, per-rank batch {args.batch} (N = {n_routed} tokens routed"
                f" per rank per MoE layer); AdamW fp32; {args.measure_steps} tracked + {args.count_steps} counted +"
                f" {args.warmup} warm-up + {args.steps} timed steps; CPU, gloo, 1 thread per rank; torch"
                f" {torch.__version__}, lightning {L.__version__}, transformers {transformers.__version__},"
                f" {os.cpu_count()} CPUs")
    print(settings, flush=True)
    os.environ.update(MALLOC_ENV)  # before the first launch starts the fork server the ranks are forked from
    runs: list[tuple[dict, list[dict]]] = []
    t_start = time.perf_counter()
    for stage_index, zero in enumerate(args.zero_stages):
        repeats = args.repeats if stage_index == 0 else 1
        for name in args.layouts:
            pair = [(dict(LAYOUTS[name], ep=ep, zero=zero), []) for ep in (1, 2)]
            runs += pair
            for repeat in range(repeats):  # interleaved: ep1 ep2, ep2 ep1, ...
                for layout, results in (pair if repeat % 2 == 0 else pair[::-1]):
                    r = run_one(layout, cfg)
                    results.append(r)
                    line = (f"failed: {r['error']}" if "error" in r else
                            f"step {r['step_s']:.3f}s  CPU/step {r['cpu_s']:.3f}s  peak/rank MiB"
                            f" {' '.join(format(x['total'] / MIB, '.1f') for x in r['ranks'])}"
                            f"  loss {r['ranks'][0]['loss']:.4f}  other load {r['other_load']:.2f}")
                    print(f"  {layout_name(layout):<20} #{repeat + 1} {line}  (run {r['wall_s']:.0f}s)", flush=True)
    total = time.perf_counter() - t_start

    from benchmarks.report import header, write_report

    lines = [header("Expert parallelism: ep=2 against ep=1 (benchmarks/bench_moe.py)").rstrip(), "",
             settings + f"; total wall time {total:.0f}s.", ""]
    lines += report(runs, args, pe, n_routed)
    write_report(args.out, "\n".join(lines) + "\n")
    return 0


def report(runs: list[tuple[dict, list[dict]]], args: argparse.Namespace, pe: int, n_routed: int) -> list[str]:
    ok = lambda r: "error" not in r  # noqa: E731
    verdict = lambda good: "met" if good else "NOT MET"  # noqa: E731
    timed = {(lay["tp"], lay["zero"], lay["ep"]): [r for r in results if ok(r)] for lay, results in runs}
    mean = lambda key, what: statistics.fmean(r[what] for r in timed[key]) if timed.get(key) else None  # noqa: E731
    out = ["## Throughput", "",
           "step s = the slower rank's step time, mean over the timed steps, one figure per run (runs of a layout"
           " interleaved: ep1 ep2, then ep2 ep1); tokens/s = dp * batch * T / the mean of the runs' step times;"
           " ep2 / ep1 = tokens/s against the ep=1 row of the same layout in this run; CPU s = CPU time per step of"
           " all ranks together (process time, all threads: the work done, less sensitive to other load than the"
           " wall time); other load = CPUs other processes kept busy during each run"
           f" (above {MAX_OTHER_LOAD}: disturbed). The dp2xtp2 layouts run 4 ranks on the machine's"
           f" {os.cpu_count()} CPUs.", "",
           "| layout | ranks | step s per run | tokens/s | ep2 / ep1 | CPU s / step | CPU ep2 / ep1"
           " | loss after the run | other load per run | run s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tokens = 2 * args.batch * args.block_size
    for lay, results in runs:
        world = lay["dp"] * lay["tp"]
        errors = [r["error"].replace("|", "/") for r in results if not ok(r)]
        key = (lay["tp"], lay["zero"], lay["ep"])
        if not timed[key]:
            out.append(f"| {layout_name(lay)} | {world} | failed: {errors[0]} |" + " |" * 7)
            continue
        base = (lay["tp"], lay["zero"], 1)
        step, cpu = mean(key, "step_s"), mean(key, "cpu_s")
        ratio = cpu_ratio = ""
        if lay["ep"] == 2 and timed.get(base):
            ratio, cpu_ratio = f"{mean(base, 'step_s') / step:.3f}", f"{mean(base, 'cpu_s') / cpu:.3f}"
        loads = " / ".join(f"{r['other_load']:.2f}" for r in timed[key])
        flag = " (disturbed)" if max(r["other_load"] for r in timed[key]) > MAX_OTHER_LOAD else ""
        failed = f" ({len(errors)} failed: {errors[0]})" if errors else ""
        steps = " / ".join(format(r["step_s"], ".3f") for r in timed[key])
        walls = " / ".join(format(r["wall_s"], ".0f") for r in timed[key])
        out.append(f"| {layout_name(lay)} | {world} | {steps}{failed} | {tokens / step:.0f} | {ratio} | {cpu:.3f} |"
                   f" {cpu_ratio} | {timed[key][0]['ranks'][0]['loss']:.4f} | {loads}{flag} | {walls} |")
    find = {k: v[0] for k, v in timed.items() if v}  # the first run of each layout: memory and traffic
    runs = [(lay, find.get((lay["tp"], lay["zero"], lay["ep"]), results[0] if results else {"error": "not run"}))
            for lay, results in runs]

    out += ["", "## Expert parameters and peak memory per rank", "",
            "expert params = the parameters of the rank's experts modules; formula = Pe / ep. Peak = highest live"
            " tensor bytes over the tracked steps (MiB) and its breakdown at that moment; act = activations,"
            " temp = backward temporaries, opt step = the optimizer step's; state = params + grads + optimizer"
            " state live after the last tracked step; resident = VmHWM over the rank's life"
            " (MALLOC_MMAP_THRESHOLD_=65536).", "",
            "| layout | rank | expert params | formula Pe/ep | equal | all params | peak MiB | params | grads | optim"
            " | act | temp | opt step | other | state MiB | resident MiB |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    params_ok = True
    for lay, r in runs:
        if not ok(r):
            out.append(f"| {layout_name(lay)} | | failed |" + " |" * 13)
            params_ok = False
            continue
        for x in r["ranks"]:
            b = {k: v / MIB for k, v in x["breakdown"].items()}
            expected = pe // lay["ep"]
            equal = x["expert_params"] == expected
            params_ok &= equal
            other = x["total"] / MIB - sum(b[k] for k in ("parameters", "gradients", "optimizer_state", "activations",
                                                            "temporary", "optimizer_step"))
            out.append(f"| {layout_name(lay)} | {x['rank']} | {x['expert_params']:,} | {expected:,} | {equal} |"
                       f" {x['params']:,} | {x['total'] / MIB:.1f} | {b['parameters']:.1f} | {b['gradients']:.1f} |"
                       f" {b['optimizer_state']:.1f} | {b['activations']:.1f} | {b['temporary']:.1f} |"
                       f" {b['optimizer_step']:.1f} | {other:.1f} | {x['state'] / MIB:.1f} |"
                       f" {x['resident'] / MIB:.1f} |")

    out += ["", "## What ep=2 saves per rank", "",
            "expected = the experts' params + grads + AdamW state that a rank no longer holds (see the script's"
            " docstring: ZeRO-1 splits the experts' optimizer state over dp at either ep, so ep saves their params and"
            " grads, 8 Pe (1 - 1/ep) bytes; ZeRO-0 16 Pe (1 - 1/ep)); measured = the ep=1 row minus the ep=2 row,"
            " same rank, on the peak and on the state held between steps (MiB).", "",
            "| layout | rank | expected | peak saved | peak / expected | state saved | state / expected"
            " | peak act+temp ep1 -> ep2 |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for lay, r in runs:
        base = find.get((lay["tp"], lay["zero"], 1))
        if lay["ep"] == 1 or not ok(r) or not base or not ok(base):
            continue
        expected = (expert_state_bytes(lay["zero"], 1, lay["dp"], pe)
                    - expert_state_bytes(lay["zero"], lay["ep"], lay["dp"], pe)) / MIB
        for x, y in zip(base["ranks"], r["ranks"]):
            peak = (x["total"] - y["total"]) / MIB
            state = (x["state"] - y["state"]) / MIB
            act = lambda z: (z["breakdown"]["activations"] + z["breakdown"]["temporary"]) / MIB  # noqa: E731
            out.append(f"| {layout_name(lay)} | {y['rank']} | {expected:.1f} | {peak:.1f} |"
                       f" {peak / expected:.3f} | {state:.1f} | {state / expected:.3f} |"
                       f" {act(x):.1f} -> {act(y):.1f} |")

    formula = 4 * args.layers * n_routed * args.top_k * args.hidden
    H, Nk = args.hidden, args.layers * n_routed * args.top_k
    out += ["", "## All-to-all traffic per step per rank", "",
            "Counted by a TorchDispatchMode on the c10d all-to-alls of the rank's EP group over"
            f" {args.count_steps} step(s), forward and backward, per step. The token all-to-alls come in pairs: one"
            " sends the rank's own (token, expert) pairs (forward: the hidden rows to the experts' ranks; backward:"
            " their output gradients), the next returns them (the expert outputs; the input gradients), so the"
            " rank's own pairs travel out + back = 4 * L * N * k * H elements ="
            f" 4 * {args.layers} * {n_routed} * {args.top_k} * {H} = {formula:,} (self-sends included): 'own out +"
            " back' adds the input of each sending call and the output of each returning one. What a rank itself"
            " puts into the all-to-alls ('sent', every input) is its own pairs out, 2 * L * N * k * H, plus the"
            " rows its experts received, R (from the dispatch's split sizes), returned: 2 * H * (L * N * k + R);"
            " it equals the formula only where R = L * N * k, and over an EP group the sum is ep * formula."
            " leaving = the part of 'sent' not addressed to the rank itself, against (ep-1)/ep of the formula"
            " (uniform routing). split sizes = the integer count exchanges (E per layer, forward); elsewhere ="
            " all-to-all elements on any other group. ep=1 runs issue none.", "",
            "| layout | rank | a2a calls | own out + back | formula 4LNkH | equal | sent | R | 2H(LNk + R) | equal"
            " | leaving | uniform (ep-1)/ep * formula | leaving / uniform | split sizes | elsewhere |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    a2a_ok = sent_ok = group_ok = True
    misordered = 0
    for lay, r in runs:
        if not ok(r):
            a2a_ok = a2a_ok and lay["ep"] == 1
            continue
        ep = lay["ep"]
        for x in r["ranks"]:
            steps = x["a2a"]
            if not steps:
                a2a_ok = False
                continue
            st = {k: statistics.fmean(d[k] for d in steps) for k in steps[0]}
            misordered += sum(d["misordered"] for d in steps)
            if ep == 1:
                zero = st["sent"] == 0 and st["splits"] == 0 and st["elsewhere"] == 0
                a2a_ok &= zero
                out.append(f"| {layout_name(lay)} | {x['rank']} | {st['calls']:.0f}"
                           f" | {st['own_out'] + st['own_back']:,.0f} | 0 | {zero} | {st['sent']:,.0f} | | | | | | |"
                           f" {st['splits']:,.0f}"
                           f" | {st['elsewhere']:,.0f} |")
                continue
            own = [d["own_out"] + d["own_back"] for d in steps]
            equal = all(v == formula for v in own)
            exact = [2 * H * (Nk + d["received"]) for d in steps]
            sent_equal = all(d["sent"] == e for d, e in zip(steps, exact))
            a2a_ok &= equal and st["elsewhere"] == 0
            sent_ok &= sent_equal
            uniform = (ep - 1) / ep * formula
            out.append(f"| {layout_name(lay)} | {x['rank']} | {st['calls']:.0f} | {statistics.fmean(own):,.0f} |"
                       f" {formula:,} | {equal} | {st['sent']:,.0f} | {st['received']:,.0f} |"
                       f" {statistics.fmean(exact):,.0f} | {sent_equal} | {st['leaving']:,.0f} | {uniform:,.0f} |"
                       f" {st['leaving'] / uniform:.3f} | {st['splits']:,.0f} | {st['elsewhere']:,.0f} |")
        if ep > 1:  # the sum over each EP group (the global ranks of the experts' group, as each rank reported it)
            groups: dict[tuple, list[dict]] = {}
            for x in r["ranks"]:
                groups.setdefault(tuple(x["ep_ranks"]), []).append(x)
            for members in groups.values():
                group_ok &= len(members) == ep and all(
                    sum(m["a2a"][i]["sent"] for m in members) == ep * formula for i in range(len(members[0]["a2a"])))
    if misordered:
        out.append("")
        out.append(f"Note: {misordered} returning call(s) had the split sizes of a sending call: the pairing by call"
                   " order did not hold there, and 'own out + back' is not to be trusted.")
    out += ["", "## Goals", "",
            f"- Expert parameters per rank = Pe / ep on every rank of every layout: {verdict(params_ok)}",
            f"- All-to-all elements of each rank's own (token, expert) pairs, out + back, forward + backward, per step"
            f" = 4 * L * N * k * H ({formula:,}) on every rank of every ep=2 layout, and no all-to-all at ep=1:"
            f" {verdict(a2a_ok and not misordered)}",
            f"- All-to-all input elements of each EP group per step = ep * 4 * L * N * k * H: {verdict(group_ok)};"
            f" of each rank = 2 * H * (L * N * k + R), R the rows its experts received: {verdict(sent_ok)}"
            " (= 4 * L * N * k * H only where the routing sends a rank's experts exactly L * N * k rows)", ""]
    speed = []
    for lay, _ in runs:
        key, base = (lay["tp"], lay["zero"], 2), (lay["tp"], lay["zero"], 1)
        if lay["ep"] == 2 and timed.get(key) and timed.get(base):
            load = max(r["other_load"] for r in timed[key] + timed[base])
            flag = f", disturbed: other load up to {load:.2f} CPUs" if load > MAX_OTHER_LOAD else ""
            speed.append(f"{layout_name(lay).replace(' ep2', '')} {mean(base, 'step_s') / mean(key, 'step_s'):.3f}"
                         f" (CPU time {mean(base, 'cpu_s') / mean(key, 'cpu_s'):.3f}; {len(timed[key])} run(s)"
                         f"{flag})")
    out.append("Speed, ep2 / ep1 tokens/s (no goal; on this shared 2-core CPU machine, gloo): "
               + ("; ".join(speed) if speed else "not compared") + ".")
    return out + [""]


if __name__ == "__main__":
    sys.exit(main())
