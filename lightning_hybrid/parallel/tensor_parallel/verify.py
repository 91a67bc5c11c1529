"""Setup-time verification: a split is used only if it reproduces the unsplit module, numerically.

The unit of verification is a block: the repeated layer (an element of an ``nn.ModuleList``, or a pipeline
layer) that holds the units, or the unit itself. Its inputs are captured from one forward of the model on an
example input (`capture_inputs`), so a block is called exactly as the model calls it (hidden states, masks,
rotary embeddings, alibi ...). `check_block` then runs, in fp32 with the TP collectives live:
- the unsplit block with its weights perturbed by seeded noise (so zero-initialised weights hide nothing),
- a copy with the candidate variants applied,
on the same inputs and the same random output gradient, and compares outputs, input gradients and every
parameter gradient (TP shards gathered), then the outputs of both called without autograd, as validation and
prediction call them (torch's own layers take inference fast paths there that read their weights directly:
``nn.TransformerEncoderLayer``'s would compute one rank's part of a split MLP). A replicated parameter whose
gradient on each rank is only this rank's part (a per-head norm between a column and a row layer) is reported, so
training sums it over TP.
Every check is collective over the TP group and all its ranks reach the same verdict.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_hybrid.core.collectives import all_reduce, gather_shard
from lightning_hybrid.core.devices import module_device
from lightning_hybrid.parallel.tensor_parallel.layers import tp_shard_specs
from lightning_hybrid.parallel.tensor_parallel.variants import Variant

RTOL = 1e-4  # relative to the largest magnitude of the tensor compared; fp32 TP reorderings give ~1e-7
ATOL = 1e-7


@dataclass
class Captured:
    """A module call: a snapshot of its arguments (tensors detached; other objects, such as a key/value cache
    the call appends to, deep-copied), and which tensors required grad."""

    args: tuple
    kwargs: dict
    requires_grad: list[bool]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "Captured":
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        first = args[0] if args and isinstance(args[0], Tensor) else None
        flags = [t.requires_grad or t is first for t in leaves]
        detached = tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else _snapshot(t), (args, kwargs))
        return cls(detached[0], detached[1], flags)

    def materialize(self, device: torch.device) -> tuple[tuple, dict]:
        """Fresh copies on ``device`` (float tensors that required grad are new leaves requiring grad). Those
        activations get the same small seeded noise every time, so an example of repeated tokens (all-zero ids)
        still tells heads apart; masks, rotary tables and other inputs are left exactly as captured."""
        flags = iter(self.requires_grad)
        generator = torch.Generator(device="cpu").manual_seed(31)

        def fresh(t):
            if not isinstance(t, Tensor):
                return _snapshot(t)
            wanted = next(flags)
            out = t.detach().clone()
            if wanted and out.is_floating_point() and out.numel():
                scale = 0.1 * (out.float().std().item() if out.numel() > 1 else 1.0) or 0.1
                noise = torch.randn(out.shape, generator=generator, device=generator.device) * scale
                out = out + noise.to(device=out.device, dtype=out.dtype)
            out = out.to(device)
            return out.requires_grad_(wanted and out.is_floating_point())

        return tree_map(fresh, (self.args, self.kwargs))


def _snapshot(obj):
    try:
        return copy.deepcopy(obj)
    except Exception:  # an object that cannot be copied is passed as it is
        return obj


@dataclass
class Verdict:
    ok: bool
    detail: str = ""
    partial: tuple[str, ...] = ()  # replicated parameters (names relative to the block) with per-rank gradients
    head_inputs: dict[str, tuple] = field(default_factory=dict)  # unit (relative) -> inputs found to slice


def capture_inputs(modules: dict[str, nn.Module], run: Callable[[], object]) -> dict[str, Captured]:
    """Record the first call of each module while ``run()`` runs the model once (grad enabled, outputs dropped)."""
    captured: dict[str, Captured] = {}
    handles = []
    for name, module in modules.items():

        def hook(mod, args, kwargs, name=name):
            if name not in captured:
                captured[name] = Captured.of(args, kwargs)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _close(a: Tensor, b: Tensor, floor: float = 0.0) -> tuple[bool, float]:
    """Within RTOL of ``b``'s largest magnitude, or of ``floor`` when that is larger (a gradient that is zero
    in exact arithmetic, a key bias's say, is rounding noise of the block's gradients' scale)."""
    if a.shape != b.shape:
        return False, float("inf")
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return err <= RTOL * max(b.float().abs().max().item() if b.numel() else 0.0, floor) + ATOL, err


@torch.no_grad()
def _perturb(module: nn.Module, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for p in module.parameters():
        if p.is_floating_point():
            noise = torch.randn(p.shape, generator=generator, device=generator.device)
            noise = noise * (0.02 + 0.1 * p.detach().float().abs().mean().item())
            p.add_(noise.to(device=p.device, dtype=p.dtype))


def _forward(
    module: nn.Module, call: Captured, device: torch.device, seq_part: tuple[int, int] | None = None
) -> tuple[list[Tensor], list[Tensor], int | None]:
    """Outputs (tensors, flattened), the inputs that require grad, and (with ``seq_part = (rank, world)``, for
    sequence parallelism) the index among them of the main input, which the module gets as this rank's part of
    the sequence (dim 1)."""
    args, kwargs = call.materialize(device)
    main_index = None
    if seq_part is not None:
        rank, world = seq_part

        parts: list[Tensor] = []

        def part(t: Tensor) -> Tensor:
            parts.append(t.detach().chunk(world, dim=1)[rank].clone().requires_grad_(t.requires_grad))
            return parts[-1]

        args, kwargs = replace_main_input(args, kwargs, part)
        main = parts[0]
    outputs = [t for t in tree_flatten(module(*args, **kwargs))[0] if isinstance(t, Tensor)]
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
    if seq_part is not None:
        main_index = next(i for i, t in enumerate(inputs) if t is main)
    return outputs, inputs, main_index


def main_input(args: tuple, kwargs: dict) -> Tensor | None:
    """A module call's main input: its first positional tensor, else ``hidden_states``, else its first tensor
    keyword argument."""
    if args and isinstance(args[0], Tensor):
        return args[0]
    return kwargs.get("hidden_states", next((v for v in kwargs.values() if isinstance(v, Tensor)), None))


def replace_main_input(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the main input (the first positional tensor, else ``hidden_states``) mapped by ``fn``."""
    if args and isinstance(args[0], Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise TypeError(
        "sequence_parallel: a block or unit received no hidden states (neither a first positional tensor nor"
        " `hidden_states`); it cannot be split along the sequence."
    )


def _seq_part(t: Tensor | None, seq_part: tuple[int, int]) -> Tensor | None:
    return None if t is None else t.chunk(seq_part[1], dim=1)[seq_part[0]]


def _backward(outputs: list[Tensor], cotangents: list[Tensor | None]) -> None:
    terms = [(o * c).sum() for o, c in zip(outputs, cotangents) if c is not None and o.requires_grad]
    if terms:
        torch.stack(terms).sum().backward()


def check_block(
    block: nn.Module,
    choices: dict[str, Variant],
    call: Captured,
    group: dist.ProcessGroup,
    device: torch.device,
    apply_variant: Callable,
    sequence_parallel: bool = False,
) -> Verdict:
    """Whether ``block`` with ``choices`` (unit name relative to the block -> variant) applied equals the
    unsplit block on ``call``. With ``sequence_parallel`` the split block gets this rank's part of the sequence
    of its main input and must give that part of the main output (and of the main input's gradient).
    Collective over ``group``; every rank returns the same ``ok``."""
    seq_part = (dist.get_rank(group), dist.get_world_size(group)) if sequence_parallel else None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        reference = copy.deepcopy(block).float().to(device).eval()
        _perturb(reference, seed=1234)
        holder = nn.ModuleDict({"block": copy.deepcopy(reference)})  # so that the block itself can be replaced
        found: dict[str, list] = {}
        try:
            for rel, variant in choices.items():
                found[rel] = []
                apply_variant(holder, f"block.{rel}" if rel else "block", variant, group, detect=found[rel])
            candidate = holder["block"]
            ref_out, ref_in, _ = _forward(reference, call, device)
            out, inputs, main_index = _forward(candidate, call, device, seq_part)
            heads = {v.heads for v in choices.values() if v.heads and any(not lp.gather_output for _, lp in v.layers)}
            # The same random output gradient for both (an extra per-head output gets this rank's heads of it).
            generator = torch.Generator(device="cpu").manual_seed(99)
            ref_cot = [
                torch.randn(o.shape, generator=generator, device=generator.device).to(o)
                if o.is_floating_point() else None
                for o in ref_out
            ]
            cot = [_head_slice(o, c, heads, group) if c is not None else None for o, c in zip(out, ref_cot)]
            if seq_part is not None and cot:  # the main output: this rank's part of the sequence
                cot[0] = _seq_part(cot[0], seq_part)
            _backward(ref_out, ref_cot)
            _backward(out, cot)
            ref_out, out = _expected(out, ref_out, heads, group, seq_part), [o.detach() for o in out]
            dx, ref_dx = [t.grad for t in inputs], [t.grad for t in ref_in]
            if main_index is not None:
                ref_dx[main_index] = _seq_part(ref_dx[main_index], seq_part)
            # As validation and prediction call it: without autograd, where torch's own layers take fused inference
            # paths that read their weights directly (nn.TransformerEncoderLayer's), not through the split layers.
            with torch.no_grad():
                inference = _forward(candidate, call, device, seq_part)[0]
                ref_inference = _expected(inference, _forward(reference, call, device)[0], heads, group, seq_part)
            ran, detail = True, ""
        except Exception as err:  # a shape error in a wrong split: the same on every rank of the group
            ran, detail = False, f"{type(err).__name__}: {err}"
        if not _all(ran, group, device):
            return Verdict(False, detail or "failed on another rank")
        # From here every rank runs the same collectives whatever it finds, so none waits for another.
        ok, detail = _compare("output", out, ref_out)
        if ok:
            ok, detail = _compare("input gradient", dx, ref_dx)
        if ok:
            ok, detail = _compare("output without autograd", inference, ref_inference)
        params_ok, params_detail, partial = _compare_params(candidate, reference, group)
        ok, detail = (ok and params_ok), detail or params_detail
        ok = _all(ok, group, device)
        return Verdict(ok, detail if not ok else "", tuple(partial), {k: tuple(v) for k, v in found.items() if v})


def _expected(got: list[Tensor], want: list[Tensor], heads: set[int], group: dist.ProcessGroup,
              seq_part: tuple[int, int] | None) -> list[Tensor]:
    """The unsplit block's outputs ``want`` as the split block's ``got`` should be: per-head outputs sliced to this
    rank's heads, the main output to this rank's part of the sequence (``seq_part``); as they are when the two give
    different numbers of outputs (`_compare` names that)."""
    if len(got) != len(want):
        return want
    want = [_head_slice(o, r.detach(), heads, group) for o, r in zip(got, want)]
    if seq_part is not None and want:
        want[0] = _seq_part(want[0], seq_part)
    return want


def _head_slice(got: Tensor, want: Tensor, heads: set[int], group: dist.ProcessGroup) -> Tensor:
    """An extra output with one entry per head (eager attention probabilities ``[B, H, T, T]``) is this rank's
    heads of the unsplit one: return that slice of ``want`` to compare with (other outputs are unchanged)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if got.dim() != want.dim() or got.shape == want.shape:
        return want
    diff = [d for d in range(got.dim()) if got.size(d) != want.size(d)]
    if len(diff) == 1 and want.size(diff[0]) in heads and got.size(diff[0]) * tp == want.size(diff[0]):
        return want.narrow(diff[0], rank * got.size(diff[0]), got.size(diff[0]))
    return want


def _all(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank of ``group``."""
    return bool(all_reduce(torch.tensor([1 if flag else 0], device=device), group, "min").item())


def _compare(what: str, got: list[Tensor | None], want: list[Tensor | None]) -> tuple[bool, str]:
    if len(got) != len(want):
        return False, f"{what}: {len(got)} tensors, the unsplit module gives {len(want)}"
    for index, (a, b) in enumerate(zip(got, want)):
        if (a is None) != (b is None):
            return False, f"{what} {index}: present on one side only"
        if a is not None:
            close, err = _close(a, b)
            if not close:
                return False, f"{what} {index}: shape {list(a.shape)} vs {list(b.shape)}, max error {err:.3g}"
    return True, ""


def _compare_params(candidate: nn.Module, reference: nn.Module,
                    group: dist.ProcessGroup) -> tuple[bool, str, list[str]]:
    """Split parameters: gathered gradients equal the unsplit ones. Replicated ones: equal, or (partial) their
    sum over the group is. Every rank issues the same collectives in the same order, whatever it finds."""
    specs = tp_shard_specs(candidate)
    want = {n: p.grad for n, p in reference.named_parameters()}
    floor = 1e-2 * max((g.abs().max().item() for g in want.values() if g is not None and g.numel()), default=0.0)
    problems: list[str] = []
    replicated = []
    for name, param in candidate.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if name in specs:
            full = gather_shard(grad, specs[name][0], group)
            close, err = _close(full, want[name] if want[name] is not None else torch.zeros_like(full), floor)
            if not close:
                problems.append(f"gradient of {name}: max error {err:.3g}")
        else:
            replicated.append((name, grad))
    flat = [g.reshape(-1).float() for _, g in replicated] + [torch.zeros(0, device=module_device(candidate))]
    summed = all_reduce(torch.cat(flat), group)
    partial, offset = [], 0
    for name, grad in replicated:
        total = summed[offset : offset + grad.numel()].view_as(grad)
        offset += grad.numel()
        target = want[name] if want[name] is not None else torch.zeros_like(grad)
        if _close(grad, target, floor)[0]:
            continue
        if _close(total, target, floor)[0]:
            partial.append(name)
        else:
            problems.append(f"gradient of replicated {name}: max error {_close(grad, target, floor)[1]:.3g}")
    return not problems, "; ".join(problems[:3]), partial
