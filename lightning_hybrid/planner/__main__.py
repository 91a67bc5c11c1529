"""Command line of the planner.

    python -m lightning_hybrid.planner --model gpt3-175b --cluster a100 --devices 1024 --global-batch 1536
    python -m lightning_hybrid.planner --model n_layer=4,n_embd=256,n_head=8 --cluster cpu --devices 4 \
        --global-batch 8 --seq-len 128 --json plan.json
    python -m lightning_hybrid.planner --model n_layer=4,n_embd=256,n_head=8,experts=8,top_k=2,expert_ffn=512 \
        --cluster cpu --devices 4 --global-batch 8 --seq-len 128
    python -m lightning_hybrid.planner --model llama2-7b --seq-len 131072 --cluster h100 --devices 8 --global-batch 8
    python -m lightning_hybrid.planner --hf-config llama --override hidden_size=4096,num_hidden_layers=32 \
        --cluster h100 --devices 64 --global-batch 512 --seq-len 4096 --layout "dp8xtp8 zero1 ac"
    python -m lightning_hybrid.planner --hf-config /models/my-model --cluster h100 --devices 8 --global-batch 64
    python -m lightning_hybrid.planner calibrate [--out PATH]

``--model``: a preset (`MODEL_PRESETS`; a preset followed by `ModelSpec` field overrides,
``llama2-7b,experts=8,top_k=2``), a Hugging Face ``config.json`` (or its folder) or `GPTConfig` fields, each with
mixture-of-experts fields ``experts=,top_k=,expert_ffn=,moe_layers=,shared_ffn=`` (`MOE_FIELDS`); ``--cluster``:
``a100``, ``h100``, ``cpu`` (this machine: its calibration file, else defaults) or a cluster JSON. Context
parallelism (``cp``) is searched for sequences of at least ``2 x MIN_CP_TOKENS`` tokens (``--no-context-parallel``:
not at all; ``--documents``: batches with documents, packed or left-padded, whose attention takes a mask;
``--compile``: the strategy's ``compile=True``, whose ZeRO-3 units are whole layers; ``--fp8 tensorwise|rowwise|
rowwise_with_gw_hp``: the strategy's FP8 training, `lightning_hybrid.planner.float8`). Prints the ranked layouts
(best first) with their memory and time breakdowns (``cp``: the key/value exchange's time), then the closest layouts
that do not fit and why, and how many sizes each validity rule turned away. Exit code 2 on a bad argument.

``--hf-config``: any ``transformers`` config instead of ``--model`` -- a local folder (its ``config.json``), a
``config.json`` or a model type (``llama``: transformers' defaults), with ``--override k=v,k=v`` given to the
config's constructor (`lightning_hybrid.planner.model.hf_config`; no download). The header then says how the
parameter count derived from the config compares with ``AutoModelForCausalLM.from_config``'s on the meta device,
and what the planner does not model of it (`hf_notes`). ``--layout``: one layout, written as the table writes
them (``dp8xtp8``, ``dp4xtp8xpp2 zero1 mb1x16 1f1b ac sp``, ``tp8 pp2 cp2 ep4``; ``dp`` defaults to what the
other sizes leave of ``--devices``, the micro-batches to ``mb1`` and the rest of a replica's batch): its memory per
device by kind, whether it fits the device (`USABLE_MEMORY` of it) and by how much, and its step time when it
fits; the exit code is then 0 if it fits, else 1 (without ``--layout``: 0 if any layout fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any, Optional

from lightning_hybrid.parallel.pipeline.executor import SCHEDULES, resolve_schedule

from .activations import PRECISIONS
from .cluster import DEFAULT_CALIBRATION, FA2_ON_HOPPER, USABLE_MEMORY, Cluster, calibrate, load_cluster
from .float8 import FP8_RECIPES
from .layout import Layout
from .model import ModelSpec, hf_config, hf_notes, hf_parameter_count, model_spec
from .search import GIB, Candidate, Plan, evaluate, plan, tp_divides


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
            + (f" fp8 {t.fp8_comm:.3g}" if t.fp8_comm else "")
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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--override`` values, ``k=v`` or ``k=v,k2=v2`` each: values read as JSON (``4096``, ``true``, ``null``,
    ``[0,1]``), else kept as strings (``silu``)."""
    overrides: dict[str, Any] = {}
    for item in items:
        for pair in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", item):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--override {item!r}: give k=v pairs (hidden_size=4096,num_hidden_layers=32).")
            try:
                overrides[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key.strip()] = value.strip()
    return overrides


_DIMS = re.compile(r"^(dp|tp|pp|cp|ep)(\d+)$")


def parse_layout(text: str, model: ModelSpec, devices: int, global_batch: int) -> Layout:
    """A `Layout` from the table's own notation (`Layout.label`): ``dp4xtp8xpp2 cp2 ep2 zero1 mb2x4 1f1b/v2 ac sp``
    (spaces or commas between parts; ``sel``: selective recompute of the attention core, ``pw``: pointwise selective
    recompute, ``op``: torchtitan's per-op selective recompute; ``hsdpN``: ZeRO-3 hybrid-sharded over ``N`` of the dp
    ranks; ``rs-mb``: ZeRO-3 reduce-scattering every micro-batch; ``accN``: N runs of the pipeline's schedule per
    step; ``fold``: expert parallelism folded over the TP ranks; ``ring``: ring attention under CP). What is left
    out: ``tp``, ``pp``, ``cp``, ``ep`` 1, ``dp`` what they leave of ``devices``, ZeRO 0, micro-batches of 1 sequence
    (``mbB`` sets the size; ``mbBxM`` both: ``dp B M`` must be the global batch), schedule ``1f1b``. Raises
    ``ValueError`` for a layout the strategy would refuse (sizes that do not multiply to ``devices``, ``tp`` not
    dividing the heads, ``ep`` the experts, ...)."""
    sizes: dict[str, int] = {}
    zero, b, m, schedule, v, ac, sp, sel, pw, op = 0, 1, 0, "1f1b", 0, False, False, False, False, False
    dp_shard, grad_reduce, accumulate, fold, ring = None, "auto", 1, False, False
    for part in re.split(r"[\s,]+", text.strip()):
        pieces = part.split("x") if all(_DIMS.match(x) for x in part.split("x")) else [part]
        for piece in pieces:
            dim, mb = _DIMS.match(piece), re.fullmatch(r"mb(\d+)(?:x(\d+))?", piece)
            sched = re.fullmatch(r"([a-z0-9_]+)(?:/v(\d+))?", piece)
            if dim:
                sizes[dim.group(1)] = int(dim.group(2))
            elif re.fullmatch(r"zero[0-3]", piece):
                zero = int(piece[4])
            elif mb:
                b, m = int(mb.group(1)), int(mb.group(2) or 0)
            elif re.fullmatch(r"hsdp\d+", piece):
                dp_shard = int(piece[4:])
            elif re.fullmatch(r"acc\d+", piece):
                accumulate = int(piece[3:])
            elif piece == "fold":
                fold = True
            elif piece == "ring":
                ring = True
            elif piece == "rs-mb":
                grad_reduce = "micro_batch"
            elif piece in ("ac", "sp", "sel", "pw", "op"):
                ac, sp = ac or piece == "ac", sp or piece == "sp"
                sel, pw, op = sel or piece == "sel", pw or piece == "pw", op or piece == "op"
            elif sched and sched.group(1) in SCHEDULES:
                schedule, v = sched.group(1), int(sched.group(2) or 0)
            else:
                raise ValueError(f"--layout {text!r}: {piece!r} is not a part of a layout (dpN, tpN, ppN, cpN, epN,"
                                 f" zero0-3, hsdpN, rs-mb, mbB or mbBxM, a schedule {sorted(SCHEDULES)} with /vN, accN,"
                                 " ac, sel, pw, op, sp, fold, ring).")
    tp, pp, cp, ep = (sizes.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    if min(tp, pp, cp, ep, b) < 1:
        raise ValueError(f"--layout {text!r}: every size must be positive.")
    dp = sizes.get("dp", devices // (tp * pp * cp))
    if dp < 1 or dp * tp * pp * cp != devices:
        raise ValueError(f"--layout {text!r}: dp {dp} x tp {tp} x pp {pp} x cp {cp} is not the {devices} devices.")
    if accumulate > 1 and pp == 1:
        raise ValueError(f"--layout {text!r}: acc{accumulate} runs a pipeline's schedule {accumulate} times per step:"
                         " it needs pp > 1 (without a pipeline, mbBxM's M micro-batches are the accumulation).")
    if global_batch % (dp * b * accumulate):
        raise ValueError(f"--layout {text!r}: the global batch {global_batch} does not split into dp={dp} replicas"
                         f" of {accumulate} x micro-batches of {b}.")
    m = m or global_batch // (dp * b * accumulate)
    if dp * b * m * accumulate != global_batch:
        raise ValueError(f"--layout {text!r}: dp {dp} x mb{b}x{m} x acc{accumulate} = {dp * b * m * accumulate}"
                         f" sequences, not the global batch {global_batch}.")
    if not tp_divides(model, tp):
        raise ValueError(f"--layout {text!r}: tp={tp} must divide the heads ({model.heads}), key/value heads"
                         f" ({model.kv_heads}), MLP ({model.ffn}), vocabulary ({model.vocab}) and shared experts"
                         f" ({model.shared_ffn}) of {model.name}.")
    if sp and tp == 1:
        raise ValueError(f"--layout {text!r}: sequence parallelism (sp) needs tp > 1.")
    if ring and cp == 1:
        raise ValueError(f"--layout {text!r}: ring attention (ring) passes keys and values around the CP ranks: it"
                         " needs cp > 1.")
    v = v or (2 if schedule == "zero_bubble" else 1)
    if pp > 1:
        resolve_schedule(schedule, pp, m, v)
    if sel + pw + op > 1:
        raise ValueError(f"--layout {text!r}: sel (the attention core recomputed), pw (the attention core and the"
                         " element-wise ops) and op (torchtitan's per-op policy) are recompute modes: give one.")
    # selective recompute of the attention core (sel), of it and the element-wise ops (pw), torchtitan's (op)
    selective = {"recompute": "attention" if sel else "pointwise" if pw else "op"} if sel or pw or op else {}
    layout = Layout(dp, tp, pp, zero, b, m, schedule, v, ac, sp, ep=ep, cp=cp, dp_shard=dp_shard,
                    grad_reduce=grad_reduce, accumulate=accumulate, ep_folding=fold,
                    cp_attention="ring" if ring else "all_gather", **selective)
    layout.check_model(model)
    return layout


def format_layout(c: Candidate, cluster: Cluster) -> str:
    """One layout's memory per device by kind, whether it fits and by how much, and its predicted step."""
    m, usable = c.memory, USABLE_MEMORY * cluster.memory
    lines = [f"layout {c.layout.label()}: peak {m.total / GIB:.2f} GiB per device (pipeline rank {m.rank}) of"
             f" {cluster.memory / GIB:.2f} GiB on {cluster.name} ({usable / GIB:.2f} GiB usable, {USABLE_MEMORY:.0%})"]
    for label, value in (("parameters", m.params), ("gradients", m.grads), ("optimizer state", m.optimizer),
                         ("activations", m.activations), ("buffers", m.buffers)):
        lines.append(f"  {label:<16} {value / GIB:9.2f} GiB  {value / m.total if m.total else 0:6.1%}")
    if c.fits:
        t = c.time
        lines.append(f"fits: {(usable - m.total) / GIB:.2f} GiB to spare of the usable {usable / GIB:.2f} GiB"
                     f" ({(usable - m.total) / usable:.1%}); predicted step {t.total:.4g} s, {c.tokens_per_s:.4g}"
                     f" tokens/s, MFU {c.mfu:.3f}")
    else:
        lines.append(f"does not fit: {(m.total - usable) / GIB:.2f} GiB over the usable {usable / GIB:.2f} GiB"
                     f" ({(m.total - usable) / usable:.1%} over)")
    return "\n".join(lines)


#: How far the description's parameter count may be from transformers' model before ``--hf-config`` refuses it
#: (``--allow-mismatch`` plans it anyway): beyond a few norms or biases, whole layers the planner cannot describe.
MISMATCH_TOLERANCE = 0.02


def describe_hf(config: Any, spec: ModelSpec, allow_mismatch: bool = False) -> str:
    """The header of ``--hf-config``: the parameter count derived from the config against transformers' own (the
    model built on the meta device), and what is not modelled. Raises ``ValueError`` when they differ by more than
    `MISMATCH_TOLERANCE` (layers that are not the decoder blocks the planner describes: state-space, linear-attention
    or convolution mixers, ...) unless ``allow_mismatch``."""
    types = [str(t) for t in (getattr(config, "layer_types", None) or [])]
    other = sorted({t for t in types if not t.endswith("attention") or "linear" in t})
    if other and not allow_mismatch:
        raise ValueError(
            f"{spec.name}: {sum(t in other for t in types)} of its {len(types)} layers are {', '.join(other)} (its"
            " config's layer_types), which the planner does not describe (softmax attention, full, sliding or"
            " chunked, with a dense or mixture-of-experts MLP); --allow-mismatch plans them as attention layers")
    try:
        real = hf_parameter_count(config)
    except Exception as err:  # transformers' own defaults for some types do not build (their bug, not the config's)
        real, why = None, f"{type(err).__name__}: {err}"
    if real is None:
        check = (f"{spec.params:,} parameters described, not checked: transformers could not build the model from"
                 f" this config ({why})")
    elif real == spec.params:
        check = f"{spec.params:,} parameters, the same as AutoModelForCausalLM.from_config's on the meta device"
    else:
        off = (spec.params - real) / real
        if abs(off) > MISMATCH_TOLERANCE and not allow_mismatch:
            raise ValueError(
                f"{spec.name}: the planner describes {spec.params:,} parameters, AutoModelForCausalLM.from_config has"
                f" {real:,} ({off:+.1%}, beyond {MISMATCH_TOLERANCE:.0%}): its layers are not all decoder blocks the"
                " planner can describe (attention with a dense or mixture-of-experts MLP; state-space, linear-"
                "attention or convolution mixers are not); --allow-mismatch plans the description anyway")
        check = (f"{spec.params:,} parameters described, AutoModelForCausalLM.from_config has {real:,}"
                 f" ({spec.params - real:+,}, {off:+.2%}: parts of {spec.name} the planner does not describe; memory"
                 " and time are estimated for the description)")
    extras = [f"head_dim {spec.head_dim}" if spec.head_size else "", "tied embeddings" if spec.tied_embeddings else "",
              "gated MLP" if spec.gated_mlp else "plain MLP", "biases" if spec.bias else
              ("q/k/v biases" if spec.qkv_bias else ""), "MLA attention" if spec.attention_matrices else "",
              f"{spec.n_layer - spec.moe_layers} dense first layers" if spec.is_moe and spec.moe_layers < spec.n_layer
              else ""]
    lines = [f"config {spec.name}: {check}; {', '.join(e for e in extras if e)}"]
    lines += [f"modelled in part: {note}" for note in hf_notes(config, spec)]
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
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="preset, config.json (or folder), or GPTConfig fields a=1,b=2"
                       " (MoE: experts=8,top_k=2,expert_ffn=..,moe_layers=..,shared_ffn=..)")
    which.add_argument("--hf-config", help="a transformers config: a local folder, a config.json, or a model type"
                       " (llama, qwen2, mixtral, deepseek_v3, ...: transformers' defaults)")
    p.add_argument("--override", action="append", default=[], metavar="K=V[,K=V]",
                   help="--hf-config fields (hidden_size=4096,num_hidden_layers=32); repeatable")
    p.add_argument("--allow-mismatch", action="store_true", help="--hf-config: plan a description whose parameter"
                   f" count is more than {MISMATCH_TOLERANCE:.0%}% from transformers' model (default: refuse it)")
    p.add_argument("--layout", default=None, help="one layout to check, as the table writes them: 'dp8xtp8',"
                   " 'dp4xtp8xpp2 zero1 mb1x16 ac sp' (its memory by kind, whether it fits, the margin)")
    p.add_argument("--cluster", default="cpu", help="a100, h100, cpu, or a cluster JSON (default: cpu)")
    p.add_argument("--precision", default=None, choices=sorted(PRECISIONS), help="what the runtime keeps in which"
                   " dtype (default: the cluster's; bf16-mixed on the GPU presets, this codebase's; fsdp-bf16:"
                   " FSDP2 with bf16 parameters and no autocast, torchtitan's; megatron-flash: Megatron's states as"
                   " the ZeRO paper counts them, flash attention; megatron-core: with fp32 main gradients, as"
                   " Megatron-Core keeps them in bf16 runs)")
    p.add_argument("--attention-speed", type=float, default=None, metavar="X",
                   help="the attention kernel's speed relative to the GEMMs' (default: the cluster's, 1;"
                        f" FlashAttention-2 on H100: {FA2_ON_HOPPER:.2f})")
    p.add_argument("--ep-overlap", action="store_true", help="expert parallelism's all-to-alls under another"
                   " micro-batch's computation of the block (Megatron-Core's --overlap-moe-expert-parallel-comm;"
                   " default: synchronous, as this codebase's)")
    p.add_argument("--ep-folding", action="store_true", help="search expert parallelism folded over the TP ranks too"
                   " (Megatron-Core's MoE parallel folding, expert TP 1; 'fold' in --layout)")
    p.add_argument("--window-kernels", action="store_true", help="the attention kernel skips what a sliding window"
                   " masks (FlashAttention, flex attention, transformers' flash_attention_2): a windowed model's"
                   " attention at the window's cost (default: every key up to the query, this codebase's SDPA)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--no-sequence-parallel", action="store_true", help="leave sequence parallelism out")
    p.add_argument("--no-context-parallel", action="store_true", help="leave context parallelism (cp) out")
    p.add_argument("--documents", action="store_true", help="batches hold documents (packed, left padding): their"
                   " attention takes a mask, kept per layer without cp, one call's block under cp (default: plain"
                   " causal batches)")
    p.add_argument("--compile", action="store_true", help="the strategy's compile=True: ZeRO-3 gathers whole"
                   " layers (default: a layer's parts, one at a time)")
    p.add_argument("--fp8", default=None, choices=FP8_RECIPES, help="the strategy's fp8 recipe: the linears on the"
                   " float8 tensor cores, their casts and amax all-reduces (GPU presets with float8: h100)")
    p.add_argument("--fp8-all-gather", action="store_true", help="the strategy's fp8_all_gather=True (with --fp8"
                   " tensorwise): ZeRO-3 gathers the converted weights in float8")
    p.add_argument("--async-tp", action="store_true", help="the strategy's async_tp=True (CUDA, compiled, sequence"
                   " parallel): TP's forward collectives under the forward's GEMMs (torch's micro-pipelined TP)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R", help="LoRA of rank R on the blocks' matrices"
                   " (CausalLM(lora=...)): the base frozen, no gradients or optimizer state for it (default: 0, every"
                   " parameter trains)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", default=None, help="write every candidate to this file")
    args = p.parse_args(argv)
    try:
        if args.override and not args.hf_config:
            raise ValueError("--override takes --hf-config (--model takes its overrides after a comma).")
        if args.hf_config:
            config = hf_config(args.hf_config, parse_overrides(args.override))
            model = ModelSpec.from_hf(config, args.seq_len)
            header = describe_hf(config, model, args.allow_mismatch)
        else:
            model, header = model_spec(args.model, args.seq_len), ""
        if args.lora_rank:
            model = dataclasses.replace(model, lora_rank=args.lora_rank)
        cluster = load_cluster(args.cluster)
        if args.precision:
            cluster = dataclasses.replace(cluster, precision=args.precision)
        if args.attention_speed is not None:
            if not args.attention_speed > 0:
                raise ValueError(f"--attention-speed {args.attention_speed}: must be > 0 (1: attention at the GEMMs'"
                                 f" rate; {FA2_ON_HOPPER:.2f}: FlashAttention-2 on H100)")
            cluster = dataclasses.replace(cluster, attention_speed=args.attention_speed)
        if args.fp8_all_gather:
            if args.fp8 != "tensorwise":
                raise ValueError(f"--fp8-all-gather casts each weight shard with the whole weight's one scale: it"
                                 f" needs --fp8 tensorwise (got --fp8 {args.fp8})")
            cluster = dataclasses.replace(cluster, fp8_all_gather=True)
        if args.ep_overlap or args.ep_folding:
            cluster = dataclasses.replace(cluster, ep_comm_overlap=args.ep_overlap, ep_folding=args.ep_folding)
        if args.window_kernels:
            cluster = dataclasses.replace(cluster, window_kernels=True)
        if args.async_tp:
            cluster = dataclasses.replace(cluster, tp_comm_overlap=True, tp_overlap_backward=False)
        if args.compile or args.async_tp:
            # Compiled: ZeRO 1-2 gather in the step (the strategy's overlap_param_gather), TP's collectives are
            # functional (no all-reduce under the weight gradient's GEMM).
            cluster = dataclasses.replace(cluster, param_gather_overlap=False, tp_grad_reduce_overlap=False)
        layout = parse_layout(args.layout, model, args.devices, args.global_batch) if args.layout else None
        result = plan(model, cluster, args.devices, args.global_batch,
                      sequence_parallel=not args.no_sequence_parallel,
                      context_parallel=not args.no_context_parallel, documents=args.documents, compile=args.compile,
                      fp8=args.fp8)
        chosen = (evaluate(model, layout, cluster, args.global_batch, args.documents, args.compile, args.fp8)
                  if layout else None)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if header:
        print(header)
    print(format_plan(result, args.top))
    if chosen is not None:
        print("\n" + format_layout(chosen, cluster))
    if args.json:
        payload = {"model": result.model.__dict__, "cluster": result.cluster.name, "devices": result.devices,
                   "global_batch": result.global_batch, "ranked": [c.as_dict() for c in result.ranked],
                   "too_big": [c.as_dict() for c in result.too_big], "invalid": dict(result.invalid)}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    if chosen is not None:
        return 0 if chosen.fits else 1
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
