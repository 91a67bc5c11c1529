"""Summary of a layout sweep: every job's ``metrics.json`` in a multirun folder -> ``summary.md``,
``summary.csv`` and ``summary.png`` (tokens/s and peak memory per layout), the fastest layout marked.

    python -m lightning_hybrid.runs.sweep MULTIRUN_DIR

Also run automatically at the end of a recipe's multirun (``python recipes/pretrain.py -m ...``) by
:class:`SweepSummaryCallback` (configured under ``hydra.callbacks`` in ``configs/pretrain.yaml``). The PNG needs
matplotlib, which is not a dependency of this package: without it the PNG is skipped with a message.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.experimental.callback import Callback as _HydraCallback

__all__ = ["SweepSummaryCallback", "collect_metrics", "main", "ranks", "spearman", "write_summary"]

COLUMNS = ("job", "layout", "name", "model", "world_size", "dp", "tp", "pp", "zero_stage", "steps", "val_loss",
           "tokens_per_s", "predicted_tokens_per_s", "measured_rank", "planner_rank", "mfu", "peak_mib_max",
           "predicted_peak_mib", "overrides")


def collect_metrics(multirun_dir: Path) -> List[Dict[str, Any]]:
    """Every ``metrics.json`` below ``multirun_dir`` (job dirs ``0``, ``1``, ...), ordered by job dir."""
    multirun_dir = Path(multirun_dir)
    rows = []
    for path in multirun_dir.rglob("metrics.json"):
        rel = path.parent.relative_to(multirun_dir).as_posix() or "."
        data = json.loads(path.read_text())
        data["job"] = rel
        rows.append(data)

    def key(row: Dict[str, Any]) -> Any:
        parts = row["job"].split("/")
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts]

    rows.sort(key=key)
    return rows


def _fastest(rows: List[Dict[str, Any]]) -> Optional[int]:
    speeds = [(r.get("tokens_per_s"), i) for i, r in enumerate(rows)]
    speeds = [(s, i) for s, i in speeds if isinstance(s, (int, float)) and math.isfinite(s)]
    return max(speeds)[1] if speeds else None


def ranks(values: List[Optional[float]]) -> List[Optional[int]]:
    """1 for the highest of ``values``, 2 for the next, ...; ``None`` where a value is missing."""
    known = sorted((v for v in values if isinstance(v, (int, float)) and math.isfinite(v)), reverse=True)
    return [known.index(v) + 1 if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]


def spearman(xs: List[float], ys: List[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties ranked by order of appearance)."""
    n = len(xs)
    rx, ry = ranks(list(xs)), ranks(list(ys))
    mean = (n + 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var = sum((a - mean) ** 2 for a in rx) ** 0.5 * sum((b - mean) ** 2 for b in ry) ** 0.5
    return cov / var if var else float("nan")


def _add_ranks(rows: List[Dict[str, Any]]) -> Optional[float]:
    """Each row's rank by measured and by predicted tokens/s (the planner's, `lightning_hybrid.planner`);
    returns their Spearman correlation over the rows that have both (None with fewer than 3)."""
    for key, column in (("tokens_per_s", "measured_rank"), ("predicted_tokens_per_s", "planner_rank")):
        for row, rank in zip(rows, ranks([r.get(key) for r in rows])):
            row[column] = rank
    both = [r for r in rows if r["measured_rank"] is not None and r["planner_rank"] is not None]
    if len(both) < 3:
        return None
    return spearman([r["tokens_per_s"] for r in both], [r["predicted_tokens_per_s"] for r in both])


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_summary(multirun_dir: Path, out_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Write ``summary.md``, ``summary.csv`` and (with matplotlib) ``summary.png``; return what was written."""
    multirun_dir = Path(multirun_dir)
    out_dir = Path(out_dir) if out_dir is not None else multirun_dir
    rows = collect_metrics(multirun_dir)
    written: Dict[str, Any] = {"jobs": len(rows), "files": []}
    if not rows:
        print(f"sweep summary: no metrics.json under {multirun_dir}", file=sys.stderr)
        return written
    best = _fastest(rows)
    written["fastest"] = rows[best]["job"] if best is not None else None
    written["spearman"] = rho = _add_ranks(rows)

    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(COLUMNS) + ["fastest"])
        for i, r in enumerate(rows):
            writer.writerow([r.get(c, "") if r.get(c) is not None else "" for c in COLUMNS] + [int(i == best)])
    written["files"].append(str(out_dir / "summary.csv"))

    lines = [
        f"# Layout sweep: {multirun_dir}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for i, r in enumerate(rows):
        cells = [_fmt(r.get(c)) for c in COLUMNS]
        if i == best:
            cells[1] = f"**{cells[1]}** (fastest)"
        lines.append("| " + " | ".join(cells) + " |")
    if best is not None:
        b = rows[best]
        lines += ["", f"Fastest: **{b['layout']}** (job {b['job']}), {b['tokens_per_s']:.0f} tokens/s."]
    lines += ["",
              "tokens/s: global training tokens per second (Lightning's ThroughputMonitor over the last 100 steps or",
              "fewer, the first excluded); mfu: model FLOPs utilisation where the device's peak is known (CUDA);",
              "peak_mib_max: max over ranks of the peak of live tensor bytes during the first training steps"
              " (lightning_hybrid.runs.memory).",
              "predicted_*: the planner's prediction for the job's layout on this machine (lightning_hybrid.planner);",
              "measured_rank / planner_rank: 1 = the most tokens/s measured / predicted among these jobs."]
    if rho is not None:
        lines += ["", f"Spearman rank correlation of predicted and measured tokens/s: {rho:.2f}."]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    written["files"].append(str(out_dir / "summary.md"))

    png = _plot(rows, best, out_dir / "summary.png")
    if png is not None:
        written["files"].append(png)
    print(f"sweep summary: {len(rows)} jobs -> " + ", ".join(written["files"]))
    return written


def _plot(rows: List[Dict[str, Any]], best: Optional[int], path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep summary: matplotlib is not installed, skipping summary.png (pip install matplotlib)")
        return None
    labels = [f"{r['job']}: {r['layout']}" for r in rows]
    speed = [r.get("tokens_per_s") or 0.0 for r in rows]
    mem = [r.get("peak_mib_max") or 0.0 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4))
    panels = ((axes[0], speed, "predicted_tokens_per_s", "tokens/s (higher is better)", "tab:blue"),
              (axes[1], mem, "predicted_peak_mib", "peak memory per rank, max [MiB]", "tab:orange"))
    for ax, values, key, title, color in panels:
        predicted = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar([i - 0.2 for i in range(len(rows))], values, width=0.4, color=color, label="measured")
        ax.bar([i + 0.2 for i in range(len(rows))], predicted, width=0.4, color="none", edgecolor=color,
               label="predicted (planner)")
        ax.legend(fontsize=8)
        if best is not None:
            bars[best].set_edgecolor("black")
            bars[best].set_linewidth(2.5)
            bars[best].set_hatch("//")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    if best is not None:
        axes[0].annotate("fastest", (best - 0.2, speed[best]), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


class SweepSummaryCallback(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback: write the sweep summary once all jobs of a multirun have returned."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        try:
            write_summary(Path(config.hydra.sweep.dir))
        except Exception as err:  # a summary failure must not hide the jobs' own results
            print(f"sweep summary failed: {err}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m lightning_hybrid.runs.sweep MULTIRUN_DIR", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_dir():
        print(f"error: not a directory: {path}", file=sys.stderr)
        return 2
    return 0 if write_summary(path)["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
