"""What routing costs beside the experts' GEMMs, measured, against the planner's model of it (issue 40: "a
router/permutation cost that is measured, not guessed").

    python benchmarks/bench_moe_routing.py           # ~1 min, writes benchmarks/MOE_ROUTING.md
    python benchmarks/bench_moe_routing.py --quick   # one configuration, fewer repeats

For each configuration (hidden ``h``, ``E`` experts of width ``F``, top ``k``, ``T`` tokens), one process, one thread,
fp32:

block        a transformers Qwen3-MoE sparse block as `lightning_hybrid.hf.CausalLM` builds it
             (``AutoModelForCausalLM.from_config``: transformers' default experts implementation, ``grouped_mm``),
             forward + backward of ``T`` tokens; the fastest of ``--repeats`` timings of ``--steps`` steps
GEMMs        the same GEMM work without routing: the router's ``T x h x E`` and, per expert, its ``T k / E`` rows
             (uniform routing) through its gate/up and down matrices, forward + backward (plain ``torch.mm``)
routing      block - GEMMs: the router's softmax and top-k, the permutation of the (token, expert) pairs to their
             experts and back, the weighted sum, the activation -- everything but the GEMMs
predicted    the planner's element-wise time of the same work at this machine's element-wise bandwidth
             (`lightning_hybrid.planner.cluster._memory_bandwidth`, measured in the same run): what the block keeps
             (`lightning_hybrid.planner.activations.expert_activation_bytes`: per pair the expert's input and output
             rows and its hidden tensors, per token the router's logits and probabilities), written in forward, read
             and written in backward (3x), and the permutation's copies
             (`lightning_hybrid.planner.expert_time.permutation_bytes`: each pair's row gathered to its expert and
             scattered back, forward and backward); the last column leaves the copies out

The ratio routing / predicted says whether bytes at the memory bandwidth describe routing on this machine (the
planner's CPU cluster), beside the GPU presets, where the same bytes are read at HBM bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lightning_hybrid.planner import ModelSpec  # noqa: E402
from lightning_hybrid.planner.activations import expert_activation_bytes, mlp_tensors  # noqa: E402
from lightning_hybrid.planner.cluster import _memory_bandwidth  # noqa: E402
from lightning_hybrid.planner.expert_time import permutation_bytes  # noqa: E402

#: (h, E, F, k, T): Mixtral-like (few wide experts, top-2), Qwen3-MoE-like (many narrow ones, top-8), finer still.
CONFIGS = [(256, 8, 512, 2, 2048), (256, 64, 128, 8, 2048), (256, 128, 64, 8, 2048)]


def _fastest(fn, steps: int, repeats: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def measure(h: int, experts: int, width: int, k: int, tokens: int, steps: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=width, num_experts=experts, num_experts_per_tok=k,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=h // 4,
                            intermediate_size=4 * h, vocab_size=256, norm_topk_prob=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    block = model.model.layers[0].mlp
    x = torch.randn(1, tokens, h, device="cpu", requires_grad=True)

    def block_step() -> None:
        block(x).sum().backward()

    rows = tokens * k // experts
    router = torch.randn(h, experts, device="cpu", requires_grad=True)
    ups = [torch.randn(h, 2 * width, device="cpu", requires_grad=True) for _ in range(experts)]
    downs = [torch.randn(width, h, device="cpu", requires_grad=True) for _ in range(experts)]
    flat = torch.randn(tokens, h, device="cpu", requires_grad=True)
    inputs = [torch.randn(rows, h, device="cpu", requires_grad=True) for _ in range(experts)]

    def gemm_step() -> None:
        total = (flat @ router).sum()
        for inp, up, down in zip(inputs, ups, downs):
            total = total + ((inp @ up)[:, :width] @ down).sum()
        total.backward()

    block_s = _fastest(block_step, steps, repeats)
    gemm_s = _fastest(gemm_step, steps, repeats)
    spec = ModelSpec("moe", 1, h, 4, 4, 4 * h, 256, tokens, gated_mlp=True, bias=False, learned_positions=False,
                     experts=experts, top_k=k, expert_ffn=width)
    kept = 3 * expert_activation_bytes(spec, tokens, 4, tensors=mlp_tensors(spec, "32-true"))
    return {"block_s": block_s, "gemm_s": gemm_s, "kept": kept, "permutation": permutation_bytes(spec, tokens, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("MOE_ROUTING.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    configs = CONFIGS[:1] if args.quick else CONFIGS
    if args.quick:
        args.steps, args.repeats = 2, 2
    bandwidth = _memory_bandwidth()
    lines = ["| h | experts | width | top-k | tokens | block ms | GEMMs ms | routing ms | predicted ms |"
             " routing / predicted | without the permutation's copies |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for h, experts, width, k, tokens in configs:
        r = measure(h, experts, width, k, tokens, args.steps, args.repeats)
        routing = r["block_s"] - r["gemm_s"]
        predicted, kept_only = (r["kept"] + r["permutation"]) / bandwidth, r["kept"] / bandwidth
        lines.append(f"| {h} | {experts} | {width} | {k} | {tokens} | {r['block_s'] * 1e3:.1f} |"
                     f" {r['gemm_s'] * 1e3:.1f} | {routing * 1e3:.1f} | {predicted * 1e3:.1f} |"
                     f" {routing / predicted:.2f} | {routing / kept_only:.2f} |")
        print(lines[-1], flush=True)
    from benchmarks.report import header

    text = (header("What routing costs beside the experts' GEMMs (benchmarks/bench_moe_routing.py)")
            + f"One process, one thread, fp32; element-wise bandwidth measured in the same run:"
              f" {bandwidth / 1e9:.1f} GB/s; fastest of {args.repeats} timings of {args.steps} steps.\n\n"
            + "\n".join(lines) + "\n")
    args.out.write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
