"""Which `transformers` families train exactly under TP, PP and CP: every family docs/huggingface.md names, beyond
the suite's.

    python benchmarks/check_families.py [--families llama,gemma2,... --layouts tp2,pp2,cp2 --steps 3]

For each model type, a tiny random-init config made by transformers itself (`AutoConfig.for_model` with the
small sizes below, where the config has those fields; byte vocabulary, no dropout, untied embeddings) is trained
as `lightning_hybrid.hf.CausalLM` for ``--steps`` AdamW steps under each layout on 2 CPU processes (gloo) -- tp2
and pp2 on (x, y) byte blocks, cp2 (``dp=1, cp=2``: every sequence split over the 2 ranks) on packed documents
(the harness's ``data="packed"``: 1-3 documents and some padding per row, so the document masks are exercised)
-- and compared with the same module on one process, on the same data, by the suite's own harness
(`tests.parity`: losses, global and per-tensor gradient norms, validation, final parameters, at the suite's
tolerances for transformers families). Each row says what TP split each unit and whether each layout matched, or
the error that refused it (a refusal is the promised behaviour for what cannot be exact). The layout runs first,
then the one-process reference: a layout refused at setup is reported as its own refusal. Where the reference
itself is refused because the model's own mask lets packed documents see each other (at cp=1 such models train
on unpacked batches only), CP -- which replaces the model's mask by the causal document mask -- is compared with
one process whose attention gets that mask in place of the model's (said in the cell).

The table is written to benchmarks/FAMILIES.md. ``--layouts`` with some of the layouts reruns those columns only:
the others are kept from the current file (its rows, and which command wrote them when, in the header).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

OUTPUT = REPO_ROOT / "benchmarks" / "FAMILIES.md"
TITLE = "transformers families under TP, PP and CP (benchmarks/check_families.py)"
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
# name -> (HybridStrategy arguments, the harness's trainer arguments)
LAYOUTS = {
    "tp2": (dict(tp=2), {}),
    "pp2": (dict(pp=2, micro_batches=2), {}),
    "cp2": (dict(dp=1, cp=2), {"data": "packed"}),
}
LR = 2e-4  # as the suite's family tests: lr x 2% (Adam's eps-scale amplification) stays under the tolerance
# The model's own mask at cp=1 (`lightning_hybrid.hf.decomposition.check_document_masks`) lets packed documents mix.
OWN_MASK_REFUSED = "packed documents (or left padding) would see each other"


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


def _module(model_type: str, document_mask: bool = False):
    from lightning_hybrid.hf import CausalLM

    cls = _document_masked_class() if document_mask else CausalLM
    return cls(model_type, config=tiny_overrides(model_type), lr=LR)


def _document_masked_class():
    """`CausalLM` whose every ``scaled_dot_product_attention`` runs under the causal document mask of the batch's
    positions, in place of the mask the model made (and its own-mask check skipped): the one-process computation
    that CP's replaced mask (`lightning_hybrid.parallel.context_parallel`) must reproduce, for a model whose own mask at
    cp=1 lets packed documents see each other."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from lightning_hybrid.core.batch import document_causal_mask
    from lightning_hybrid.hf import CausalLM

    class DocumentMask(TorchFunctionMode):
        def __init__(self, positions) -> None:
            super().__init__()
            self.mask = document_causal_mask(positions)  # None: plain causal rows, the model's own is right

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is F.scaled_dot_product_attention and self.mask is not None:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                kwargs.update(zip(names, args))
                query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
                kwargs.update(attn_mask=self.mask, is_causal=False)
                return func(query, key, value, **kwargs)
            return func(*args, **kwargs)

    class DocumentMaskedLM(CausalLM):
        def forward(self, idx, position_ids=None, attention_mask=None):
            positions = self._positions(idx, position_ids, attention_mask)
            self._calls.documents_checked = True  # the model's own mask is replaced below
            with DocumentMask(positions):
                return super().forward(idx, position_ids, attention_mask)

    return DocumentMaskedLM


def _error_line(e: BaseException) -> str:
    message = str(e).strip().splitlines()
    last = next((line for line in reversed(message) if "Error" in line), None)
    if last is None:
        last = f"{type(e).__name__}: {message[-1]}" if message else type(e).__name__
    return last.strip()


def _check(model_type: str, layouts: list[str], steps: int) -> dict[str, str]:
    from lightning_hybrid.testing import run_distributed
    from tests.parity import CLIP, RTOL, _fit_runs, fit_and_record, mismatches

    row = {}
    for name in layouts:
        layout, trainer_kwargs = LAYOUTS[name]
        try:
            # The layout first: a refusal at its setup is its own, whatever the reference would say.
            runs = {name: (layout, partial(_module, model_type), trainer_kwargs)}
            results = run_distributed(_fit_runs, 2, runs, steps)
            note = ""
            try:
                reference = fit_and_record("auto", 1, partial(_module, model_type), steps=steps, **trainer_kwargs)
            except ValueError as e:
                if OWN_MASK_REFUSED not in str(e) or layout.get("cp", 1) == 1:
                    raise
                reference = fit_and_record("auto", 1, partial(_module, model_type, document_mask=True), steps=steps,
                                           **trainer_kwargs)
                note = (" (against one process with the causal document mask in place of the model's own, which"
                        " is refused at cp=1: it lets packed documents see each other)")
            assert min(reference["grad_norms"]) > CLIP, "clipping must be active for the norm check to mean anything"
            bad = [mismatches(per_run[name], reference, RTOL, 1e-5) for per_run in results]
            split = results[0][name]["tp_split"]
            verdict = ("match" if not any(bad) else f"MISMATCH {next(b for b in bad if b)}") + note
            kinds = sorted(set(split.values()))
            row[name] = verdict + (f"; split: {', '.join(kinds)}" if kinds else "")
        except Exception as e:  # a refusal (or a failure) is a row, with its message
            row[name] = f"refused/failed: {_error_line(e)[:300]}"
    return row


# ---------------------------------------------------------------------------------------------- the kept columns
_WRITTEN = re.compile(r"Written by (`[^`]+` on [\d-]+ [\d:]+ \([^)]*\))(?:, which reran the ([\w, ]+?) columns?)?"
                      r"(?:; kept from earlier runs: (.*?))?\. Rerun it")
_KEPT = re.compile(r"([\w, ]+?) by (`[^`]+` on [\d-]+ [\d:]+ \([^)]*\))")


def _names(text: str) -> list[str]:
    return [n for n in re.split(r",\s*|\s+and\s+", text.strip()) if n]


def _joined(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def read_table(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The current file's rows (model type -> column -> cell) and, per column, the command and date that wrote it."""
    if not path.exists():
        return {}, {}
    text = path.read_text()
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for line in text.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0] == "model type":
            columns = cells[1:]
        elif columns and not set(cells[0]) <= set("-|"):
            rows[cells[0]] = dict(zip(columns, cells[1:]))
    origin: dict[str, str] = {}
    written = _WRITTEN.search(text)
    if written:
        rerun = _names(written.group(2)) if written.group(2) else columns
        origin.update({c: written.group(1) for c in rerun})
        for kept in _KEPT.finditer(written.group(3) or ""):
            origin.update({c: kept.group(2) for c in _names(kept.group(1).lstrip("; "))})
    return rows, origin


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="the columns to run (the others are kept from the current file)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a layout's 2 ranks may take before the run counts as a hang")
    args = parser.parse_args(argv)
    layouts = [name for name in LAYOUTS if name in args.layouts.split(",")]
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}: choose from {list(LAYOUTS)}")
    partial_run = len(layouts) < len(LAYOUTS)
    old_rows, origin = read_table(OUTPUT) if partial_run else ({}, {})
    from benchmarks.report import printed_to

    with printed_to(OUTPUT, TITLE):
        _run(args.families.split(","), layouts, args.steps, args.timeout, old_rows)
    if partial_run:  # the header line says which columns this run wrote, and where the others come from
        kept: dict[str, list[str]] = {}
        for name in LAYOUTS:
            if name not in layouts:
                kept.setdefault(origin.get(name, "no earlier run (\"not run\")"), []).append(name)
        where = "; ".join(f"{_joined(names)} by {command}" for command, names in kept.items())
        first, rest = OUTPUT.read_text().split(". Rerun it", 1)
        OUTPUT.write_text(f"{first}, which reran the {_joined(layouts)} column{'s' if len(layouts) > 1 else ''};"
                          f" kept from earlier runs: {where}. Rerun it{rest}")
    return 0


def _run(families: list[str], layouts: list[str], steps: int, timeout: int, old_rows: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import transformers

    import lightning_hybrid.testing
    from tests.parity import BLOCK

    lightning_hybrid.testing.WORKER_TIMEOUT_S = timeout  # a layout whose ranks give no result by then hangs
    for name, (layout, _) in LAYOUTS.items():
        # CP cuts every sequence into 2 * cp equal chunks: the harness's blocks must split so.
        assert BLOCK % (2 * layout.get("cp", 1)) == 0, (name, BLOCK)
    start = time.monotonic()
    print(f"transformers {transformers.__version__}; {steps} AdamW steps at lr {LR}, fp32, 2 CPU processes;"
          " against the same module on one process (tests/parity.py)\n")
    print("tp2: `HybridStrategy(tp=2)`, pp2: `HybridStrategy(pp=2, micro_batches=2)`, both on (x, y) byte blocks"
          f" of {BLOCK} tokens; cp2: `HybridStrategy(dp=1, cp=2)` on packed documents (`data=\"packed\"`: rows of"
          f" {BLOCK} tokens holding 1-3 documents and 0-5 padding tokens, each rank {BLOCK // 2} tokens of every"
          " row), against one process on the same packed rows.\n")
    print("| model type | " + " | ".join(LAYOUTS) + " |")
    print("|---|" + "---|" * len(LAYOUTS))
    for model_type in dict.fromkeys([*old_rows, *families]):
        row = dict(old_rows.get(model_type, {}))
        if model_type in families:
            try:
                row.update(_check(model_type, layouts, steps))
            except Exception:
                line = traceback.format_exc(limit=1).strip().splitlines()[-1][:300]
                row.update({name: "error: " + line for name in layouts})
        cells = [row.get(name, "not run").replace("|", "/") for name in LAYOUTS]
        print(f"| {model_type} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nRun time {time.monotonic() - start:.0f} s ({', '.join(layouts)}; {len(families)} families).")


if __name__ == "__main__":
    sys.exit(main())
