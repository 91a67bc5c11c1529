"""Pipeline efficiency of `HybridStrategy(pp=2)` on CPU: step time against one process, and activation memory.

    python benchmarks/bench_pipeline.py                 # full run (~5-6 min on 2 cores)
    python benchmarks/bench_pipeline.py --quick         # smoke run (~1.5 min)
    python benchmarks/bench_pipeline.py --steps 8 --layers 8 --micro-batches 4 8 16 --schedules gpipe 1f1b zero_bubble

Same model (GPT, SwiGLU), same global batch, one thread per process (``torch.set_num_threads(1)`` in every rank):

  pp=1      one process runs the whole global batch in one forward/backward (the baseline, time T1)
  pp=1 /m   one process runs the same batch as m sequential micro-batches (gradients accumulated; manual
            optimization), time T1(m): what micro-batching alone costs, without any pipeline
  pp=2      `HybridStrategy(pp=2, schedule=s, micro_batches=m)`, 2 processes (both cores), time T2(s, m)

speed-up           = T1 / T2
ideal              = p*m / (m + p - 1)   (p = 2: the bubble of a synchronous pipeline with equal stages)
vs ideal           = speed-up / ideal    (goal: >= 0.9 for 1f1b at m=16; zero_bubble above 1f1b)
vs ideal (µb)      = (T1(m) / T2) / ideal from min step times: micro-batching cost taken out
busy               = per-rank process CPU time / wall step time (1.0 = the rank never waited)
work               = (CPU time of both pp ranks) / (CPU time of the pp=1 run): > 1 is work the pipeline added

Step time: a callback takes `time.perf_counter()` at on_train_batch_start and on_train_batch_end (forward,
backward of every micro-batch, optimizer step); per step the slower rank counts; the median over the measured
steps after ``--warmup`` steps is reported.

Activation memory: for one extra step after the timed ones, `torch.autograd.graph.saved_tensors_hooks` count
the bytes of the tensors autograd saves for backward (distinct storages, parameters excluded) that are alive at
the same time, on each rank; the peak is reported. The schedules run forward and backward inside the step on
the same thread, so the hooks see every micro-batch's saved activations (the pipelining library's own
buffers for received activations/gradients are not counted).

All pp=2 configurations run one after the other inside one 2-process session (one spawn, one process group),
and all pp=1 configurations inside one 1-process session: process start-up is paid twice, not 13 times.
The machine has 2 cores: other processes running meanwhile distort the numbers; the load other processes put
on the machine during each session is measured (/proc/stat) and printed.
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
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks.machine_load import cpu_s, system_busy_s  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.models import GPT, GPTConfig, GPTLightningModule  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

PP = 2
SCHEDULES = ("gpipe", "1f1b", "zero_bubble")
GOAL_1F1B = 0.9


# ---------------------------------------------------------------------------------------------- data
class RandomTokens(Dataset):
    """Deterministic random byte tokens: (x, y) with y = x shifted by one. No file reading in the timed loop."""

    def __init__(self, n: int, block_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (n, block_size + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        row = self.data[i]
        return row[:-1], row[1:]


# ---------------------------------------------------------------------------------------------- models
class ChunkedGPT(GPTLightningModule):
    """pp=1 with the batch run as ``chunks`` sequential micro-batches (gradient accumulation in one step)."""

    def __init__(self, chunks: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.chunks = chunks
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(batch[0].chunk(self.chunks), batch[1].chunk(self.chunks)):
            loss = self.loss_fn(self(x), y) / self.chunks
            self.manual_backward(loss)
            total += loss.detach()
        opt.step()
        return total


# ---------------------------------------------------------------------------------------------- measurement
class SavedActivationMeter:
    """Counts the bytes of tensors saved for backward that are alive at once (distinct storages; parameter
    storages excluded) while the context is active; ``peak`` is the maximum seen."""

    def __init__(self, params) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        try:
            s = t.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
        except Exception:  # e.g. a tensor subclass without storage
            return _Handle(self, t, None, 0)
        if ptr in self.param_ptrs or nbytes == 0:
            return _Handle(self, t, None, 0)
        n = self.refs.get(ptr, 0)
        self.refs[ptr] = n + 1
        if n == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return _Handle(self, t, ptr, nbytes)

    @staticmethod
    def _unpack(handle):
        return handle.t

    def _release(self, ptr: int, nbytes: int) -> None:
        n = self.refs[ptr] - 1
        if n == 0:
            del self.refs[ptr]
            self.live -= nbytes
        else:
            self.refs[ptr] = n

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Handle:
    __slots__ = ("meter", "t", "ptr", "nbytes")

    def __init__(self, meter, t, ptr, nbytes) -> None:
        self.meter, self.t, self.ptr, self.nbytes = meter, t, ptr, nbytes

    def __del__(self) -> None:
        if self.ptr is not None:
            self.meter._release(self.ptr, self.nbytes)


class StepProbe(L.Callback):
    """Wall and CPU time of every training batch; saved-activation peak during batch ``memory_step``."""

    def __init__(self, memory_step: int, profile_step: int | None = None) -> None:
        self.memory_step, self.profile_step = memory_step, profile_step
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.busy: list[float] = []  # machine-wide busy CPU-seconds during the step (all processes)
        self.act_peak = 0
        self.profile: str | None = None
        self._meter: SavedActivationMeter | None = None
        self._prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.memory_step:
            self._meter = SavedActivationMeter(pl_module.parameters()).__enter__()
        if batch_idx == self.profile_step:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]).__enter__()
        self._t = (time.perf_counter(), time.process_time(), system_busy_s() or 0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        wall, cpu = time.perf_counter() - self._t[0], time.process_time() - self._t[1]
        busy = (system_busy_s() or 0.0) - self._t[2]
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.act_peak = self._meter.peak
            self._meter = None
        elif self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.profile = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
            self._prof = None
        else:
            self.wall.append(wall)
            self.cpu.append(cpu)
            self.busy.append(busy)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _fit(module, strategy, devices: int, cfg: dict, profile: bool = False) -> dict:
    L.seed_everything(0, verbose=False)
    n_steps = cfg["warmup"] + cfg["steps"] + 1 + int(profile)  # + 1: the memory step (+ 1: the profiled step)
    data = DataLoader(RandomTokens(n_steps * cfg["global_batch"], cfg["model"]["block_size"]),
                      batch_size=cfg["global_batch"], shuffle=False)
    probe = StepProbe(memory_step=cfg["warmup"] + cfg["steps"], profile_step=n_steps - 1 if profile else None)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=n_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(module, train_dataloaders=data)
    w = cfg["warmup"]
    loss = trainer.callback_metrics.get("train_loss")
    return {"wall": probe.wall[w:], "cpu": probe.cpu[w:], "busy": probe.busy[w:], "act_peak": probe.act_peak,
            "profile": probe.profile,
            "loss": float(loss) if loss is not None else float("nan"), "threads": torch.get_num_threads()}


def pp1_worker(cfg: dict) -> dict:
    """One process: the full-batch baseline and the micro-batched variants."""
    _quiet()
    out = {}
    for m in [1, *cfg["micro_batches"]]:
        module = (GPTLightningModule(config=GPTConfig(**cfg["model"]), lr=1e-3) if m == 1
                  else ChunkedGPT(m, config=GPTConfig(**cfg["model"]), lr=1e-3))
        out[m] = _fit(module, "auto", 1, cfg, profile=cfg["profile"] and m == max(cfg["micro_batches"]))
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def pp2_worker(cfg: dict) -> dict:
    """Each of the 2 pipeline ranks: every (schedule, m) configuration, one fit each."""
    _quiet()
    out = {}
    for schedule in cfg["schedules"]:
        for m in cfg["micro_batches"]:
            strategy = HybridStrategy(pp=PP, schedule=schedule, micro_batches=m)
            module = GPTLightningModule(config=GPTConfig(**cfg["model"]), lr=1e-3)
            profile = cfg["profile"] and m == max(cfg["micro_batches"])
            out[(schedule, m)] = _fit(module, strategy, PP, cfg, profile=profile)
    return out


# ---------------------------------------------------------------------------------------------- driver
def _session(fn, world: int, cfg: dict):
    busy0, own0, t0 = system_busy_s(), cpu_s(resource.RUSAGE_CHILDREN), time.perf_counter()
    res = run_distributed(fn, world, cfg)
    wall = time.perf_counter() - t0
    busy1, own1 = system_busy_s(), cpu_s(resource.RUSAGE_CHILDREN)
    other = (busy1 - busy0 - (own1 - own0)) / wall if busy0 is not None and busy1 is not None else float("nan")
    return res, wall, max(0.0, other)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration (after warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (n_layer)")
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (multiple of every m)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--profile", action="store_true",
                   help="also profile one step (torch.profiler, rank 0) of 1f1b and of pp=1 /m at the largest m")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 layers, m in {4, 8}, 3 timed steps")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.warmup, args.micro_batches = 4, 3, 1, [4, 8]
    bad = [m for m in args.micro_batches if args.global_batch % m or m < PP]
    if bad:
        p.error(f"--global-batch {args.global_batch} must be a multiple of every micro-batch count >= {PP}; bad: {bad}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = dict(vocab_size=256, block_size=args.block_size, n_layer=args.layers, n_head=args.n_head,
                 n_embd=args.n_embd, mlp="swiglu", dropout=0.0)
    cfg = dict(model=model, global_batch=args.global_batch, steps=args.steps, warmup=args.warmup,
               micro_batches=list(args.micro_batches), schedules=list(args.schedules), profile=args.profile)
    n_params = GPT(GPTConfig(**model)).num_parameters()
    print(f"model: GPT n_layer={args.layers} n_embd={args.n_embd} n_head={args.n_head} block_size={args.block_size}"
          f" swiglu ({n_params / 1e6:.2f}M params); global batch {args.global_batch} sequences;"
          f" {args.warmup} warmup + {args.steps} timed steps (+1 memory step) per configuration;"
          f" torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs", flush=True)

    t_start = time.perf_counter()
    r1, wall1, other1 = _session(pp1_worker, 1, cfg)
    r1 = r1[0]
    print(f"pp=1 session: {wall1:.0f}s, other processes kept {other1:.2f} CPUs busy meanwhile", flush=True)
    r2, wall2, other2 = _session(pp2_worker, PP, cfg)
    print(f"pp=2 session: {wall2:.0f}s, other processes kept {other2:.2f} CPUs busy meanwhile", flush=True)
    assert r1[1]["threads"] == 1 and all(r[k]["threads"] == 1 for r in r2 for k in r), "one thread per process"

    med = statistics.median

    def other_load(ranks: list[dict], i: int, wall: float) -> float:
        """CPUs kept busy by other processes during step i (machine busy time minus this run's CPU time)."""
        return max(0.0, (max(r["busy"][i] for r in ranks) - sum(r["cpu"][i] for r in ranks)) / wall)

    def times(ranks: list[dict]) -> dict:
        n = min(len(r["wall"]) for r in ranks)
        walls = [max(r["wall"][i] for r in ranks) for i in range(n)]  # the slower rank per step
        return dict(med=med(walls), min=min(walls), cpu=[med(r["cpu"]) for r in ranks],
                    other=med(other_load(ranks, i, walls[i]) for i in range(n)))

    base = times([r1[1]])
    t1, t1min, c1 = base["med"], base["min"], base["cpu"][0]
    print()
    print(f"pp=1 baseline (full batch): step {t1 * 1e3:.0f} ms median, {t1min * 1e3:.0f} ms min (CPU {c1 * 1e3:.0f} ms;"
          f" other processes {base['other']:.2f} CPUs), saved activations {r1[1]['act_peak'] / 2**20:.1f} MiB")
    chunked = {m: times([r1[m]]) for m in args.micro_batches}
    print("pp=1 as m sequential micro-batches: " + ", ".join(
        f"m={m}: {chunked[m]['med'] * 1e3:.0f} ms (min {chunked[m]['min'] * 1e3:.0f},"
        f" CPU {chunked[m]['cpu'][0] * 1e3:.0f})"
        for m in args.micro_batches))
    print()
    print("| schedule | m | step ms pp=2 median (min) | speed-up median (min) | ideal | vs ideal median (min) |"
          " vs ideal (µb) | busy r0/r1 | work | other CPUs | act. peak MiB r0/r1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for s in args.schedules:
        for m in args.micro_batches:
            ranks = [r[(s, m)] for r in r2]
            t = times(ranks)
            ideal = PP * m / (m + PP - 1)
            sp, spmin = t1 / t["med"], t1min / t["min"]
            table[(s, m)] = dict(speedup=sp, speedup_min=spmin, eff=sp / ideal, eff_min=spmin / ideal,
                                 act=[r["act_peak"] for r in ranks])
            print(f"| {s} | {m} | {t['med'] * 1e3:.0f} ({t['min'] * 1e3:.0f}) | {sp:.2f} ({spmin:.2f}) | {ideal:.2f} |"
                  f" {sp / ideal:.2f} ({spmin / ideal:.2f}) | {chunked[m]['min'] / t['min'] / ideal:.2f} |"
                  f" {t['cpu'][0] / t['med']:.2f} / {t['cpu'][1] / t['med']:.2f} | {sum(t['cpu']) / c1:.2f} |"
                  f" {t['other']:.2f} | {ranks[0]['act_peak'] / 2**20:.1f} / {ranks[1]['act_peak'] / 2**20:.1f} |")
    if args.profile:
        mmax = max(args.micro_batches)
        for title, res in ((f"pp=1 /{mmax}", r1[mmax]), (f"pp=2 1f1b m={mmax}, rank 0", r2[0].get(("1f1b", mmax)))):
            if res and res.get("profile"):
                print(f"\nprofile of one step, {title}:\n{res['profile']}")
    print()
    # ------------------------------------------------------------------ verdicts
    if "gpipe" in args.schedules and "1f1b" in args.schedules:
        print("activation peak 1f1b / gpipe (max over ranks; rank 0 = first stage):")
        for m in args.micro_batches:
            a, g = table[("1f1b", m)]["act"], table[("gpipe", m)]["act"]
            print(f"  m={m}: {max(a) / max(g):.2f}  (rank 0 {a[0] / g[0]:.2f}, rank 1 {a[1] / g[1]:.2f})")
    if "1f1b" in args.schedules:
        m = max(args.micro_batches)
        e, emin = table[("1f1b", m)]["eff"], table[("1f1b", m)]["eff_min"]
        print(f"1f1b at m={m}: {e:.2f} of ideal (median; {emin:.2f} from min step times) ->"
              f" {'meets' if e >= GOAL_1F1B else 'MISSES'} the >= {GOAL_1F1B} goal")
        if "zero_bubble" in args.schedules:
            for m in args.micro_batches:
                z, f = table[("zero_bubble", m)]["speedup"], table[("1f1b", m)]["speedup"]
                zm, fm = table[("zero_bubble", m)]["speedup_min"], table[("1f1b", m)]["speedup_min"]
                print(f"zero_bubble vs 1f1b at m={m}: speed-up {z:.2f} vs {f:.2f} (min: {zm:.2f} vs {fm:.2f}) ->"
                      f" zero_bubble {'above' if z > f else 'NOT above'} 1f1b")
    if max(other1, other2) > 0.25:
        print(f"WARNING: other processes kept up to {max(other1, other2):.2f} of the {os.cpu_count()} CPUs busy during"
              " the measurement; step times (not CPU times) are inflated by that contention.")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    from benchmarks.report import printed_to

    with printed_to(REPO_ROOT / "benchmarks" / "PIPELINE.md", "Pipeline schedules (benchmarks/bench_pipeline.py)"):
        code = main()
    sys.exit(code)
