"""Activation memory per transformer layer under TP, sequence parallelism and selective recompute, beside
Korthikanti et al. (2022); logits memory per rank with and without the vocab-parallel loss; step times. And
activation memory per rank against sequence length under context parallelism (cp 1, 2, 4).

    python benchmarks/bench_activations.py [--seq 256 --batch 2 --hidden 256 --heads 8 --vocab 8192 --tps 1 2 4]
                                           [--cp-seqs 512 1024 2048 --cps 1 2 4 --cp-layers 4 --cp-hidden 128]
                                           [--cp-check 16x256] [--only tp|cp]

``--only`` runs one part; the report keeps the other part as its last run wrote it (under that run's command).

TP part:

The model is the one the formulas describe (GPT-2 layout, Korthikanti et al. section 4): pre-norm blocks of
LayerNorm -> separate q/k/v -> eager attention (QK^T, softmax, dropout, x V) -> o -> dropout -> residual,
LayerNorm -> fc1 (4h) -> GELU -> fc2 -> dropout -> residual; dropout 0.1 everywhere; fp32. It is split with the
strategy's own functions (`resolve_tp_plan` + `apply_tp` with its verification, `apply_activation_checkpointing`)
on ``tp`` gloo ranks (`run_distributed`), without Lightning, so only the layers are measured.

activations per layer = live tensor bytes the forward leaves for the backward (`LiveTensorTracker`), with 4
layers minus with 2, halved (the embedding, head and input cancel out); rank 0
formula (fp32, CPU)   = Korthikanti's per-layer bytes, s*b*h*(10 + 24/t + 5*a*s/(h*t)) for TP, s*b*h*(34/t +
                        5*a*s/(h*t)) for TP+SP, without the 5*a*s/(h*t) term under selective recompute, counted
                        for this run: every 16-bit tensor at 4 bytes and every dropout mask at 4 (CPU's dropout
                        keeps its mask in the activations' dtype; CUDA's in 1 byte): TP s*b*h*(24 + 48/t) +
                        12*a*s^2*b/t, TP+SP s*b*h*72/t + 12*a*s^2*b/t.
logits per rank       = live bytes the LM head and the cross entropy leave for the backward (Linear output and
                        the loss's saved softmax), with the logits kept split (loss_parallel) or gathered
step time             = forward + backward of the 4-layer model, the median of --steps after one warm-up (the
                        slowest rank each time), the configurations timed round-robin, one step each in turn,
                        so that load on the shared machine falls on all alike; ratio against plain TP at the
                        same tp (tp ranks on 2 cores: oversubscribed at tp 4)

CP part: the reference GPT (`GPTLightningModule`, dropout 0, fp32) fitted a few steps with a real
``Trainer(accelerator="cpu", devices=cp, strategy=HybridStrategy(dp=1, cp=cp))`` per cp on `run_distributed`
ranks, one sequence of T tokens per step (`ByteCorpusDataModule(block_size=T)`):

activation peak per rank = the highest, during a step (steps 2..: step 1 also makes the optimizer's state), of the
                        live tensor bytes beyond the rank's state (parameters, buffers, gradients, optimizer
                        state): `PeakMemoryMonitor`'s tracker, kinds and step window; the highest rank
/ cp=1's, × cp          = that peak against cp=1's at the same T, and times cp (goal: within 1.10 of 1)
parts                   = the tensors alive at that peak, by shape and where they were made (the CP attention's
                        `_find_documents` and `_attend` are wrapped to say so): bool masks (a chunk's mask under
                        attention chunks; none for plain batches or documents, attended per document), float
                        masks made inside an SDPA call, the whole sequence's keys and values (gathered,
                        reordered, and their gradients), and per-token (the rest: T/cp rows per rank)
--cp-check              = a deeper, wider model at the longest T, cp first and last: the same measurement

Both tables are printed and written to benchmarks/ACTIVATIONS.md.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from lightning_hybrid.core.collectives import sum_grads_over_tp_  # noqa: E402
from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing, recompute_selection  # noqa: E402
from lightning_hybrid.parallel.tensor_parallel import apply_tp, resolve_tp_plan  # noqa: E402
from lightning_hybrid.runs.memory import LiveTensorTracker, PeakMemoryMonitor, _storages  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402

DROPOUT = 0.1


class Attention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        return self.drop(self.o((probs @ v).transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(h), Attention(h, heads), nn.LayerNorm(h), MLP(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LM(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def trunk(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.trunk(ids))


CONFIGS = {  # name -> (sequence_parallel, recompute)
    "TP": (False, "full"),
    "TP + SP": (True, "full"),
    "TP + selective": (False, "attention"),
    "TP + SP + selective": (True, "attention"),
}


def _build(args, layers: int, sp: bool, recompute: str, split_logits: bool = True) -> LM:
    model = LM(layers, args.hidden, args.heads, args.vocab, args.seq)
    tp = dist.get_world_size()
    if tp > 1:
        example = torch.randint(0, args.vocab, (2, 16))
        result = apply_tp(model, dist.group.WORLD, resolve_tp_plan(model, tp), run_example=lambda: model(example),
                          sequence_parallel=sp, split_logits=split_logits)
        assert not result.errors, result.errors
        model.partial_grads = sorted(result.partial_grads)
    ops = recompute_selection(recompute)
    if ops is not None:
        apply_activation_checkpointing(model, [f"blocks.{i}" for i in range(layers)], ops)
    return model.train()


def _train_step(model: LM, ids: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward, backward and the strategy's sum over TP of the gradients that are per-rank parts."""
    F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    if dist.get_world_size() > 1:
        sum_grads_over_tp_([model.get_parameter(n).grad for n in model.partial_grads], dist.group.WORLD)


def _tracker(*tensors) -> LiveTensorTracker:
    """A tracker that knows the tensors that exist already (it counts every storage an op returns, views of
    parameters included)."""
    tracker = LiveTensorTracker("cpu")
    tracker.label([t for group in tensors for t in group], "other")
    return tracker


def _saved_bytes(model: LM, ids: torch.Tensor, targets: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Live bytes the forward (and loss) leave for the backward, beyond the parameters and inputs."""
    with _tracker(model.parameters(), model.buffers(), (ids, targets)) as tracker:
        before = tracker.total
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        return tracker.total - before, loss


def _head_bytes(model: LM, ids: torch.Tensor, targets: torch.Tensor) -> int:
    hidden = model.trunk(ids).detach().requires_grad_()
    with _tracker(model.parameters(), (ids, targets, hidden)) as tracker:
        before = tracker.total
        loss = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), targets.flatten())
        saved = tracker.total - before
    loss.backward()
    return saved


def _worker(args) -> dict:
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))
    out: dict = {}
    models = {}
    for name, (sp, recompute) in CONFIGS.items():
        tp = dist.get_world_size()
        if sp and tp == 1:
            continue  # SP needs tp > 1
        per_layers = {}
        for layers in (2, 4):
            model = _build(args, layers, sp, recompute)
            saved, loss = _saved_bytes(model, ids, targets)
            loss.backward()
            per_layers[layers] = saved
        out[name] = {"per_layer": (per_layers[4] - per_layers[2]) / 2}
        models[name] = model
    # Step times round-robin over the configurations (one step of each in turn), so that load that comes and
    # goes on the shared machine falls on all of them alike.
    times: dict = {name: [] for name in models}
    for step in range(args.steps + 1):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            _train_step(model, ids, targets)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:
                times[name].append(elapsed.item())
    for name in models:
        out[name]["step_s"] = statistics.median(times[name])
    for split_logits in (True, False):
        model = _build(args, 1, False, "full", split_logits=split_logits)
        out[f"logits split={split_logits}"] = _head_bytes(model, ids, targets)
    return out


# ---------------------------------------------------------------------------------------------- context parallelism
STATE_KINDS = ("parameters", "buffers", "gradients", "optimizer_state", "other")
CP_PARTS = ("per-token", "bool mask", "float mask", "whole-sequence K/V")
PHASES = {"activations": "forward", "temporary": "backward", "optimizer_step": "optimizer step"}


class _ActivationTracker(LiveTensorTracker):
    """`LiveTensorTracker` that also keeps the peak of the bytes beyond the rank's state (`STATE_KINDS`): what a
    step allocates and holds (forward activations, backward temporaries), with a description of every tensor
    alive at that peak (shape, dtype, op, `_REGION`) and the phase it came in (the tracker's kind then)."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        self._describe: tuple = ()
        self.meta: dict[int, tuple] = {}  # storage address -> (shape, dtype, op, region) of the tensor that made it
        self.act_peak = 0
        self.act_live: list[tuple[tuple, int]] = []  # ((shape, dtype, op, region), bytes) at act_peak
        self.act_phase = ""

    def _follow(self, storage, kind: str) -> None:
        if storage._cdata not in self._live:
            self.meta[storage._cdata] = self._describe
        super()._follow(storage, kind)

    def _activation_bytes(self) -> int:
        return self.total - sum(self.totals[k] for k in STATE_KINDS)

    def _update_peak(self) -> None:
        super()._update_peak()
        act = self._activation_bytes()
        if act > self.act_peak:
            self.act_peak, self.act_phase = act, self.kind
            live = self._live.copy()  # one C-level copy: a finalizer (gc) may release a storage while we read
            self.act_live = [(self.meta.get(key, ()), entry[0]) for key, entry in live.items()
                             if entry[1] not in STATE_KINDS]

    def reset_peak(self) -> None:
        super().reset_peak()
        self.act_peak, self.act_live, self.act_phase = self._activation_bytes(), [], self.kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._describe = (tuple(t.shape), t.dtype, func.__name__, _REGION[0])
                for storage in _storages(t):
                    self._follow(storage, self.kind) if storage._cdata not in self._live else self._resized(storage)
        return out


class _ActivationMonitor(PeakMemoryMonitor):
    """`PeakMemoryMonitor` run with `_ActivationTracker`; ``steps``: the activation peak of each measured step,
    with what was alive then (every tensor named by shape and dtype) and the phase (activations: forward,
    temporary: backward, optimizer_step)."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.activation_steps: list[dict] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self._tracker is None:
            self._tracker = _ActivationTracker(trainer.strategy.root_device.type)
            self._enter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        active = self._active
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if active:
            tracker = self._tracker
            self.activation_steps.append({"peak": tracker.act_peak, "phase": tracker.act_phase,
                                          "live": list(tracker.act_live)})
            tracker.meta = {key: tracker.meta[key] for key in tracker._live.copy() if key in tracker.meta}


_REGION: list = [None]  # where in the CP attention the ops run: "mask", "attention" or None (`_mark_regions`)


def _mark_regions() -> None:
    """Name the ops of the CP attention for the tracker: `ContextParallel._find_documents` ("mask": the
    batch's documents, found once per batch), and its `_attend` (the all-gather of keys and values, each call's
    mask and SDPA, forward and recomputation) and the gather's backward ("attention"). Wrappers in this process
    only; the computation is unchanged."""
    from lightning_hybrid.parallel import context_parallel as cpm

    if getattr(cpm, "_bench_regions", False):
        return
    cpm._bench_regions = True

    def region(name, fn):
        def wrapped(*args, **kwargs):
            saved, _REGION[0] = _REGION[0], name
            try:
                return fn(*args, **kwargs)
            finally:
                _REGION[0] = saved
        return wrapped

    cpm.ContextParallel._find_documents = region("mask", cpm.ContextParallel._find_documents)
    cpm.ContextParallel._attend = region("attention", cpm.ContextParallel._attend)
    cpm._GatherPrefixes.backward = staticmethod(region("attention", cpm._GatherPrefixes.backward))


def _part(meta: tuple, seq: int, local: int, cp: int) -> str:
    """Which part of the activations a tensor alive at the peak is (``meta``: its shape, dtype, the op that made
    it and `_REGION`). Under ``cp > 1``, inside the attention (`_attend`, the gather's backward): a bool tensor is
    one SDPA call's mask (a chunk's queries against the keys up to its last token: documents), a float one made
    by ``where`` inside ``scaled_dot_product_attention`` SDPA's copy of a mask (on CPU also of the lower-right
    causal block of a plain batch), an all-gather's piece (``empty_like``), a tensor with more tokens than the
    rank holds or the gradients' buffer (``new_zeros``, one part per rank) the whole sequence's keys and values;
    outside it, a tensor with more tokens than the rank holds is their gradients (SDPA's backward: a prefix of the
    sequence). The rest is per token (the rank's ``T / cp`` rows: layers' saved tensors, the attention's output,
    logits, loss; the batch's documents, ``(B, T)`` integers)."""
    if not meta or cp == 1:
        return "per-token"
    shape, dtype, op, where = meta
    beyond = len(shape) >= 3 and shape[-2] > local  # more tokens than the rank's own
    if where == "attention":
        if dtype == torch.bool:
            return "bool mask"
        if op.startswith("where"):
            return "float mask"
        if beyond or op.startswith(("empty_like", "new_zeros")):
            return "whole-sequence K/V"
        return "per-token"
    return "whole-sequence K/V" if beyond else "per-token"


def _packed(batch: tuple, fractions: tuple[float, ...] = (0.15, 0.45, 0.7)) -> dict:
    """An ``(x, y)`` byte batch as packed documents: every row split where ``fractions`` of its length fall (four
    documents of unequal lengths), positions restarting at 0 in each, the label of each document's last token
    ignored (it would be the next document's first)."""
    from lightning_hybrid.core.batch import IGNORE_INDEX

    x, y = batch
    length = x.size(1)
    positions = torch.arange(length, device=x.device)
    labels = y.clone()
    for start in (int(f * length) for f in fractions):
        positions = torch.where(torch.arange(length, device=x.device) >= start,
                                torch.arange(length, device=x.device) - start, positions)
        labels[:, start - 1] = IGNORE_INDEX
    return {"input_ids": x, "labels": labels, "position_ids": positions.expand_as(x)}


def _cp_worker(cfg: dict) -> list[dict]:
    """One rank: for each sequence length, a fit of the reference GPT under ``HybridStrategy(dp=1, cp=cp)``;
    returns per length the highest activation peak of steps 2.. (step 1 also makes the optimizer's state) and
    its parts."""
    import lightning as L

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.data.corpus import ByteCorpusDataModule
    from lightning_hybrid.models import GPTConfig, GPTLightningModule

    class PackedCorpus(ByteCorpusDataModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return _packed(batch)

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_hybrid"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _mark_regions()
    cp, out = cfg["cp"], []
    for kind, seq in [(kind, seq) for kind in cfg["data"] for seq in cfg["seqs"]]:
        L.seed_everything(0, verbose=False)
        config = GPTConfig(vocab_size=256, block_size=seq, n_layer=cfg["layers"], n_head=cfg["heads"],
                           n_embd=cfg["hidden"], dropout=0.0)
        module = GPTLightningModule(config=config, lr=1e-3)
        corpus = PackedCorpus if kind == "packed" else ByteCorpusDataModule
        data = corpus(block_size=seq, batch_size=cfg["batch"],
                                    max_bytes=(25 + 2 * (cfg["steps"] + 2) * cfg["batch"]) * (seq + 1))  # 5% held out
        monitor = _ActivationMonitor(cfg["steps"])
        start = time.perf_counter()
        attention = {"cp_attention": cfg["attention"]} if cp > 1 else {}
        trainer = L.Trainer(accelerator="cpu", devices=cp, strategy=HybridStrategy(dp=1, cp=cp, **attention),
                            max_steps=cfg["steps"], limit_val_batches=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
        trainer.fit(module, data)
        measured = monitor.activation_steps[1:]  # step 1 also allocates the optimizer's state
        top = max(measured, key=lambda s: s["peak"])
        parts = dict.fromkeys(CP_PARTS, 0)
        tensors: dict[tuple, list] = {}
        for meta, nbytes in top["live"]:
            part = _part(meta, seq, seq // cp, cp)
            parts[part] += nbytes
            if part != "per-token":
                shape, dtype, op, _ = meta
                entry = tensors.setdefault((part, shape, str(dtype).replace("torch.", ""), op), [0, 0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes
        out.append({"data": kind, "seq": seq, "peak": top["peak"], "step_peaks": [s["peak"] for s in measured],
                    "phase": top["phase"], "parts": parts, "tensors": tensors,
                    "state": {k: monitor.peak.after_step.get(k, 0) for k in STATE_KINDS},
                    "fit_s": time.perf_counter() - start})
    return out


def _cp_peaks(args, layers: int, hidden: int, seqs: list[int], cps: list[int],
              attention: str = "all_gather") -> dict[tuple[int, str, int], dict]:
    """``(cp, batches, T) ->`` the result of the rank with the highest activation peak (``"ranks"``: every rank's
    peak); ``attention``: the strategy's ``cp_attention`` for cp > 1."""
    cfg = {"seqs": seqs, "layers": layers, "hidden": hidden, "heads": args.cp_heads, "batch": args.cp_batch,
           "steps": args.cp_steps, "data": args.cp_data, "attention": attention}
    out = {}
    for cp in cps:
        start = time.perf_counter()
        ranks = run_distributed(_cp_worker, cp, {**cfg, "cp": cp})
        print(f"{layers}x{hidden}, cp={cp}: {time.perf_counter() - start:.0f} s", flush=True)
        for i, first in enumerate(ranks[0]):
            top = max((rank[i] for rank in ranks), key=lambda r: r["peak"])
            out[(cp, first["data"], first["seq"])] = {**top, "ranks": [rank[i]["peak"] for rank in ranks]}
    return out


def run_cp(args) -> str:
    """The CP part: per sequence length and cp, each rank's activation peak; the section of the report."""
    mib = 2**20
    models = [(args.cp_layers, args.cp_hidden, args.cp_seqs, args.cps)]
    if args.cp_check:
        layers, hidden = (int(v) for v in args.cp_check.lower().split("x"))
        models.append((layers, hidden, [max(args.cp_seqs)], [args.cps[0], args.cps[-1]]))
    rows = ["| model (layers x width) | batches | T | cp | activation peak per rank, MiB | / cp=1's | × cp | peak in |"
            " per-token part, MiB | per-token × cp / cp=1's | bool mask, MiB | float mask, MiB |"
            " whole-sequence K/V, MiB |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    detail, worst, worst_fused, state = [], {}, {}, None
    for layers, hidden, seqs, cps in models:
        peaks = _cp_peaks(args, layers, hidden, seqs, cps)
        model = f"{layers} x {hidden}"
        state = state or peaks[(cps[0], args.cp_data[0], seqs[0])]["state"]
        for kind, seq in [(kind, seq) for kind in args.cp_data for seq in seqs]:
            base = peaks[(cps[0], kind, seq)]
            for cp in cps:
                r, parts = peaks[(cp, kind, seq)], peaks[(cp, kind, seq)]["parts"]
                ratio = r["peak"] / base["peak"]
                if cp > 1:
                    worst[(model, kind)] = max(worst.get((model, kind), 0.0), ratio * cp)
                if cp > 1 and kind == "plain":  # without the block CPU materialises and CUDA's kernels do not
                    fused = (r["peak"] - parts["float mask"]) * cp / base["peak"]
                    worst_fused[model] = max(worst_fused.get(model, 0.0), fused)
                rows.append(f"| {model} | {kind} | {seq} | {cp} | {r['peak'] / mib:.2f} | {ratio:.3f} |"
                            f" {ratio * cp:.3f} |"
                            f" {PHASES.get(r['phase'], r['phase'])} | {parts['per-token'] / mib:.2f} |"
                            f" {parts['per-token'] * cp / base['parts']['per-token']:.3f} |"
                            f" {parts['bool mask'] / mib:.2f} | {parts['float mask'] / mib:.2f} |"
                            f" {parts['whole-sequence K/V'] / mib:.2f} |")
                where = f"- {model}, {kind}, T={seq}, cp={cp}:"
                if max(r["ranks"]) - min(r["ranks"]) >= 0.005 * mib:
                    detail.append(f"{where} the ranks' peaks are {min(r['ranks']) / mib:.3f} to"
                                  f" {max(r['ranks']) / mib:.3f} MiB (the table: the highest)")
                for (part, shape, dtype, op), (count, nbytes) in sorted(r["tensors"].items()):
                    detail.append(f"{where} {part}: {count} x {dtype} {tuple(shape)} (made by"
                                  f" `{op}`), {nbytes / mib:.2f} MiB")
    lines = [
        CP_TITLE,
        "",
        f"Reference GPT (`GPTLightningModule`, layers x width as below, n_head={args.cp_heads}, GELU MLP, V=256,"
        f" dropout 0, fp32), {args.cp_batch} sequence(s) of T tokens per step, fitted {args.cp_steps} steps with"
        " `Trainer(accelerator=\"cpu\", devices=cp, strategy=HybridStrategy(dp=1, cp=cp))` on"
        " `ByteCorpusDataModule(block_size=T)` (gloo ranks, `run_distributed`); batches: plain (one document per"
        " row, causal) or packed (each row four documents of 15%, 30%, 25% and 30% of T, positions restarting at"
        " 0). Activation peak = the highest live"
        " tensor bytes beyond the rank's state (parameters, buffers, gradients, optimizer state:"
        " `PeakMemoryMonitor`'s tracker and kinds) during a step, steps 2.. (step 1 also makes the optimizer's"
        " state), the highest rank; peak in = the phase it was reached in. Its parts, from each tensor alive at"
        " that moment (its shape and where it was made): each of the rank's two chunks attends the keys up to its"
        " last token -- plain batches one SDPA call each, causally aligned to the lower right (no mask tensor on"
        " CUDA; on CPU torch materialises that block as a float mask, `where`), packed batches one SDPA call per"
        " document the chunk meets (`document_block_attention`: no mask of the block; a document that starts"
        " before the chunk attends causally to the lower right, which CPU materialises the same way); the whole"
        " sequence's keys and values (the all-gather's pieces, their copy in the sequence's order, the gradients"
        " of the prefixes SDPA attended and their one buffer for the reduction); per-token: everything else (the"
        " rank's T/cp rows of the layers' saved tensors, logits, loss). The goal: × cp"
        " within 1.10. The second model (`--cp-check`) is the same measurement on a deeper, wider model at the"
        " longest T.",
        "",
        f"State per rank, not counted ({models[0][0]} x {models[0][1]}, cp={args.cps[0]}, T={args.cp_seqs[0]}): "
        + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in state.items() if v),
        "",
        *rows,
        "",
        "Highest × cp: " + "; ".join(f"{model}, {kind} batches: {value:.4f}"
                                     f" ({'within' if value <= 1.10 else 'above'} 1.10)"
                                     for (model, kind), value in worst.items()) + ".",
        "",
        "Plain batches without the lower-right causal block that torch materialises on CPU (the float mask of"
        " those rows; on CUDA `torch.nn.attention.bias.CausalBias` hands it to the flash or memory-efficient"
        " kernel as a mask type, no tensor -- not measured here, no GPU): highest × cp "
        + "; ".join(f"{model}: {value:.4f}" for model, value in worst_fused.items()) + ".",
        "",
        "What does not scale with T/cp, at each peak:",
        "",
        *detail,
        "",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def formula(config: str, s: int, b: int, h: int, a: int, t: int) -> float:
    sp, recompute = CONFIGS[config]
    linear = s * b * h * (72 / t if sp else 24 + 48 / t)
    core = 0 if recompute == "attention" else 12 * a * s * s * b / t
    return linear + core


ACTIVATIONS = REPO_ROOT / "benchmarks" / "ACTIVATIONS.md"
TP_TITLE = "## Tensor parallelism, sequence parallelism, selective recompute: per layer, beside Korthikanti et al."
CP_TITLE = "## Context parallelism: activation memory per rank against sequence length"
RING_TITLE = "## Context parallelism: ring attention against the all-gather"


RING_TIMES = ((2048, "plain"), (2048, "packed"), (4096, "plain"))  # (T, batches) of the ring's timing
RING_ROUNDS = 5


def _ring_time_worker(cfg: dict) -> dict:
    """One rank of the ring's timing: ``ring_attention`` forward and backward on this rank's zigzag chunks of a
    (1, heads, T, 64) fp32 attention, each chunk pair on SDPA's fused CPU kernel and on the explicit fp32 scores,
    alternately, a round at a time; seconds per call, the slowest rank's (a barrier after each)."""
    from lightning_hybrid.parallel.context_parallel import ring

    dist.init_process_group("gloo")
    fused = ring._kernel
    out = {}
    for seq, kind in cfg["cases"]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, cfg["heads"], seq // dist.get_world_size(), 64, generator=g).requires_grad_()
                   for _ in range(3))
        labels = (torch.arange(seq) * 4 // seq)[None] if kind == "packed" else None  # four documents
        times: dict = {"fused": [], "explicit": [], "checkpointed": []}
        for _ in range(cfg["rounds"] + 1):  # the first round warms up
            for name in times:
                ring._kernel = (lambda t: "explicit") if name == "explicit" else fused
                attend = ring.ring_attention
                if name == "checkpointed":  # as ContextParallel ran it before: backward runs the forward ring again
                    attend = partial(torch.utils.checkpoint.checkpoint, ring.ring_attention, use_reentrant=False)
                dist.barrier()
                start = time.perf_counter()
                attend(q, k, v, labels, dist.group.WORLD).sum().backward()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        ring._kernel = fused
        out[(seq, kind)] = {name: t[1:] for name, t in times.items()}
    dist.destroy_process_group()
    return out


def run_ring_time(args) -> list[str]:
    """The ring's attention alone at cp 2: SDPA's fused kernel per chunk pair against the explicit fp32 scores."""
    result = run_distributed(_ring_time_worker, 2, {"cases": RING_TIMES, "heads": 8, "rounds": RING_ROUNDS})[0]
    rows = ["| T | batches | fused kernel, ms | explicit scores, ms | fused / explicit (median of rounds) |"
            " checkpointed, ms | fused / checkpointed |", "|---:|---|---:|---:|---:|---:|---:|"]
    for (seq, kind), t in result.items():
        ratio = statistics.median(f / e for f, e in zip(t["fused"], t["explicit"]))
        again = statistics.median(f / c for f, c in zip(t["fused"], t["checkpointed"]))
        rows.append(f"| {seq} | {kind} | {statistics.median(t['fused']) * 1e3:.0f} |"
                    f" {statistics.median(t['explicit']) * 1e3:.0f} | {ratio:.2f} |"
                    f" {statistics.median(t['checkpointed']) * 1e3:.0f} | {again:.2f} |")
    return ["The ring's attention alone (`ring_attention`, forward and backward, 2 gloo ranks, one thread each; one"
            " sequence of T tokens, 8 heads of 64, fp32; packed: four documents): each chunk pair on SDPA's fused"
            " CPU kernel (`_scaled_dot_product_flash_attention_for_cpu` with the pair's mask, its log-sum-exp and"
            " backward) against the explicit fp32 scores (what runs on devices without such a kernel), and the fused"
            " ring as `ContextParallel` ran it before (checkpointed: backward runs the forward ring again; now the"
            f" ring keeps its output and log-sum-exp), alternately in {RING_ROUNDS} rounds after one warm-up.", "",
            *rows, ""]


#: (cp, query heads, key/value heads, dtype) of the ring's transient against the planner's `ring_transient_bytes`.
RING_TRANSIENTS = [(cp, heads, kv, dtype) for cp in (2, 4) for heads, kv in ((4, 4), (8, 1))
                   for dtype in ("float32", "bfloat16")]


def _ring_transient_worker(cfg: dict) -> list[dict]:
    """One rank: ``ring_attention`` alone on this rank's zigzag chunks of a (1, heads, T, 32) attention (key/value
    heads ``kv``), the live tensor bytes it adds at its peak beyond its inputs -- in forward beyond the output, in
    backward beyond the output and its gradient -- after one warm-up call (the kernels' one-time checks)."""
    from lightning_hybrid.parallel.context_parallel.ring import ring_attention

    dist.init_process_group("gloo")
    out = []
    for cp, heads, kv, dtype in cfg["cases"]:
        if cp != dist.get_world_size():
            continue
        g = torch.Generator().manual_seed(dist.get_rank())
        n, dt = cfg["seq"] // cp, getattr(torch, dtype)
        q = torch.randn(1, heads, n, 32, generator=g).to(dt).requires_grad_()
        k, v = (torch.randn(1, kv, n, 32, generator=g).to(dt).requires_grad_() for _ in range(2))
        grad = torch.randn(1, heads, n, 32, generator=g).to(dt)
        ring_attention(q, k, v, None, dist.group.WORLD).backward(grad)
        q.grad = k.grad = v.grad = None
        tracker = LiveTensorTracker("cpu")
        with tracker:
            output = ring_attention(q, k, v, None, dist.group.WORLD)
            forward = tracker.peak - output.untyped_storage().nbytes()
            tracker.reset_peak()
            base = tracker.total
            output.backward(grad)
            backward = tracker.peak - base
        out.append({"case": (cp, heads, kv, dtype), "forward": forward, "backward": backward})
    dist.destroy_process_group()
    return out


def run_ring_transient(args) -> list[str]:
    """What ring attention holds at its peak, measured, against the planner's `ring_transient_bytes`."""
    from lightning_hybrid.planner import ModelSpec
    from lightning_hybrid.planner.context_memory import ring_transient_bytes

    seq, rows = 2048, []
    for cp in (2, 4):
        cases = [c for c in RING_TRANSIENTS if c[0] == cp]
        measured = max(run_distributed(_ring_transient_worker, cp, {"cases": cases, "seq": seq}),
                       key=lambda r: sum(x["backward"] for x in r))
        for row in measured:
            cp, heads, kv, dtype = row["case"]
            element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            spec = ModelSpec("ring", 1, heads * 32, heads, kv, 4 * heads * 32, 256, seq)
            unit = 2 * (seq // cp) * heads * 32 * element  # the rank's own K and V at every query head
            predicted = ring_transient_bytes(spec, 1, element, 1, cp)
            rows.append(f"| {cp} | {heads} / {kv} | {dtype} | {row['forward'] / unit:.2f} |"
                        f" {row['backward'] / unit:.2f} | {predicted / unit:.2f} | {predicted / row['backward']:.2f} |")
    return ["What the ring holds (`ring_attention` alone, cp gloo ranks, one sequence of T = 2048 tokens, heads of"
            " 32; the live tensor bytes it adds at its peak beyond its inputs and output, and in backward beyond the"
            " output's gradient, the highest rank), in units of u = the rank's own K and V at every query head,"
            " against the planner's `ring_transient_bytes` (`lightning_hybrid/planner/context_memory.py`), which"
            " takes the backward's:", "",
            "| cp | heads / kv heads | dtype | forward, u | backward, u | planner, u | planner / backward |",
            "|---:|---|---|---:|---:|---:|---:|", *rows, ""]


def run_ring(args) -> str:
    """The ring part: at the longest T, each rank's activation peak with the keys and values all-gathered and passed
    around a ring (``cp_attention="ring"``), per model, batches and cp; the section of the report."""
    mib, seq = 2**20, max(args.cp_seqs)
    models = [(args.cp_layers, args.cp_hidden)]
    if args.cp_check:
        models.append(tuple(int(v) for v in args.cp_check.lower().split("x")))
    rows = ["| model (layers x width) | batches | T | cp | all-gather peak, MiB | × cp | ring peak, MiB | × cp |"
            " ring / all-gather |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for layers, hidden in models:
        gathered = _cp_peaks(args, layers, hidden, [seq], args.cps)
        ring = _cp_peaks(args, layers, hidden, [seq], [cp for cp in args.cps if cp > 1], "ring")
        for kind in args.cp_data:
            base = gathered[(args.cps[0], kind, seq)]["peak"]
            for cp in (cp for cp in args.cps if cp > 1):
                g, r = gathered[(cp, kind, seq)]["peak"], ring[(cp, kind, seq)]["peak"]
                rows.append(f"| {layers} x {hidden} | {kind} | {seq} | {cp} | {g / mib:.2f} | {g * cp / base:.3f} |"
                            f" {r / mib:.2f} | {r * cp / base:.3f} | {r / g:.3f} |")
    lines = [
        RING_TITLE,
        "",
        "The same fits as the section above (reference GPT, fp32, activation peak of a training step beyond the"
        " rank's state, highest rank, steps 2..), at the longest T, with"
        " `HybridStrategy(dp=1, cp=cp, cp_attention=\"ring\")` against the default all-gather; × cp = the peak"
        " against cp=1's at the same T, times cp. The ring holds two ranks' keys and values and what one chunk"
        " pair's kernel holds (its mask as a bias, its output) at a time, where the all-gather holds the whole"
        " sequence's keys and values of the layer it computes.",
        "",
        *rows,
        "",
        *run_ring_time(args),
        *run_ring_transient(args),
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def run_tp(args) -> str:
    """The TP part: per tp, activations per layer against the formulas, logits per rank, step times."""
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    mib = 2**20
    rows = ["| tp | configuration | activations per layer, MiB | formula, MiB | measured / formula | step time vs TP |",
            "|---:|---|---:|---:|---:|---:|"]
    logits_rows = ["| tp | logits + loss per rank, split (MiB) | gathered (MiB) | split / gathered | 1/tp |",
                   "|---:|---:|---:|---:|---:|"]
    for tp in args.tps:
        result = run_distributed(_worker, tp, args)[0]
        base = result["TP"]["step_s"]
        for config in CONFIGS:
            if config not in result:
                continue
            got, want = result[config]["per_layer"], formula(config, s, b, h, a, tp)
            rows.append(f"| {tp} | {config} | {got / mib:.2f} | {want / mib:.2f} | {got / want:.2f} |"
                        f" {base / result[config]['step_s']:.2f} |")
        split, gathered = result["logits split=True"], result["logits split=False"]
        logits_rows.append(f"| {tp} | {split / mib:.2f} | {gathered / mib:.2f} | {split / gathered:.2f}"
                           f" | {1 / tp:.2f} |")
        print("\n".join(rows[-len(result) + 2:]), flush=True)
    header = (f"s={s}, b={b}, h={h}, a={a}, V={args.vocab}, fp32, dropout {DROPOUT}; step time vs TP = TP's step time /"
              " this one's (> 1 faster)")
    text = "\n".join([TP_TITLE, "", header, "", *rows, "", *logits_rows, ""])
    print(text)
    return text


def _kept_section(title: str) -> str:
    """The section ``title`` of the report as the last run wrote it (a run of one part keeps the other), under a
    line naming the command and date that wrote it. The report before it had sections: its body is the TP part."""
    text = ACTIVATIONS.read_text() if ACTIVATIONS.exists() else ""
    written = re.search(r"^Written by (`[^`]*`) on ([0-9-]+ [0-9:]+)", text, re.M)
    chunks = re.split(r"(?m)^(?=## )", text)
    found = [c for c in chunks[1:] if c.startswith(title)]
    if found:
        body = found[0].split("\n", 1)[1]
    elif len(chunks) == 1 and written and title == TP_TITLE:
        body = "\n" + text[written.end():].split("\n", 1)[1].strip() + "\n"
    else:
        return f"{title}\n\nNot run yet: run the script without --only.\n"
    if written and not body.lstrip().startswith("Kept from"):
        body = (f"\nKept from the run of {written.group(1)} on {written.group(2)} (not rerun by the command above).\n"
                + body)
    return f"{title}\n{body.rstrip()}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("tp", "cp", "ring"), default=None,
                        help="run one part (the report keeps the other part from its last run)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="CP part: cp sizes (the first: base)")
    parser.add_argument("--cp-seqs", type=int, nargs="+", default=[512, 1024, 2048], help="CP part: lengths T")
    parser.add_argument("--cp-layers", type=int, default=4)
    parser.add_argument("--cp-hidden", type=int, default=128)
    parser.add_argument("--cp-heads", type=int, default=4)
    parser.add_argument("--cp-batch", type=int, default=1)
    parser.add_argument("--cp-steps", type=int, default=3, help="CP part: steps per fit (the first not measured)")
    parser.add_argument("--cp-data", nargs="+", choices=("plain", "packed"), default=["plain", "packed"],
                        help="CP part: batches of one document per row (plain causal) and/or packed documents")
    parser.add_argument("--cp-check", default="16x256",
                        help="CP part: a second model, LAYERSxWIDTH, at the longest T and the first and last cp"
                             " ('' to skip)")
    args = parser.parse_args()
    if args.cp_steps < 2:
        parser.error("--cp-steps must be at least 2: the first step is not measured")
    start = time.perf_counter()
    tp_text = run_tp(args) if args.only in (None, "tp") else _kept_section(TP_TITLE)
    cp_text = run_cp(args) if args.only in (None, "cp") else _kept_section(CP_TITLE)
    ring_text = run_ring(args) if args.only in (None, "ring") else _kept_section(RING_TITLE)
    from benchmarks.report import header

    title = header("Activation memory (benchmarks/bench_activations.py)")
    ACTIVATIONS.write_text(title + tp_text + "\n" + cp_text + ("\n" + ring_text if ring_text else ""))
    print(f"written to {ACTIVATIONS.relative_to(REPO_ROOT)} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
