"""The data path at scale (docs/data.md, "Corpora of any size"): preparing a large corpus, training from its shards,
and resuming a run.

    python benchmarks/bench_data.py [--large-mb 1024] [--small-mb 10] [--workers 2] [--work DIR]

1. **Prepare**: a folder of text files (the standard library's Python sources, repeated with a number in each copy,
   ~1 MiB per file) of ``--small-mb`` and ``--large-mb``, tokenised by `lightning_hybrid.data.prepare` with a byte-level
   BPE tokenizer of 8,192 tokens trained here, in ``--workers`` processes: MiB/s, and the peak resident memory of
   the preparing process and its workers together (sampled every 50 ms from /proc).
2. **Train from shards**: the small recipe's model (`configs/model/small.yaml`: the reference GPT 4 x 256, sequences
   of 128) under dp2 on 2 processes, 60 steps of 8 rows per rank, once on each prepared folder: each rank's resident
   memory after step 10 and at the end, its high-water mark (``ru_maxrss``), and the data loading's share of a step
   (the time between one step's end and the next one's start -- fetching the batch and everything else Lightning does
   between steps -- over the step, median over the steps after the 5th).
3. **Resume under 3D**: the pretrain recipe, ``parallel=3d`` (dp2 x tp2 x pp2, 8 processes), ``data=shards`` on a
   folder of 6 batches per data-parallel rank and epoch: 10 steps uninterrupted; 4 steps, then ``ckpt_path=last``
   to 10 -- the losses of steps 1-10 compared bit for bit (the epoch ends after step 6).

The tables are written to benchmarks/DATA.md. The corpora and runs go to ``--work`` (default: a temporary folder,
removed at the end; about 3 GiB for 1 GiB of text).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402

from benchmarks.report import printed_to  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import default_corpus_files  # noqa: E402
from lightning_hybrid.data.prepare import prepare  # noqa: E402  (the small corpus of the resume runs)
from lightning_hybrid.data.shards import ShardsDataModule  # noqa: E402
from lightning_hybrid.models import GPTLightningModule  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

MiB = 2**20
VOCAB = 8192


# ---------------------------------------------------------------------------------------------- memory
def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class TreeRss:
    """The peak of the resident memory of process ``pid`` and its descendants together, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_kib = max(self.peak_kib, sum(_rss_kib(p) for p in [self.pid, *_descendants(self.pid)]))

    def __enter__(self) -> "TreeRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------------- corpora
def _write_corpus(folder: Path, megabytes: int) -> int:
    """Text files of about 1 MiB, the standard library's sources repeated (each copy numbered) to ``megabytes``."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [p.read_bytes() for p in default_corpus_files()[:2000]]
    written, copy, file_no, part = 0, 0, 0, []
    while written < megabytes * MiB:
        for text in sources:
            chunk = b"# copy %d\n" % copy + text
            part.append(chunk)
            written += len(chunk)
            if sum(map(len, part)) >= MiB or written >= megabytes * MiB:
                (folder / f"{file_no:06d}.txt").write_bytes(b"".join(part))
                file_no, part = file_no + 1, []
            if written >= megabytes * MiB:
                break
        copy += 1
    return written


def _train_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = b"".join(p.read_bytes() for p in default_corpus_files()[:300]).decode("utf-8", errors="replace")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def _prepare(corpus: Path, out: Path, tokenizer: Path, workers: int) -> dict:
    """``python -m lightning_hybrid.data.prepare`` as a user runs it, its process tree's resident memory sampled."""
    command = [sys.executable, "-m", "lightning_hybrid.data.prepare", str(corpus), "--out", str(out), "--tokenizer",
               str(tokenizer), "--workers", str(workers), "--val-fraction", "0.001", "--overwrite"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    with TreeRss(proc.pid) as rss:
        output, _ = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed: {output}")
    index = json.loads((out / "index.json").read_text())
    mib = index["read"]["bytes"] / MiB
    tokens = sum(split["tokens"] for split in index["splits"].values())
    return {"mib": mib, "seconds": wall, "mib_s": mib / wall, "tokens": tokens, "peak_mib": rss.peak_kib / 1024,
            "printed": next(line for line in output.splitlines() if line.startswith("read "))}


# ---------------------------------------------------------------------------------------------- training
class StepClock(L.Callback):
    """Each step's time and the gap before it (from the previous step's end: the batch fetched), and the rank's
    resident memory after step 10 and at the end."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.gaps: list[float] = []
        self.end: float | None = None
        self.rss_10 = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()
        if self.end is not None:
            self.gaps.append(self.start - self.end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()
        self.steps.append(self.end - self.start)
        if trainer.global_step == 10:
            self.rss_10 = _rss_kib(os.getpid())


def _train(folder: str, steps: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    clock = StepClock()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2), max_steps=steps,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock])
    trainer.fit(GPTLightningModule(vocab_size=VOCAB, n_layer=4, n_head=8, n_embd=256, block_size=128),
                ShardsDataModule(folder, block_size=128, batch_size=8))
    share = [g / s for g, s in zip(clock.gaps[5:], clock.steps[6:])]
    return {"rss_10_mib": clock.rss_10 / 1024, "rss_end_mib": _rss_kib(os.getpid()) / 1024,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_ms": 1e3 * statistics.median(clock.steps[6:]), "gap_ms": 1e3 * statistics.median(clock.gaps[5:]),
            "share": statistics.median(share)}


# ---------------------------------------------------------------------------------------------- resume
def _recipe(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run([sys.executable, str(REPO_ROOT / "recipes" / "pretrain.py"), *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"recipe {args} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def _resume(work: Path) -> dict:
    corpus = work / "resume_corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(20):  # 16 train documents of 99 tokens: 49 windows of 32, 6 batches of 4 per dp rank and epoch
        (corpus / f"{i:02d}.txt").write_text(f"document {i:02d} " + chr(97 + i % 26) * 86)
    prepare([corpus], work / "resume_tokens", val_fraction=0.2, overwrite=True)
    base = ["parallel=3d", "data=shards", f"data.path={work / 'resume_tokens'}", "data.batch_size=4",
            "model.vocab_size=256", "model.n_layer=2", "trainer.enable_progress_bar=false", "model.warmup_steps=3",
            "trainer.limit_val_batches=1"]
    cwd = work / "resume_runs"
    cwd.mkdir(exist_ok=True)
    _recipe([*base, "max_steps=10", f"hydra.run.dir={cwd / 'outputs' / 'whole'}"], cwd)
    _recipe([*base, "max_steps=4", f"hydra.run.dir={cwd / 'outputs' / 'interrupted'}"], cwd)
    _recipe([*base, "max_steps=10", "ckpt_path=last"], cwd)  # the newest run with a last.ckpt: "interrupted"
    whole = json.loads((cwd / "outputs" / "whole" / "train_losses.json").read_text())
    resumed = json.loads((cwd / "outputs" / "interrupted" / "train_losses.json").read_text())
    data = json.loads((cwd / "outputs" / "whole" / "metrics.json").read_text())["data"]
    return {"whole": whole["train_loss"], "resumed": resumed["train_loss"], "steps": resumed["step"],
            "rows": data["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-mb", type=int, default=1024)
    parser.add_argument("--small-mb", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--work", default=None, help="folder for the corpora and runs (default: a temporary one)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = _train_tokenizer(work / "tokenizer")
        prepared, trained = {}, {}
        for name, mb in (("small", args.small_mb), ("large", args.large_mb)):
            _write_corpus(work / f"corpus_{name}", mb)
            prepared[name] = _prepare(work / f"corpus_{name}", work / f"tokens_{name}", tokenizer, args.workers)
            shutil.rmtree(work / f"corpus_{name}")
            print(f"prepared {name}: {prepared[name]}", flush=True)
        for name in prepared:
            trained[name] = run_distributed(_train, 2, str(work / f"tokens_{name}"), args.steps)
            print(f"trained {name}: {trained[name]}", flush=True)
        resume = _resume(work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    with printed_to(REPO_ROOT / "benchmarks" / "DATA.md", "The data path at scale (benchmarks/bench_data.py)"):
        print(f"## Preparing ({args.workers} worker processes, byte-level BPE of {VOCAB} tokens)\n")
        print("| corpus | MiB of text | tokens | seconds (the whole command) | MiB/s | peak resident, MiB (the"
              " command and its workers together) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, p in prepared.items():
            print(f"| {name} | {p['mib']:.0f} | {p['tokens']:,} | {p['seconds']:.1f} | {p['mib_s']:.2f} |"
                  f" {p['peak_mib']:.0f} |")
        print("\n## Training from the shards (dp2, the small recipe's GPT 4 x 256, sequences of 128, 8 rows per"
              f" rank, {args.steps} steps)\n")
        print("| corpus | rank | resident after step 10, MiB | at the end, MiB | high-water mark, MiB | step, ms |"
              " between steps, ms | data loading / step |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, ranks in trained.items():
            for r, t in enumerate(ranks):
                print(f"| {name} | {r} | {t['rss_10_mib']:.0f} | {t['rss_end_mib']:.0f} | {t['maxrss_mib']:.0f} |"
                      f" {t['step_ms']:.0f} | {t['gap_ms']:.2f} | {100 * t['share']:.2f}% |")
        small, large = trained["small"][0]["maxrss_mib"], trained["large"][0]["maxrss_mib"]
        print(f"\nRank 0's high-water mark, large / small corpus: {large / small:.3f}. 'Between steps' is everything"
              " from one step's end to the next one's start (the batch read from the shards, its windows' order,"
              " Lightning's loop): an upper bound of the data loading.\n")
        equal = resume["whole"] == resume["resumed"]
        print("## Resume under 3D (dp2 x tp2 x pp2, 8 processes; 6 batches per data-parallel rank and epoch)\n")
        print("| step | uninterrupted | stopped at 4, resumed with ckpt_path=last |")
        print("|---:|---:|---:|")
        for step, a, b in zip(resume["steps"], resume["whole"], resume["resumed"]):
            print(f"| {step} | {a!r} | {b!r} |")
        print(f"\nBit-equal: {equal} ({len(resume['steps'])} steps; the epoch ends after step 6).")


if __name__ == "__main__":
    main()
