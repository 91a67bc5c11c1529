"""`benchmarks/gpu_check.py` runs whenever a GPU is lent, by someone who cannot fix it there: its CPU smoke run (the
same sections, tiny models, on the CPU) must go through with every row ok, so that a change to the package that
would break the script is seen here first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_through_on_the_cpu(tmp_path):
    out = tmp_path / "GPU_CHECK.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out),
         "--log-dir", str(tmp_path / "logs"), "--budget-s", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and not line.startswith("| section")]
    statuses = {line.split(" | ")[2].strip() for line in rows if line.count(" | ") >= 3}
    assert rows and statuses <= {"ok", "match", "info", "skipped (no CUDA)"}, "\n".join(rows)
    assert {line.split(" | ")[0].strip("| ") for line in rows} == {"a", "b", "c", "d"}, "\n".join(rows)
