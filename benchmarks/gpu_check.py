"""The prepared GPU check: one CUDA device, the reference GPT in bf16 through `HybridStrategy`, in under 5 minutes.

    python benchmarks/gpu_check.py [--steps 30 --n-layer 12 --n-embd 768 --block 1024 --batch 8]

On one CUDA device (world 1, NCCL) it trains the reference GPT (GPT-2-small shape by default, byte vocabulary)
with ``precision="bf16-mixed"`` and prints, for ZeRO-0 (one rank there is nothing to shard):

* tokens/s and MFU: ``flops_per_batch`` (the model's training FLOPs, `GPT.flops_per_token`) over the measured
  step time, against the device's bf16 peak as Lightning knows it (``get_available_flops``);
* ``torch.cuda.max_memory_allocated`` during the first steps beside the live-tensor peak of
  `lightning_hybrid.memory.PeakMemoryMonitor` over the same steps and the ZeRO formula for the model states
  (fp32 master parameters 4 B + fp32 gradients 4 B + Adam 8 B per parameter, bf16-mixed autocast);
* the same on several ranks sharing the one GPU is not run: NCCL refuses two ranks on one device, and gloo
  has no CUDA reduce-scatter, which ZeRO 1-2 use. Multi-GPU layouts need a multi-GPU machine.

Exits 0 with a note when no CUDA device is present (nothing here may depend on one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.models import GPTConfig, GPTLightningModule  # noqa: E402

MEASURED = 3  # steps under the memory tracker (slower), before the timed ones


class StepClock(L.Callback):
    """Wall time of the training steps after the measured and warm-up ones (CUDA synchronised)."""

    def __init__(self, skip: int) -> None:
        self.skip, self.times, self._t0 = skip, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        if batch_idx >= self.skip:
            self.times.append(time.perf_counter() - self._t0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it where the device tool lends a GPU).")
        return 0
    from lightning.fabric.utilities.throughput import get_available_flops

    L.seed_everything(0, verbose=False)
    config = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       mlp="swiglu", dropout=0.0)
    module = GPTLightningModule(config=config)
    memory, clock = PeakMemoryMonitor(steps=MEASURED), StepClock(MEASURED + args.warmup)
    trainer = L.Trainer(
        accelerator="cuda", devices=1, precision="bf16-mixed", strategy=HybridStrategy(),
        max_steps=MEASURED + args.warmup + args.steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[memory, clock],
    )
    data = ByteCorpusDataModule(block_size=args.block, batch_size=args.batch)
    start = time.perf_counter()
    trainer.fit(module, data)
    params = sum(p.numel() for p in module.parameters())
    step_s = sum(clock.times) / max(1, len(clock.times))
    tokens = args.batch * args.block
    device = torch.device("cuda", 0)
    peak_flops = get_available_flops(device, torch.bfloat16)
    mfu = module.flops_per_batch / step_s / peak_flops if peak_flops else None
    mib = 2**20
    states = 16 * params / mib
    print(f"device: {torch.cuda.get_device_name(device)}  torch {torch.__version__}  (fit {time.perf_counter() - start:.0f} s)")
    print(f"model: {params / 1e6:.1f}M parameters, batch {args.batch} x {args.block} tokens, bf16-mixed, AdamW")
    mfu_text = f"MFU {mfu:.3f}" if mfu is not None else "MFU n/a (device peak unknown to Lightning)"
    print(f"step {step_s * 1e3:.1f} ms over {len(clock.times)} steps  tokens/s {tokens / step_s:,.0f}  {mfu_text}")
    print(f"peak memory over the first {MEASURED} steps: torch.cuda.max_memory_allocated "
          f"{memory.peak.cuda_max_allocated / mib:.0f} MiB; live tensors (PeakMemoryMonitor) {memory.peak.total / mib:.0f} MiB "
          f"(ratio {memory.peak.total / memory.peak.cuda_max_allocated:.3f})")
    print("  breakdown: " + ", ".join(f"{k} {v / mib:.0f}" for k, v in memory.peak.breakdown.items()))
    print(f"  ZeRO formula for the model states (16 B/parameter, stage 0): {states:.0f} MiB; "
          f"measured parameters+gradients+optimizer state {sum(memory.peak.breakdown[k] for k in ('parameters', 'gradients', 'optimizer_state')) / mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
