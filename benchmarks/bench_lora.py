"""LoRA's memory as it trains: a Llama of about 1B parameters with adapters of rank 16 on every linear of its blocks
(`CausalLM(lora=...)`), dp2 ZeRO-1, fp32, AdamW, on this machine's CPU -- against what the frozen base costs anyway,
and against the planner's prediction for the same run (``ModelSpec.lora_rank``).

    python benchmarks/bench_lora.py                        # ~1.2B parameters (Llama 3.2 1B's shape), 2 ranks
    python benchmarks/bench_lora.py --layers 2 --hidden 256 --ffn 1024 --vocab 4096   # a smoke run

Measured on each rank (`lightning_hybrid.runs.memory.PeakMemoryMonitor` over the first ``--measure-steps`` steps:
live tensor bytes by kind at their highest; and the resident-set peak, ``VmHWM``, under glibc's defaults): the
frozen weights (``parameters``: every rank holds the whole base under ZeRO-1), the adapters' gradients and optimizer
state, the forward's activations and what backward allocates beyond them (``temporary``). Goals (issue 41): the
optimizer state is the adapters' alone (Adam's two moments: 8 bytes per adapter element, halved by ZeRO-1 over
dp2), and the peak is at most the frozen weights + the activations (with backward's transients) + 5%.
The planner's prediction (`estimate_memory`, fp32, the measured CPU cluster's activation scale) is printed beside
the measured peak. The table is written to ``benchmarks/LORA.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.runs.memory import PeakMemoryMonitor  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

MIB = 2**20
OUT = REPO_ROOT / "benchmarks" / "LORA.md"
GOAL = 1.05  # peak <= (frozen weights + activations + backward's transients) * GOAL


def llama_config(args) -> dict:
    return dict(model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.ffn,
                vocab_size=args.vocab, max_position_embeddings=args.seq_len, tie_word_embeddings=False)


def resident_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args: dict) -> dict:
    from lightning_hybrid.hf import CausalLM

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(name).setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    config = args["config"]
    module = CausalLM(config["model_type"], config={k: v for k, v in config.items() if k != "model_type"},
                      lr=1e-4, lora={"r": args["rank"], "lora_alpha": 2 * args["rank"], "target_modules": "all-linear"})
    monitor = PeakMemoryMonitor(steps=args["measure_steps"])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, zero_stage=1),
                        max_steps=args["measure_steps"], limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor])
    data = ByteCorpusDataModule(max_bytes=200_000, block_size=args["seq_len"], batch_size=args["micro_batch"])
    start = time.perf_counter()
    trainer.fit(module, data)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return {"peak": monitor.peak.total, "breakdown": monitor.peak.breakdown, "resident": resident_peak(),
            "trainable": trainable, "frozen": frozen, "seconds": time.perf_counter() - start}


def predicted(args, config: dict) -> dict:
    from lightning_hybrid.planner import Layout, ModelSpec, estimate_memory, hf_config, load_cluster

    spec = ModelSpec.from_hf(hf_config(config["model_type"], {k: v for k, v in config.items() if k != "model_type"}),
                             args.seq_len)
    spec = spec.__class__(**{**spec.__dict__, "lora_rank": args.rank})
    cluster = load_cluster(str(REPO_ROOT / "benchmarks" / "cluster_cpu.json"))
    layout = Layout(dp=2, tp=1, pp=1, zero_stage=1, micro_batch=args.micro_batch, micro_batches=1)
    return estimate_memory(spec, layout, "32-true", cluster.activation_scale).as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--measure-steps", type=int, default=2)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    config = llama_config(args)
    job = {"config": config, "rank": args.rank, "measure_steps": args.measure_steps, "seq_len": args.seq_len,
           "micro_batch": args.micro_batch}
    ranks = run_distributed(worker, 2, job)
    top = max(ranks, key=lambda r: r["peak"])
    b = top["breakdown"]
    frozen_bytes = b["parameters"] - 4 * top["trainable"]  # (the adapters' own weights apart)
    base = frozen_bytes + b["activations"] + b["temporary"]
    ratio = top["peak"] / base
    adapters_state = 8 * top["trainable"] / 2  # Adam's two fp32 moments, ZeRO-1 over dp2
    plan = predicted(args, config)
    rows = [
        ("parameters (frozen base + adapters)", b["parameters"]), ("gradients", b["gradients"]),
        ("optimizer state", b["optimizer_state"]), ("activations", b["activations"]),
        ("backward's transients (temporary)", b["temporary"]), ("optimizer step", b["optimizer_step"]),
        ("buffers + other", b["buffers"] + b["other"]), ("peak (live tensors)", top["peak"]),
        ("resident set peak (VmHWM)", top["resident"]),
    ]
    n_params = (top["trainable"] + top["frozen"]) / 1e9
    lines = [
        "# LoRA memory (benchmarks/bench_lora.py)", "",
        f"Llama, {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, vocab"
        f" {args.vocab}: {n_params:.2f}B parameters; LoRA r={args.rank} on every linear of the blocks"
        f" ({top['trainable'] / 1e6:.1f}M trainable); dp2 ZeRO-1, fp32, AdamW, {args.micro_batch} x {args.seq_len}"
        f" tokens per rank; the fuller rank over {args.measure_steps} steps (CPU, gloo).", "",
        "| what | MiB |", "|---|---:|",
        *[f"| {name} | {value / MIB:,.1f} |" for name, value in rows], "",
        f"- optimizer state {b['optimizer_state'] / MIB:.1f} MiB = the adapters' Adam moments"
        f" ({adapters_state / MIB:.1f} MiB: 8 bytes x {top['trainable'] / 1e6:.2f}M / dp2):"
        f" {'met' if b['optimizer_state'] <= adapters_state * 1.01 else 'NOT met'}.",
        f"- peak / (frozen weights + activations + backward's transients) = {ratio:.3f} (goal <= {GOAL}):"
        f" {'met' if ratio <= GOAL else 'NOT met'}.",
        f"- planner (`--lora-rank {args.rank}`, fp32, this machine's activation scale): {plan['total'] / MIB:,.1f} MiB"
        f" predicted (params {plan['params'] / MIB:,.1f}, grads {plan['grads'] / MIB:.1f}, optimizer"
        f" {plan['optimizer'] / MIB:.1f}, activations {plan['activations'] / MIB:,.1f}) against"
        f" {top['peak'] / MIB:,.1f} measured: {plan['total'] / top['peak']:.3f}x.",
        f"- wall time of the run: {top['seconds']:.0f} s.", "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"ranks": ranks, "predicted": plan}, indent=1,
                                                             default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
