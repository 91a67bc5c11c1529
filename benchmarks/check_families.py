"""Which `transformers` families train exactly under TP and PP: every family docs/huggingface.md names, beyond the
suite's.

    python benchmarks/check_families.py [--families llama,gemma2,... --steps 3]

For each model type, a tiny random-init config made by transformers itself (`AutoConfig.for_model` with the
small sizes below, where the config has those fields; byte vocabulary, no dropout, untied embeddings) is trained
as `lightning_hybrid.hf.CausalLM` for ``--steps`` AdamW steps under tp2 and pp2 (2 CPU processes, gloo), and
compared with the same module on one process by the suite's own harness (`tests.parity`: losses, global and
per-tensor gradient norms, validation, final parameters, at the suite's tolerances for transformers families).
Each row says what TP split each unit and whether each layout matched, or the error that refused it (a refusal
is the promised behaviour for what cannot be exact). The table is written to benchmarks/FAMILIES.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

FAMILIES = [
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi", "phi3", "stablelm", "starcoder2", "gptj", "opt",
    "gpt2", "gpt_neox", "bloom", "falcon", "mpt", "gpt_bigcode", "olmo", "olmo2", "cohere", "granite", "persimmon",
    "codegen", "mixtral", "qwen2_moe",
]
# Small sizes, each given under the field names the config knows (its attribute map included).
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            ffn_dim=64, word_embed_proj_dim=32, rotary_dim=8, vocab_size=256, max_position_embeddings=64,
            num_local_experts=4, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts_per_tok=2, head_dim=8, tie_word_embeddings=False,
            logit_scale=1.0)  # Cohere's default 1/16 leaves gradients too small for the harness's active clipping
DROPOUTS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout", "embed_dropout",
            "activation_dropout", "dropout", "summary_first_dropout", "emb_pdrop")
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2, micro_batches=2)}
LR = 2e-4  # as the suite's family tests: lr x 2% (Adam's eps-scale amplification) stays under the tolerance


def tiny_overrides(model_type: str) -> dict:
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)

    def settable(key: str) -> bool:  # a field of the config, not a property derived from others (Falcon's head_dim)
        prop = getattr(type(default), key, None)
        return hasattr(default, key) and not (isinstance(prop, property) and prop.fset is None)

    out = {k: v for k, v in TINY.items() if settable(k)}
    out.update({k: 0.0 for k in DROPOUTS if isinstance(getattr(default, k, None), float)})
    pad = getattr(default, "pad_token_id", None)
    if isinstance(pad, int) and pad >= TINY["vocab_size"]:
        out["pad_token_id"] = 0
    if model_type == "mpt":
        out["attn_config"] = {"attn_pdrop": 0}
    return out


def _module(model_type: str):
    from lightning_hybrid.hf import CausalLM

    return CausalLM(model_type, config=tiny_overrides(model_type), lr=LR)


def _check(model_type: str, steps: int) -> dict[str, str]:
    from tests.parity import RTOL, mismatches, run_world

    row = {}
    for name, layout in LAYOUTS.items():
        try:
            results, references = run_world(2, {name: (layout, partial(_module, model_type), {})}, steps=steps)
            bad = [mismatches(per_run[name], references[name], RTOL, 1e-5) for per_run in results]
            split = results[0][name]["tp_split"]
            verdict = "match" if not any(bad) else f"MISMATCH {next(b for b in bad if b)}"
            kinds = sorted(set(split.values()))
            row[name] = verdict + (f"; split: {', '.join(kinds)}" if kinds else "")
        except Exception as e:  # a refusal (or a failure) is a row, with its message
            message = str(e).strip().splitlines()
            last = next((line for line in reversed(message) if "Error" in line),
                        message[-1] if message else type(e).__name__)
            row[name] = f"refused/failed: {last.strip()[:300]}"
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import transformers

    print(f"transformers {transformers.__version__}; {args.steps} AdamW steps at lr {LR}, fp32, 2 CPU processes;"
          " against the same module on one process (tests/parity.py)\n")
    print("| model type | tp2 | pp2 |")
    print("|---|---|---|")
    for model_type in args.families.split(","):
        try:
            row = _check(model_type, args.steps)
        except Exception:
            row = {name: "error: " + traceback.format_exc(limit=1).strip().splitlines()[-1][:300] for name in LAYOUTS}
        print(f"| {model_type} | " + " | ".join(row[name].replace("|", "/") for name in LAYOUTS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    from benchmarks.report import printed_to

    with printed_to(REPO_ROOT / "benchmarks" / "FAMILIES.md",
                    "transformers families under TP and PP (benchmarks/check_families.py)"):
        code = main()
    sys.exit(code)
