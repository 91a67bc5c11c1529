"""What the setup-time verification of a tensor-parallel split costs, against a 100-step training run.

    python benchmarks/bench_tp_verification.py [--steps 100 --tp 2]

For each model (the reference GPT of `make run`, and two `transformers` families built from a config, random
init), one `Trainer(strategy=HybridStrategy(tp=2))` fit on the byte corpus, 2 processes on the CPU:
``verification`` is the time `apply_tp` spent capturing the example forward and checking every kind of block
(it is in the plan's log line, `HybridStrategy.parallelized.tp_report.seconds`); ``training`` is the time of
the ``--steps`` training batches (on_train_batch_start of the first to on_train_batch_end of the last). The
goal: verification under 2% of a 100-step run. The table is written to benchmarks/TP_VERIFICATION.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.report import printed_to  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.models import GPTLightningModule  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402


class TransformersLM(GPTLightningModule):
    """A `transformers` causal LM from a config (random init), trained like the reference GPT."""

    def __init__(self, family: str, **kwargs) -> None:
        super().__init__(vocab_size=256, block_size=128, **kwargs)
        self.family = family

    def configure_model(self) -> None:
        import transformers as T

        if self.model is not None:
            return
        size = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, vocab_size=256,
                    max_position_embeddings=128)
        config = {
            "llama": lambda: T.LlamaConfig(**size, num_key_value_heads=4, intermediate_size=688),
            "gpt_neox": lambda: T.GPTNeoXConfig(**size, intermediate_size=1024),
        }[self.family]()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = T.AutoModelForCausalLM.from_config(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


class TrainingTime(L.Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.end = time.perf_counter()


def _measure(models: list[str], steps: int, tp: int) -> dict[str, tuple[float, float, str]]:
    warnings.filterwarnings("ignore")
    out = {}
    for name in models:
        module = (GPTLightningModule(n_layer=4, n_head=8, n_embd=256, block_size=128) if name == "gpt"
                  else TransformersLM(name))
        timer = TrainingTime()
        strategy = HybridStrategy(tp=tp)
        trainer = L.Trainer(accelerator="cpu", devices=tp, strategy=strategy, max_steps=steps, limit_val_batches=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[timer])
        trainer.fit(module, ByteCorpusDataModule(max_bytes=400_000, block_size=128, batch_size=8))
        report = strategy.parallelized.tp_report
        out[name] = (report.seconds, timer.end - timer.start, report.summary())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--models", default="gpt,llama,gpt_neox")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_distributed(_measure, args.tp, args.models.split(","), args.steps, args.tp)[0]
    with printed_to(REPO_ROOT / "benchmarks" / "TP_VERIFICATION.md",
                    "TP verification cost (benchmarks/bench_tp_verification.py)"):
        print(f"| model (tp={args.tp}) | verification, s | {args.steps} training steps, s | verification / training |")
        print("|---|---:|---:|---:|")
        for name, (verify_s, train_s, _) in results.items():
            print(f"| {name} | {verify_s:.2f} | {train_s:.1f} | {100 * verify_s / train_s:.2f}% |")
        for name, (_, _, summary) in results.items():
            print(f"\n{name}: {summary}")


if __name__ == "__main__":
    main()
