"""Random ops (dropout, router noise, sampling) under a layout: one device's draws, or independent streams that
are said to be so -- never the same mask on ranks that hold different data.

**What one device draws.** Every rank starts from the run's seed, so every rank draws what one device draws for a
tensor of the shape it holds. That is one device's mask only where the rank holds the tensor one device holds: a
TP group's replicated activations (outside the spans between a column-split and a row-split layer, where the
activations are split by heads or features). Everywhere else the masks are not one device's, and worse, they are
the same on ranks holding different data: data-parallel and CP ranks (other samples, other tokens), the two
halves of a sequence under SP, the heads of a split attention, the micro-batches of a pipeline.

**So**, with ``randomness="exact"`` (the default) the strategy watches the first training step (`RandomOpsProbe`:
every random op torch runs -- ``dropout``, SDPA's ``dropout_p``, ``bernoulli``, ``rand*``, ``normal_``,
``multinomial``, ... -- while the module trains) and refuses, on every rank before the first optimizer step, a
random op that cannot draw one device's values under the layout, naming it and the module that ran it. With
``randomness="independent"`` the run is statistically, not bitwise, one device's (Megatron's model-parallel RNG,
without its one flaw: here data-parallel ranks differ too): every rank's streams are seeded from the run's seed
and its place -- data-parallel, CP and pipeline ranks apart, TP ranks together (their replicated activations stay
identical) -- and inside a TP split span (`SplitSpans`) each TP rank draws from a stream of its own, derived from
the shared one (so a recomputing checkpoint, which restores the shared stream, draws the same masks again). Under
sequence parallelism every region between the TP layers is split too: every TP rank has its own streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["RANDOMNESS", "RandomOpsProbe", "SplitSpans", "is_random_op", "rank_seed", "seed_streams"]

RANDOMNESS = ("exact", "independent")

_RANDOM = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.bernoulli, torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint,
    torch.randint_like, torch.randperm, torch.normal, torch.multinomial, torch.poisson,
    torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
    torch.Tensor.log_normal_, torch.Tensor.multinomial,
}


def is_random_op(func: Callable, args: tuple, kwargs: Mapping) -> bool:
    if func in _RANDOM:
        if func in (torch.nn.functional.dropout, torch.dropout) or "dropout" in getattr(func, "__name__", ""):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            return bool(train) and float(p) > 0
        return True
    if func is torch.nn.functional.scaled_dot_product_attention:
        return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)) > 0
    return False


class SplitSpans:
    """Where a TP group's activations are split: from the output of a column-split layer (whose output is not
    gathered) to the input of the next row-split layer, found with hooks on those layers (`attach`). ``inside``
    says whether the forward is in such a span now. With ``switch`` (``randomness="independent"``, TP without
    sequence parallelism) the default generator of ``device`` is swapped, for the span, for one of this TP rank's
    own, seeded from the shared generator's state and ``tp_rank``; the shared one is advanced by one draw (the next
    span gets another seed) and restored at the span's end."""

    def __init__(self, tp_rank: int, device: torch.device, switch: bool) -> None:
        self.tp_rank, self.device, self.switch = tp_rank, device, switch
        self.inside = False
        self._shared: Optional[Tensor] = None
        self._handles: list = []

    def attach(self, module: nn.Module) -> None:
        from lightning_hybrid.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        for sub in module.modules():
            if isinstance(sub, ColumnParallelLinear) and not sub.gather_output:
                self._handles.append(sub.register_forward_hook(lambda *_: self.enter()))
            elif isinstance(sub, RowParallelLinear) and sub.input_is_parallel:
                self._handles.append(sub.register_forward_pre_hook(lambda *_: self.leave()))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.leave()

    def enter(self) -> None:
        if self.inside:
            return
        self.inside = True
        if not self.switch:
            return
        generator = _generator(self.device)
        seed = _hash(generator.get_state(), self.tp_rank)
        _advance(generator)
        self._shared = generator.get_state()
        generator.manual_seed(seed)

    def leave(self) -> None:
        if not self.inside:
            return
        self.inside = False
        if self._shared is not None:
            _generator(self.device).set_state(self._shared)
            self._shared = None


class RandomOpsProbe(TorchFunctionMode):
    """While active (a training step), records each random op torch runs (`is_random_op`), with the module that ran it
    (``stack``: kept by forward hooks on every submodule, `watch`) and whether it ran inside a TP split span
    (``spans``)."""

    def __init__(self, spans: Optional[SplitSpans]) -> None:
        super().__init__()
        self.spans = spans
        self.found: list[tuple[str, str, bool]] = []  # (op, module, inside a split span)
        self.stack: list[str] = []
        self._handles: list = []

    def watch(self, module: nn.Module) -> "RandomOpsProbe":
        def enter(name: str) -> None:
            self.stack.append(name)

        def leave() -> None:  # a forward hook's return value would replace the module's output
            if self.stack:
                self.stack.pop()

        for name, sub in module.named_modules():
            self._handles.append(sub.register_forward_pre_hook(lambda *_, n=name: enter(n)))
            self._handles.append(sub.register_forward_hook(lambda *_: leave()))
        return self

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[Mapping] = None):
        kwargs = kwargs or {}
        if is_random_op(func, args, kwargs):
            inside = self.spans is not None and self.spans.inside
            where = self.stack[-1] if self.stack and self.stack[-1] else "the module itself"
            entry = (getattr(func, "__name__", str(func)), where, inside)
            if entry not in self.found:
                self.found.append(entry)
        return func(*args, **kwargs)


def rank_seed(seed: int, dp_rank: int, cp_rank: int, pp_rank: int, tp_rank: Optional[int]) -> int:
    """A rank's seed from the run's ``seed`` and its place (``tp_rank`` ``None``: shared by the TP group)."""
    text = f"{seed}|dp{dp_rank}|cp{cp_rank}|pp{pp_rank}|tp{'shared' if tp_rank is None else tp_rank}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def seed_streams(seed: int, device: torch.device) -> None:
    """This rank's default generators (the CPU's and ``device``'s) seeded with ``seed``."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        _generator(device).manual_seed(seed)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def _hash(state: Tensor, tp_rank: int) -> int:
    digest = hashlib.blake2b(state.numpy().tobytes() + f"|tp{tp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _advance(generator: torch.Generator) -> None:
    """One draw from ``generator``, without reading it back (no host sync on an accelerator)."""
    if generator.device.type == "cpu":
        torch.empty(1, device="cpu").random_(generator=generator)
    else:
        generator.set_offset(generator.get_offset() + 4)
