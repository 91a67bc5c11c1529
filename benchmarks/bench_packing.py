"""Packed documents against unpacked rows of the same token count: training step time on one CPU process.

    python benchmarks/bench_packing.py                      # GPT and Llama at T=512, 1024, 2048 (~8 min, 2 idle cores)
    python benchmarks/bench_packing.py --seq 512 --models gpt --steps 10   # quicker

Goal (issue): packing costs no more than 5% step time against padding-free unpacked batches of the same token
count, i.e. packed / unpacked <= 1.05.

Models, fp32, dropout 0, vocabulary 256, one process, ``torch.set_num_threads(--threads)``:

  gpt    the reference GPT (`GPTLightningModule`: n_layer=4, n_embd=256, n_head=8, gelu MLP, block_size=T)
  llama  a ``transformers`` Llama (`CausalLM("llama")`: hidden 256, 4 layers, 8 heads, intermediate 688, its default
         attention implementation, SDPA)

A step is what `LanguageModel.training_step` does, without the logging -- `TokenBatch.from_batch`, forward,
`LanguageModel.loss_fn`, backward -- then the AdamW of ``configure_optimizers`` steps and the gradients are zeroed.
Every variant holds the same ``--tokens`` tokens per step (B = tokens / T rows of T), but ``padded``:

  unpacked    B rows of T tokens (``input_ids``, ``labels``), no side input: plain causal attention (the baseline)
  packed      documents of random lengths (uniform 32..T/2, seeded; the last one of a row fills what is left of it,
              so there is no padding) packed into the same B rows by `pack_documents`; the model gets their
              ``position_ids``, and the package attends per document without a T x T mask
              (`lightning_hybrid.core.document_attention`: the GPT always, the Llama once its first packed forward
              has verified it against its own masked SDPA, `lightning_hybrid.hf.document_attention`)
  packed, T x T mask   the same, attending as the package did before: SDPA under the boolean (B, 1, T, T)
              document-causal mask (GPT: `document_causal_mask` built in every layer; Llama: transformers' ``sdpa``
              with its own masks)
  padded      the same documents one per row, padded to T (`pack_documents(pack=False)`): more rows, compared per
              real token (plain causal attention: `TokenBatch` needs no side input for such rows)
  packed, padded-doc SDPA   (GPT only; an experiment of this script) the GPT's attention on packed rows replaced by
              another exact alternative, see "attention alone"

Timing: every variant has its own model and optimizer (same init); ``--warmup`` steps, then ``--steps`` timed steps,
round-robin (one step of each variant in turn, the order rotated every round), so load that comes and goes on a
shared machine falls on all alike. Reported: the median wall time per step, the median process CPU time per step
(all threads: the work done, insensitive to other processes), and the median number of CPUs other processes kept
busy during a step (`benchmarks/machine_load.py`; above 0.25 the row is marked disturbed). "vs unpacked" is time
per real token over the unpacked baseline's (for packed: the step-time ratio, the goal's figure).

mask build: `document_causal_mask` on the packed ``position_ids``, the median of 50 calls, times n_layer (the GPT
builds it in every layer); `TokenBatch.from_batch` of the packed and unpacked dict batches (its host syncs).

attention alone (GPT shapes, B x 8 heads x T x 32, fp32): forward + backward of one layer's attention core on the
packed rows, median of ``--steps``, round-robin: ``is_causal`` (what unpacked rows get), the masked SDPA as the GPT
runs it (mask built in the call) and with a prebuilt mask, and exact alternatives for packed rows:

  document_attention   the package's: each document of each row on its own, ``is_causal=True`` (views of q/k/v,
                   outputs concatenated)
  padded-doc SDPA  the documents as the rows of one (documents, H, longest, D) batch, each padded at its end, one
                   ``is_causal=True`` call (the padding comes after a document's tokens: causal hides it)
  flex_attention   `torch.nn.attention.flex_attention` with a document-causal block mask, eager and under
                   ``torch.compile``: tried; its backward is not implemented on CPU in this torch (2.13), so it can
                   not train here (its eager forward is still checked)

"max |diff|" is against the masked SDPA (output, and gradients of q, k, v for a fixed output gradient); for the
full-model variants against the ``packed`` model (logits and parameter gradients of one step).

Before every round the script waits (polling every 30 s, at most ``--wait-pytest`` seconds in all) until no
``pytest`` process runs, then until other processes keep at most ``--max-other-load`` CPUs busy; a timed round in
which they kept more busy is run again (``--redo-budget`` seconds of waiting and redoing in all). The output says
how long it waited, how many rounds it ran again, and which rounds, if any, were kept disturbed or began while
pytest ran. The tables are printed and written to benchmarks/PACKING.md.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.machine_load import cpu_s, system_busy_s  # noqa: E402
from benchmarks.report import printed_to  # noqa: E402
from lightning_hybrid.core.batch import TokenBatch, document_causal_mask, document_ids, is_packed  # noqa: E402
from lightning_hybrid.core.document_attention import document_attention  # noqa: E402
from lightning_hybrid.data.sft import pack_documents  # noqa: E402
from lightning_hybrid.models import GPTLightningModule  # noqa: E402
from lightning_hybrid.models.gpt import CausalSelfAttention  # noqa: E402

VOCAB = 256
LAYERS, WIDTH, HEADS = 4, 256, 8
MIN_DOC = 32
DISTURBED = 0.25  # CPUs of foreign load above which a row is flagged
CAUSAL = "is_causal (as unpacked rows)"


# ---------------------------------------------------------------------------------------------- machine
def pytest_running() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0


class MachineGuard:
    """Keeps the timing off a busy machine. `pause` (before every round) waits, polling every 30 s, until no pytest
    process runs (at most ``pytest_s`` over the whole run), then, with ``settle`` (a measurement's first round, and
    after a refused one), in 2 s windows until other processes keep at most ``max_load`` CPUs busy. `keep` refuses
    a timed round in which they kept more busy (it is run again) while ``redo_s`` of waiting and redoing is left.
    Past either budget the timing goes on, and the output says so."""

    def __init__(self, pytest_s: float, redo_s: float, max_load: float) -> None:
        self.pytest_left, self.redo_left, self.max_load = pytest_s, redo_s, max_load
        self.waited_pytest = self.waited_idle = 0.0
        self.redone = 0
        self.under_pytest: list[str] = []
        self.kept_disturbed: list[str] = []

    def pause(self, where: str, settle: bool) -> None:
        t0 = time.perf_counter()
        while pytest_running():
            if time.perf_counter() - t0 >= self.pytest_left:
                self.under_pytest.append(where)
                break
            print(f"  (pytest is running: waiting before {where})", file=sys.__stdout__, flush=True)
            time.sleep(30.0)
        spent = time.perf_counter() - t0
        self.pytest_left, self.waited_pytest = max(0.0, self.pytest_left - spent), self.waited_pytest + spent
        t0 = time.perf_counter()
        while settle and self.redo_left > time.perf_counter() - t0:
            with Timer() as idle:
                time.sleep(2.0)
            if idle.other is None or idle.other <= self.max_load:
                break
        spent = time.perf_counter() - t0
        self.redo_left, self.waited_idle = max(0.0, self.redo_left - spent), self.waited_idle + spent

    def keep(self, where: str, timers: list[Timer], spent_s: float) -> bool:
        """Whether to keep a timed round (else it is run again)."""
        if all(t.other is None or t.other <= self.max_load for t in timers):
            return True
        if self.redo_left > 0:
            self.redo_left, self.redone = max(0.0, self.redo_left - spent_s), self.redone + 1
            return False
        self.kept_disturbed.append(where)
        return True

    def summary(self) -> str:
        def named(what: list[str]) -> str:
            return f"{len(what)} ({'; '.join(what[:3])}{'; ...' if len(what) > 3 else ''})" if what else "none"

        return (f"Waited {self.waited_pytest:.0f} s for pytest processes to end and {self.waited_idle:.0f} s for other"
                f" load to drop to {self.max_load} CPUs; {self.redone} timed rounds run again (disturbed). Rounds begun"
                f" while pytest ran: {named(self.under_pytest)}; disturbed rounds kept (redo budget spent):"
                f" {named(self.kept_disturbed)}.")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


class Timer:
    """Wall time, this process's CPU time and the CPUs other processes kept busy, of one timed region."""

    def __enter__(self) -> "Timer":
        self.t, self.cpu, self.busy = time.perf_counter(), cpu_s(resource.RUSAGE_SELF), system_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t
        self.own = cpu_s(resource.RUSAGE_SELF) - self.cpu
        busy = system_busy_s()
        self.other = None if busy is None or self.busy is None else max(0.0, busy - self.busy - self.own) / self.wall


# ---------------------------------------------------------------------------------------------- data
def documents(tokens: int, seq: int, seed: int) -> list[list[int]]:
    """Token ids of documents of uniform random length in [MIN_DOC, seq // 2], rows of ``seq`` filled exactly: a
    document that would overflow its row, or leave less than MIN_DOC of it, is cut to what is left of it."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(tokens // seq):
        left = seq
        while left:
            n = int(torch.randint(MIN_DOC, seq // 2 + 1, (1,), generator=g))
            n = left if n > left - MIN_DOC else n
            docs.append(torch.randint(0, VOCAB, (n,), generator=g).tolist())
            left -= n
    return docs


def batches(tokens: int, seq: int, seed: int) -> dict[str, dict[str, Tensor]]:
    """The dict batches of the three layouts of the same tokens (see the module docstring)."""
    docs = [(ids, [True] * len(ids)) for ids in documents(tokens, seq, seed)]
    packed = pack_documents(docs, seq, pad_id=0, pack=True)
    rows = tokens // seq
    assert packed["input_ids"].shape == (rows, seq) and bool(packed["attention_mask"].all()), "rows not filled"
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed + 1))
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    return {"unpacked": {"input_ids": ids, "labels": labels}, "packed": packed,
            "padded": pack_documents(docs, seq, pad_id=0, pack=False)}


# ---------------------------------------------------------------------------------------------- attention cores
# (q, k, v) (B, H, T, D) of packed rows and their position_ids (B, T) -> (B, H, T, D), causal within each document.
Core = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor) -> Tensor:
    """What the GPT does: SDPA with the boolean document-causal mask, built here."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(position_ids))


def document_lengths(position_ids: Tensor) -> list[list[int]]:
    """Per row, the lengths of its documents in order (one host sync)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids.diff(dim=-1) != 1
    rows: list[list[int]] = [[] for _ in range(position_ids.size(0))]
    for b, t in starts.nonzero().tolist():
        rows[b].append(t)
    T = position_ids.size(1)
    return [[e - s for s, e in zip(at, at[1:] + [T])] for at in rows]


def padded_document_sdpa(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor) -> Tensor:
    """The documents as the rows of one batch (N documents, H, longest L, D), each padded at its end, one
    ``is_causal=True`` call: a query sees only keys at or before it, all of its own document."""
    B, H, T, D = q.shape
    lengths = [n for row in document_lengths(position_ids) for n in row]
    L = max(lengths)
    slot = torch.cat([torch.arange(n) + i * L for i, n in enumerate(lengths)])  # token (row-major) -> padded slot

    def to_documents(t: Tensor) -> Tensor:  # (B, H, T, D) -> (N, H, L, D)
        tokens = t.transpose(1, 2).reshape(B * T, H, D)
        return tokens.new_zeros(len(lengths) * L, H, D).index_copy(0, slot, tokens).view(-1, L, H, D).transpose(1, 2)

    y = F.scaled_dot_product_attention(to_documents(q), to_documents(k), to_documents(v), is_causal=True)
    return y.transpose(1, 2).reshape(-1, H, D).index_select(0, slot).view(B, T, H, D).transpose(1, 2)


CORES: dict[str, Core] = {"padded-doc SDPA": padded_document_sdpa}


def use_attention_core(model: torch.nn.Module, core: Core) -> None:
    """Make every `CausalSelfAttention` of ``model`` run ``core`` on packed rows: its own forward with the SDPA call
    swapped (no dropout: these models have none); checked against the masked model by `compare_models`."""
    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        repeat = q.size(1) // k.size(1)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if is_packed(position_ids):
            y = core(q, k, v, position_ids)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))

    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.forward = types.MethodType(forward, module)


# ---------------------------------------------------------------------------------------------- models
def build(kind: str, seq: int, core: Optional[Core] = None, dense: bool = False):
    """A LightningModule (built, initialised identically every time) and its optimizer; ``dense``: packed rows
    attend under a T x T mask, as before `lightning_hybrid.core.document_attention`."""
    if kind == "gpt":
        module = GPTLightningModule(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, block_size=seq, vocab_size=VOCAB)
    else:
        from lightning_hybrid.hf import CausalLM

        module = CausalLM("llama", config={"hidden_size": WIDTH, "num_hidden_layers": LAYERS,
                                           "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                                           "intermediate_size": 688, "vocab_size": VOCAB,
                                           "max_position_embeddings": seq})
    module.configure_model()
    if dense and kind == "gpt":
        core = masked_sdpa
    elif dense:  # transformers' own sdpa and its masks
        module.model.set_attn_implementation("sdpa")
        module.document_attention = None
    if core is not None:
        use_attention_core(module.model, core)
    module.train()
    optimizer = module.configure_optimizers()
    return module, optimizer


def forward_backward(module, batch: dict[str, Tensor]) -> Tensor:
    tokens = TokenBatch.from_batch(batch)
    logits = module(tokens.input_ids, **tokens.model_inputs())
    module.loss_fn(logits, tokens.labels).backward()
    return logits


def train_step(module, optimizer, batch: dict[str, Tensor]) -> None:
    forward_backward(module, batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def compare_models(reference, other, batch: dict[str, Tensor]) -> float:
    """Max |diff| of the logits and parameter gradients of one step of two models with the same weights (after a
    forward of each: a transformers model's first packed forward is its masked SDPA, verifying what the next run)."""
    with torch.no_grad():
        for module in (reference, other):
            tokens = TokenBatch.from_batch(batch)
            module(tokens.input_ids, **tokens.model_inputs())
    a, b = forward_backward(reference, batch), forward_backward(other, batch)
    diff = (a - b).abs().max().item()
    for p, q in zip(reference.parameters(), other.parameters()):
        diff = max(diff, (p.grad - q.grad).abs().max().item())
    reference.zero_grad(set_to_none=True)
    other.zero_grad(set_to_none=True)
    return diff


def n_documents(batch: dict[str, Tensor]) -> int:
    if "position_ids" not in batch:
        return batch["input_ids"].size(0)  # one per row
    return int(((batch["position_ids"] == 0) & batch["attention_mask"].bool()).sum())


def round_robin(runs: dict[str, Callable[[], None]], warmup: int, steps: int, guard: MachineGuard,
                label: str) -> dict[str, list[Timer]]:
    """``warmup`` untimed then ``steps`` timed rounds, each one call of every run in turn (the order rotated); a
    disturbed timed round is run again while the guard allows."""
    names = list(runs)
    timed: dict[str, list[Timer]] = {name: [] for name in names}
    i, settle = 0, True
    while i < warmup + steps:
        where = f"{label} round {i + 1}"
        guard.pause(where, settle)
        t0 = time.perf_counter()
        rounds: dict[str, Timer] = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            with Timer() as rounds[name]:
                runs[name]()
        settle = i >= warmup and not guard.keep(where, list(rounds.values()), time.perf_counter() - t0)
        if settle:
            continue  # run again, once the machine is quiet
        if i >= warmup:
            for name, t in rounds.items():
                timed[name].append(t)
        i += 1
    return timed


def median(timers: list[Timer], field: str) -> float:
    values = [getattr(t, field) for t in timers if getattr(t, field) is not None]
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------- measurements
def bench_model(kind: str, seq: int, args, guard: MachineGuard) -> dict[str, tuple[float, float]]:
    """Print the step-time rows of one model at one T; return each variant's (median step time in s, vs unpacked)."""
    data = batches(args.tokens, seq, args.seed)
    variants = {"unpacked": (build(kind, seq), data["unpacked"]), "packed": (build(kind, seq), data["packed"]),
                "packed, T x T mask": (build(kind, seq, dense=True), data["packed"]),
                "padded": (build(kind, seq), data["padded"])}
    checks = {"packed, T x T mask": compare_models(variants["packed"][0][0], variants["packed, T x T mask"][0][0],
                                                   data["packed"])}
    if kind == "gpt":
        for name, core in CORES.items():
            variants[f"packed, {name}"] = (build(kind, seq, core), data["packed"])
            checks[f"packed, {name}"] = compare_models(variants["packed"][0][0], variants[f"packed, {name}"][0][0],
                                                       data["packed"])
    runs = {name: (lambda m=m, o=o, b=b: train_step(m, o, b)) for name, ((m, o), b) in variants.items()}
    timed = round_robin(runs, args.warmup, args.steps, guard, f"{kind} T={seq}")
    base = median(timed["unpacked"], "wall") / args.tokens
    base_cpu = median(timed["unpacked"], "own") / args.tokens
    results = {}
    for name, ((_, _), batch) in variants.items():
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        wall, own, other = (median(timed[name], f) for f in ("wall", "own", "other"))
        paired = statistics.median((t.wall / real) / (u.wall / args.tokens)
                                   for t, u in zip(timed[name], timed["unpacked"]))
        flag = " (disturbed)" if other > DISTURBED else ""
        diff = f"{checks[name]:.1e}" if name in checks else ""
        print(f"| {kind} | {seq} | {name} | {batch['input_ids'].size(0)} x {seq} | {n_documents(batch)} | {real} |"
              f" {wall * 1e3:.0f} | {own * 1e3:.0f} | {wall / real * 1e6:.1f} | **{wall / real / base:.3f}** |"
              f" {paired:.3f} | {own / real / base_cpu:.3f} | {other:.2f}{flag} | {diff} |", flush=True)
        results[name] = (wall, wall / real / base)
    return results


def bench_mask(seq: int, args, packed_step: Optional[float]) -> str:
    data = batches(args.tokens, seq, args.seed)
    pos = TokenBatch.from_batch(data["packed"]).position_ids

    def timed(f: Callable[[], object], n: int = 50) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    mask = timed(lambda: document_causal_mask(pos))
    packed, unpacked = (timed(lambda b=data[k]: TokenBatch.from_batch(b)) for k in ("packed", "unpacked"))
    share = f"{mask * LAYERS / packed_step:.1%}" if packed_step else "(GPT not timed)"
    return (f"| {seq} | {args.tokens // seq} x {seq} | {mask * 1e3:.2f} | {mask * LAYERS * 1e3:.2f} | {share} |"
            f" {packed * 1e3:.2f} | {unpacked * 1e3:.2f} |")


def bench_attention(seq: int, args, guard: MachineGuard) -> None:
    data = batches(args.tokens, seq, args.seed)
    pos = TokenBatch.from_batch(data["packed"]).position_ids
    B, D = args.tokens // seq, WIDTH // HEADS
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, grad = (torch.randn(B, HEADS, seq, D, generator=g) for _ in range(4))
    prebuilt = document_causal_mask(pos)
    cores: dict[str, Core] = {
        CAUSAL: lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "masked SDPA (as the GPT: mask built)": masked_sdpa,
        "masked SDPA, prebuilt mask": lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, attn_mask=prebuilt),
        "document_attention (the package's)": lambda q, k, v, p: document_attention(q, k, v, p),
        **CORES,
    }

    def run(core: Core) -> tuple[Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = core(*leaves, pos)
        y.backward(grad)
        return (y.detach(), *(t.grad for t in leaves))

    reference = run(masked_sdpa)
    diffs = {name: max((a - b).abs().max().item() for a, b in zip(run(core), reference))
             for name, core in cores.items()}
    timed = round_robin({name: (lambda c=core: run(c)) for name, core in cores.items()}, args.warmup, args.steps,
                        guard, f"attention T={seq}")
    base = median(timed[CAUSAL], "wall")
    masked = median(timed["masked SDPA (as the GPT: mask built)"], "wall")
    for name in cores:
        wall, other = median(timed[name], "wall"), median(timed[name], "other")
        diff = "(not document-causal)" if name == CAUSAL else f"{diffs[name]:.1e}"
        print(f"| {seq} | {name} | {wall * 1e3:.1f} | {wall / base:.2f} | {wall / masked:.2f} | {diff} |"
              f" {other:.2f}{' (disturbed)' if other > DISTURBED else ''} |", flush=True)
    print(f"| {seq} | flex_attention | {flex_attention_status(q, k, v, pos, reference[0])} | | | | |")


def flex_attention_status(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, reference: Tensor) -> str:
    """Whether flex_attention with a document-causal block mask trains on CPU here, and its forward's max |diff|."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"not available ({e})"
    docs = document_ids(pos)
    block_mask = create_block_mask(lambda b, h, i, j: (docs[b, i] == docs[b, j]) & (i >= j), q.size(0), None,
                                   q.size(2), q.size(2), device="cpu")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    try:
        diff = (flex_attention(q, k, v, block_mask=block_mask) - reference).abs().max()
        forward = f"forward max \\|diff\\| {diff:.1e}"
    except Exception as e:  # noqa: BLE001 -- reported, not raised
        forward = f"forward fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    backward = []
    for how, attend in (("eager", flex_attention), ("torch.compile", torch.compile(flex_attention))):
        try:
            attend(q.clone().requires_grad_(), k, v, block_mask=block_mask).sum().backward()
            backward.append(f"{how}: backward runs")
        except Exception as e:  # noqa: BLE001
            backward.append(f"{how}: {type(e).__name__}: {str(e).split('.')[0][:100]}")
    return f"{forward} (eager); training: " + "; ".join(backward)


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048], help="row lengths T")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (a multiple of every T)")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-pytest", type=float, default=900.0,
                        help="seconds in all to wait for pytest processes to end, before the timing and between"
                        " rounds (polled every 30 s)")
    parser.add_argument("--max-other-load", type=float, default=DISTURBED,
                        help="CPUs other processes may keep busy during a timed round before it is run again")
    parser.add_argument("--redo-budget", type=float, default=600.0,
                        help="seconds in all to spend waiting for a quiet machine and re-running disturbed rounds")
    args = parser.parse_args()
    for seq in args.seq:
        if args.tokens % seq or seq < 4 * MIN_DOC:
            parser.error(f"--tokens {args.tokens} must be a multiple of T={seq}, and T >= {4 * MIN_DOC}")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    guard = MachineGuard(args.wait_pytest, args.redo_budget, args.max_other_load)
    out = REPO_ROOT / "benchmarks" / "PACKING.md"
    with printed_to(out, "Packed vs unpacked step time (benchmarks/bench_packing.py)"):
        import transformers

        print(f"CPU: {cpu_name()}; torch.set_num_threads({torch.get_num_threads()}); fp32; torch {torch.__version__},"
              f" transformers {transformers.__version__}, Python {platform.python_version()}.")
        print(f"{args.tokens} tokens per step; documents uniform {MIN_DOC}..T/2 tokens (seed {args.seed}), rows filled"
              f" exactly; {args.warmup} warm-up + {args.steps} timed steps per variant, round-robin; medians.")
        print("\n## Step time\n")
        print("vs unpacked = time per real token / the unpacked row's (packed: step-time ratio; goal <= 1.05);"
              " paired: the median over rounds of that ratio within a round;"
              " CPU ratio: the same with process CPU time; other load: CPUs other processes kept busy (median);"
              " max |diff|: logits and gradients against the `packed` model (same weights).\n")
        print("| model | T | variant | rows x T | documents | real tokens | step ms | CPU ms | us / real token |"
              " vs unpacked | paired | CPU ratio | other load | max \\|diff\\| |")
        print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        results = {(kind, seq): bench_model(kind, seq, args, guard) for seq in args.seq for kind in args.models}
        print("\nGoal packed / unpacked <= 1.05: " + "; ".join(
            f"{kind} T={seq}: {r['packed'][1]:.3f} ({'met' if r['packed'][1] <= 1.05 else 'MISSED'})"
            + "".join(f", {name.split(', ')[1]} {r[name][1]:.3f}" for name in r if name.startswith("packed, "))
            for (kind, seq), r in results.items()) + ".")
        print("\n## Mask building (GPT)\n")
        print("| T | rows x T | `document_causal_mask` ms / call | ms / step (x n_layer) | % of the packed step |"
              " `from_batch` packed ms | `from_batch` unpacked ms |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for seq in args.seq:
            print(bench_mask(seq, args, results[("gpt", seq)]["packed"][0] if ("gpt", seq) in results else None))
        print(f"\n## Attention alone (one layer, B x {HEADS} x T x {WIDTH // HEADS}, forward + backward)\n")
        print("| T | core | ms | vs is_causal | vs masked | max \\|diff\\| vs masked | other load |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for seq in args.seq:
            bench_attention(seq, args, guard)
        print(f"\n{guard.summary()} Total run time {time.perf_counter() - t_start:.0f} s.")


if __name__ == "__main__":
    main()
