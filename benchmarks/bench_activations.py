"""Activation memory per transformer layer under TP, sequence parallelism and selective recompute, beside
Korthikanti et al. (2022); logits memory per rank with and without the vocab-parallel loss; step times.

    python benchmarks/bench_activations.py [--seq 256 --batch 2 --hidden 256 --heads 8 --vocab 8192 --tps 1 2 4]

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

The table is printed and written to benchmarks/ACTIVATIONS.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing, recompute_selection  # noqa: E402
from lightning_hybrid.memory import LiveTensorTracker  # noqa: E402
from lightning_hybrid.tensor_parallel import apply_tp, resolve_tp_plan  # noqa: E402
from lightning_hybrid.tensor_parallel.comm import sum_grads_over_tp_  # noqa: E402
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


def formula(config: str, s: int, b: int, h: int, a: int, t: int) -> float:
    sp, recompute = CONFIGS[config]
    linear = s * b * h * (72 / t if sp else 24 + 48 / t)
    core = 0 if recompute == "attention" else 12 * a * s * s * b / t
    return linear + core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
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
    text = "\n".join([header, "", *rows, "", *logits_rows, ""])
    print(text)
    from benchmarks.report import header

    title = header("Activation memory (benchmarks/bench_activations.py)")
    (REPO_ROOT / "benchmarks" / "ACTIVATIONS.md").write_text(title + text)


if __name__ == "__main__":
    main()
