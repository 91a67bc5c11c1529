"""`ParameterGathers`: ZeRO 1-2's all-gather of the updated slices, bucket by bucket under the next forward.

After the optimizer step each rank holds only its own updated slice of every bucket; the others' arrive by an
all-gather (`lightning_hybrid.parallel.zero.buckets._Bucket.start_gather`). Queued by the step (in the order the
next forward needs the buckets: the reverse of backward's) and started asynchronously once the step's own
collectives are done (`start`: the strategy's agreement on a SIGTERM, which would otherwise wait behind them), the
gathers run under the loop's bookkeeping and the next forward, as Megatron-Core's ``--overlap-param-gather`` runs
them, and nothing may read a parameter before its bucket has arrived. Rather than trusting that only the owning
modules' forwards read parameters, a `torch.overrides.TorchFunctionMode` (`_WaitOnUse`) is on from the end of the
step (`guard`) to the end of the next training step's forward (`release`): every torch function that takes a
parameter whose bucket is still in flight -- a layer's ``F.linear``, a tied head's ``self.wte.weight``,
``p.detach()`` in a callback's ``on_train_batch_end``, a ``state_dict``, ``_foreach`` ops over a list of them --
first waits for that bucket. What reads storage without a torch function (checkpoints, through DCP) is preceded by
`release`, as are the next optimizer step, validation and the end of the run. The parameters any code sees are the
gathered ones: the run is bit for bit the one that gathers after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class _WaitOnUse(TorchFunctionMode):
    """Waits for a parameter's bucket before any torch function that takes the parameter runs."""

    def __init__(self, gathers: "ParameterGathers") -> None:
        super().__init__()
        self.gathers = gathers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.gathers.pending:  # every tensor among the arguments, however nested (lists, dicts)
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, Tensor):
                    self.gathers.wait_for(value)
        return func(*args, **kwargs)


class ParameterGathers:
    """The all-gathers of ZeRO 1-2's buckets in flight between an optimizer step and the next forward.

    ``deferring``: whether the optimizers' steps queue their gathers here (`queue`) instead of waiting for them (set
    by the strategy: ZeRO 1-2, nothing compiled, automatic optimization). ``waited_on_use`` counts the buckets a read
    waited for (the forward found them still in flight or just arrived), ``waited_at_release`` those waited for at
    `release`: the run's evidence that the gathers were overlapped at all.
    """

    def __init__(self) -> None:
        self.deferring = False
        self.pending: dict[int, _InFlight] = {}  # id(parameter) -> its bucket's gather
        self._queue: list[_InFlight] = []  # queued, not yet started (in the order every rank starts them)
        self._mode: _WaitOnUse | None = None
        self.waited_on_use = 0
        self.waited_at_release = 0

    def queue(self, starts: list[Callable[[], Callable[[], None]]], params: list[list[Tensor]]) -> None:
        """Queue a gather per bucket -- ``starts[i]()`` starts it and returns its wait -- bringing ``params[i]``; they
        start, in this order on every rank, at `start` (or where a read needs one: it and those queued before it)."""
        for start, ps in zip(starts, params):
            flight = _InFlight(start, ps)
            self._queue.append(flight)
            for p in ps:
                self.pending[id(p)] = flight

    def start(self) -> None:
        """Start the queued gathers (after the step's own collectives: the strategy's agreement on a SIGTERM would
        otherwise wait behind them, and with it the next forward)."""
        self._start_until(None)

    def _start_until(self, last: "_InFlight | None") -> None:
        while self._queue:
            flight = self._queue.pop(0)
            flight.start()
            if flight is last:
                return

    def wait_for(self, tensor: Tensor) -> None:
        """If ``tensor`` is a parameter whose bucket is in flight: wait for it (`_WaitOnUse`)."""
        flight = self.pending.get(id(tensor))
        if flight is not None:
            self._finish(flight)
            self.waited_on_use += 1

    def _finish(self, flight: "_InFlight") -> None:
        for p in flight.params:  # first: what the wait reads of them must not wait again
            self.pending.pop(id(p), None)
        if flight in self._queue:
            self._start_until(flight)
        flight.wait()

    def guard(self) -> None:
        """From now on until `release`, a read of a parameter in flight waits for it (no-op with none in flight)."""
        if self.pending and self._mode is None:
            self._mode = _WaitOnUse(self)
            self._mode.__enter__()

    def wait_all(self) -> None:
        """Wait for every gather in flight."""
        while self.pending:
            self._finish(next(iter(self.pending.values())))
            self.waited_at_release += 1

    def release(self) -> None:
        """Every gather done and the guard off: the parameters are whole again on every rank."""
        self.wait_all()
        self._pop()

    def drop(self) -> None:
        """The run stops on an error: the guard off without waiting (a peer may never send)."""
        self.pending.clear()
        self._queue.clear()
        self._pop()

    def _pop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is mode:
            mode.__exit__(None, None, None)
        # else: a mode pushed later and never popped sits above it; ours stays beneath, finding nothing pending


class _InFlight:
    """One bucket's gather: what starts it, then its wait; the parameters it brings."""

    def __init__(self, start: Callable[[], Callable[[], Any]], params: list[Tensor]) -> None:
        self._start, self.params = start, params
        self._wait: Callable[[], Any] | None = None

    def start(self) -> None:
        self._wait = self._start()

    def wait(self) -> None:
        assert self._wait is not None, "waited for a gather that was never started"
        self._wait()
