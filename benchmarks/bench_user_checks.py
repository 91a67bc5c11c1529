"""What the checks of what users write cost (docs/correctness.md, "What the strategy verifies"), against a step.

    python benchmarks/bench_user_checks.py [--steps 40]

For each layout (2 processes on the CPU, the reference GPT of 4 layers, 256 wide, sequences of 256, 8 rows per
data-parallel rank): the median time of a training step (after the first three), the time of the first step's
probe (`lightning_hybrid.checks.probe.FirstStepProbe`: the model run whole and split, once), and the time of one batch
check (`lightning_hybrid.checks.batch_check.BatchCheck.check` on a checked batch: the fingerprint and one all-gather,
on the first 3 batches and every 100th). The table is written to benchmarks/USER_CHECKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402

from benchmarks.report import printed_to  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.checks.batch_check import BatchCheck  # noqa: E402
from lightning_hybrid.checks.probe import FirstStepProbe  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.models import GPTLightningModule  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2), "dp2": dict(dp=2), "cp2": dict(dp=1, cp=2), "pp2": dict(pp=2, micro_batches=2)}


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self.start)


def _timed(cls: type, name: str, spent: dict[str, list[float]]) -> None:
    """``cls.name`` wrapped so that each call's time is added to ``spent[name]``."""
    original = getattr(cls, name)

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent.setdefault(name, []).append(time.perf_counter() - start)

    setattr(cls, name, timed)


def _measure(steps: int) -> dict[str, tuple[float, float, float, int]]:
    warnings.filterwarnings("ignore")
    spent: dict[str, list[float]] = {}
    _timed(FirstStepProbe, "__call__", spent)
    _timed(BatchCheck, "check", spent)
    out = {}
    for name, kwargs in LAYOUTS.items():
        spent.clear()
        timer = StepTimes()
        dp = kwargs.get("dp", 1 if kwargs.get("tp", 1) * kwargs.get("pp", 1) > 1 else 2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(**kwargs), max_steps=steps,
                            limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[timer])
        trainer.fit(GPTLightningModule(n_layer=4, n_head=8, n_embd=256, block_size=256),
                    ByteCorpusDataModule(max_bytes=600_000, block_size=256, batch_size=16 // dp))
        probe = sum(spent.get("__call__", []))
        # The checked batches: the first three (time the later ones of them: the first includes warm-up).
        checks = spent.get("check", [])
        checked = sorted(checks)[-3:] if checks else []
        out[name] = (statistics.median(timer.times[3:]), probe, statistics.median(checked) if checked else 0.0,
                     len(checks))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_distributed(_measure, 2, args.steps)[0]
    with printed_to(REPO_ROOT / "benchmarks" / "USER_CHECKS.md",
                    "What the checks of what users write cost (benchmarks/bench_user_checks.py)"):
        print("| layout (2 ranks) | step, ms (median) | first-step probe, ms (once) | probe / step |"
              " batch check, ms (per checked batch) | batch check / step |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, (step, probe, check, _calls) in results.items():
            print(f"| {name} | {1e3 * step:.0f} | {1e3 * probe:.0f} | {probe / step:.2f} |"
                  f" {1e3 * check:.2f} | {100 * check / step:.2f}% |")
        print("\nThe probe runs once, at the first step (cp: the first row whole and split; dp, pp: two rows"
              " together and one alone). A batch check runs on the first 3 batches and every 100th after"
              f" (batch_check_interval): over a {args.steps}-step run about 3 of them; over 10,000 steps about"
              " 1 in 100. Layouts without peers that share a batch (dp2) check none.")


if __name__ == "__main__":
    main()
