"""Command line of the planner.

    python -m lightning_hybrid.planner --model gpt3-175b --cluster a100 --devices 1024 --global-batch 1536
    python -m lightning_hybrid.planner --model n_layer=4,n_embd=256,n_head=8 --cluster cpu --devices 4 \
        --global-batch 8 --seq-len 128 --json plan.json
    python -m lightning_hybrid.planner --model n_layer=4,n_embd=256,n_head=8,experts=8,top_k=2,expert_ffn=512 \
        --cluster cpu --devices 4 --global-batch 8 --seq-len 128
    python -m lightning_hybrid.planner --model llama2-7b --seq-len 131072 --cluster h100 --devices 8 --global-batch 8
    python -m lightning_hybrid.planner calibrate [--out PATH]

``--model``: a preset (`MODEL_PRESETS`; a preset followed by `ModelSpec` field overrides,
``llama2-7b,experts=8,top_k=2``), a Hugging Face ``config.json`` (or its folder) or `GPTConfig` fields, each with
mixture-of-experts fields ``experts=,top_k=,expert_ffn=,moe_layers=,shared_ffn=`` (`MOE_FIELDS`); ``--cluster``:
``a100``, ``h100``, ``cpu`` (this machine: its calibration file, else defaults) or a cluster JSON. Context
parallelism (``cp``) is searched for sequences of at least ``2 x MIN_CP_TOKENS`` tokens (``--no-context-parallel``:
not at all; ``--documents``: batches with documents, packed or left-padded, whose attention under cp takes a
mask). Prints the ranked layouts (best first) with their memory and time breakdowns (``cp``: the key/value
exchange's time), then the closest layouts that do not fit and why, and how many sizes each validity rule turned
away. Exit code 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .cluster import DEFAULT_CALIBRATION, calibrate, load_cluster
from .model import model_spec
from .search import GIB, Candidate, Plan, plan


def _row(rank: int, c: Candidate) -> str:
    m = c.memory
    mem = (f"{m.total / GIB:8.2f} = p {m.params / GIB:.2f} g {m.grads / GIB:.2f} o {m.optimizer / GIB:.2f}"
           f" a {m.activations / GIB:.2f} b {m.buffers / GIB:.2f}")
    if c.time is None:
        return f"  -  {c.layout.label():<48} {mem}  {c.reason}"
    t = c.time
    time = (f"{t.total:9.4g} = comp {t.compute:.3g} tp {t.tp_comm:.3g} pp {t.pp_comm:.3g}"
            + (f" ep {t.ep_comm:.3g}" if c.layout.ep > 1 else "")
            + (f" cp {t.cp_comm:.3g}" if c.layout.cp > 1 else "")
            + f" bubble {t.bubble:.3g} dp {t.dp_comm:.3g} opt {t.optimizer:.3g}")
    return f"{rank:4d} {c.layout.label():<48} {c.tokens_per_s:12.4g} {c.mfu:6.3f} {mem}  {time}"


def format_plan(result: Plan, top: int = 10) -> str:
    """The table the command prints."""
    m, cl = result.model, result.cluster
    moe = (f" MoE: {m.moe_layers} layers of {m.experts} experts top-{m.top_k} F_e={m.expert_ffn}"
           + (f" shared F_s={m.shared_ffn}" if m.shared_ffn else "") + f", {m.active_params() / 1e9:.3g}B active;"
           if m.experts else "")
    lines = [f"model {m.name}: {m.params / 1e9:.3g}B params, L={m.n_layer} h={m.hidden} heads={m.heads}/{m.kv_heads}"
             f" F={m.ffn} V={m.vocab} s={m.seq_len};{moe} cluster {cl.name} ({cl.precision}, {cl.memory / GIB:.0f} GiB,"
             f" {cl.devices_per_node}/node); {result.devices} devices, global batch {result.global_batch}",
             f"{len(result.ranked)} layouts fit, {len(result.too_big)} do not.", "",
             f"rank {'layout':<48} {'tokens/s':>12} {'mfu':>6} {'memory GiB (per device)':<52}  step s",]
    lines += [_row(i + 1, c) for i, c in enumerate(result.ranked[:top])]
    if result.too_big:
        lines += ["", "closest that do not fit:"] + [_row(0, c) for c in result.too_big[:5]]
    if result.invalid:
        lines += ["", "sizes turned away: " + "; ".join(f"{k}: {v}" for k, v in sorted(result.invalid.items()))]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        p = argparse.ArgumentParser(prog="python -m lightning_hybrid.planner calibrate")
        p.add_argument("--out", default=str(DEFAULT_CALIBRATION), help="cluster JSON to write (default: %(default)s)")
        args = p.parse_args(argv[1:])
        cluster = calibrate(args.out)
        print(cluster.to_json(), end="")
        print(f"wrote {args.out}")
        return 0
    p = argparse.ArgumentParser(prog="python -m lightning_hybrid.planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset, config.json (or folder), or GPTConfig fields a=1,b=2"
                   " (MoE: experts=8,top_k=2,expert_ffn=..,moe_layers=..,shared_ffn=..)")
    p.add_argument("--cluster", default="cpu", help="a100, h100, cpu, or a cluster JSON (default: cpu)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--no-sequence-parallel", action="store_true", help="leave sequence parallelism out")
    p.add_argument("--no-context-parallel", action="store_true", help="leave context parallelism (cp) out")
    p.add_argument("--documents", action="store_true", help="batches hold documents (packed, left padding): under"
                   " cp their attention takes a mask (default: plain causal batches)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", default=None, help="write every candidate to this file")
    args = p.parse_args(argv)
    try:
        result = plan(model_spec(args.model, args.seq_len), load_cluster(args.cluster), args.devices, args.global_batch,
                      sequence_parallel=not args.no_sequence_parallel,
                      context_parallel=not args.no_context_parallel, documents=args.documents)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(result, args.top))
    if args.json:
        payload = {"model": result.model.__dict__, "cluster": result.cluster.name, "devices": result.devices,
                   "global_batch": result.global_batch, "ranked": [c.as_dict() for c in result.ranked],
                   "too_big": [c.as_dict() for c in result.too_big], "invalid": dict(result.invalid)}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
