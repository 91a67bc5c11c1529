"""What splitting the batch changes, measured on the model itself at the first training step -- as every TP split
is verified at setup -- and refused by name before anything trains.

Two splits cannot be verified layer by layer at setup, because what they change depends on the model's own code
around its data:

* **context parallelism** splits every sequence over the CP ranks. Exact for everything that treats tokens one by
  one and for ``scaled_dot_product_attention`` under the causal document mask (the CP attention rebuilds it for the
  whole sequence, a declared sliding window or chunks included). Anything else that mixes tokens or reads their
  places trains another model: a mask the model builds that says more (a window or chunks of its own), a
  convolution or a recurrence along the sequence, positions the model computes itself (``torch.arange`` instead of
  the batch's ``position_ids``), a scaling by the longest position a rank sees (dynamic RoPE, LongRoPE) or by each
  token's position as it sees it (attention temperature);
* **splitting the rows** of the global batch over data-parallel ranks, pipeline micro-batches or accumulation
  steps is exact for a model whose output for a row depends on that row alone -- not for one that reads the
  batch as a whole (dynamic RoPE scaled by the batch's longest position, BatchNorm).

So at the first call of the LightningModule's forward in training -- the call its ``training_step`` makes, whatever
it passes -- `FirstStepProbe` runs the model twice more on the same call, without gradients, in fp32 (no
autocast), with every random state, buffer and plain value of its modules restored afterwards:

* under CP, on the first row, in eval mode (no dropout): the whole sequence with the CP attention off (the model as
  one device runs it) and this rank's share with it on. The call's tensors that are fields of the rank's
  `TokenBatch` share are replaced by the whole batch's; the input of the first wrapped layer, every wrapped layer's
  output and the model's output are compared at this rank's places. A forward called with anything else of the
  batch cannot be reproduced whole, and CP refuses it;
* where rows are split, on the two rows of this rank's batch whose longest positions differ most (rows 0 and 1
  without positions): the shorter row beside the longer against the shorter alone, in training mode with the same
  random state (BatchNorm's batch statistics show only there; a model that draws random values is compared in eval
  mode instead), comparing the model's outputs.

A difference beyond fp32 noise (`RTOL`; 16-bit parameters `RTOL_16`) is a ``ValueError`` on every rank before the
first optimizer step, naming the first layer that differs (or the part before the layers) and what to do. Under
``pp > 1`` the same calls run through the pipeline stages (the layers compared where they live, the output on the
last stage). Cost: two forwards of one or two rows at the first step (four where a model that draws random values
is compared in eval mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_hybrid.checks.randomness import is_random_op
from lightning_hybrid.core.batch import TokenBatch
from lightning_hybrid.parallel.context_parallel import ContextParallel, zigzag_indices
from lightning_hybrid.parallel.float8 import float8_off

__all__ = ["RTOL", "RTOL_16", "FirstStepProbe"]

#: fp32: the CP attention and a row alone agree with one device to ~2e-7 of the outputs' scale (measured: the
#: reference GPT, a user module, Llama, Mistral with a window, Qwen3-MoE); LFM2's short convolutions show 1.4e-4 at a
#: random init.
RTOL = 2e-5
RTOL_16 = 3e-2


class FirstStepProbe:
    """Runs the checks of the module doc at the first call of ``module``'s forward in training.

    ``context``: the CP attention (``None`` without CP); ``whole``/``share``: the first training batch as read and
    this rank's CP share of it; ``rows``: the layout's splits of the rows in words ("dp=2", ...) or ``None``;
    ``pipeline``: ``(stage_modules, owners, pp_group)`` under ``pp > 1``. Collective over the world (every rank
    probes at the same call, whatever it finds)."""

    def __init__(self, module: nn.Module, context: Optional[ContextParallel], rows: Optional[str],
                 device: torch.device, pipeline: Optional[tuple[dict[int, nn.Module], list[int], Any]] = None) -> None:
        self.module, self.context, self.rows, self.device, self.pipeline = module, context, rows, device, pipeline
        self.whole: Optional[TokenBatch] = None
        self.share: Optional[TokenBatch] = None
        self.ran = False
        self._busy = False
        self._state: Optional[_State] = None

    # ------------------------------------------------------------------ the call
    def __call__(self, args: tuple, kwargs: dict) -> None:
        """At the module's first forward in training (its forward pre-hook, or the pipeline's deferred call): the
        checks, then on every rank the first problem any rank found as a ``ValueError``."""
        if self.ran or self._busy:
            return
        self.ran, self._busy = True, True
        try:
            problems = []
            with _quiet(self.module, self.device) as self._state:
                if self.context is not None:  # (which also sees what the rows would: a rank's tokens are a split)
                    problems.append(self._check_context(args, kwargs))
                elif self.rows is not None:
                    problems.append(self._check_rows(args, kwargs))
        finally:
            self._busy = False
        found = next((p for p in problems if p is not None), None)
        verdicts: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, found)
        found = next((v for v in verdicts if v is not None), None)
        if found is not None:
            raise ValueError(found)

    def _forward(self, args: tuple, kwargs: dict, training: bool = False) -> Optional[Tensor]:
        """The model's output for this call, from the state the step starts from, in eval mode or (``training``) in
        the modes the step runs in with the same random state every time (under a pipeline: through every stage, on
        the last stage's rank; ``None`` elsewhere)."""
        assert self._state is not None
        self._state.restore()
        if training:
            torch.manual_seed(_PROBE_SEED)
        else:
            self.module.eval()
        if self.pipeline is None:
            out = self.module.forward(*args, **kwargs)
            return next((t for t in tree_leaves(out) if isinstance(t, Tensor)), None)
        from lightning_hybrid.parallel.pipeline.executor import forward_through_stages

        stages, owners, group = self.pipeline
        outputs = forward_through_stages(stages, owners, [args[0]], group, self.device, [kwargs])
        return outputs[0] if outputs is not None else None

    # ------------------------------------------------------------------ context parallelism
    def _check_context(self, args: tuple, kwargs: dict) -> Optional[str]:
        context, whole, share = self.context, self.whole, self.share
        assert context is not None
        name = type(self.module).__name__
        if whole is None or share is None:
            return None
        mapped = _map_fields(args, kwargs, share, whole)
        if mapped is None:
            return (f"cp={context.size}: {name}'s forward is called with tensors that are not the fields of the batch"
                    " the strategy hands training_step (a TokenBatch: input_ids, labels, position_ids, padding), so"
                    " context parallelism cannot run it on the whole sequence to verify the split: call"
                    " self(tokens.input_ids, position_ids=tokens.position_ids) (as lightning_hybrid's LanguageModel"
                    " does), or train with cp=1.")
        (whole_args, whole_kwargs), (split_args, split_kwargs) = mapped
        places = zigzag_indices(whole.input_ids.size(1), context.size, context.rank, self.device)
        names = {id(m): n for n, m in self.module.named_modules()}
        layers = context.layers
        reference = _Recorder(layers)
        context.enabled = False
        try:
            with reference:
                ref_out = self._forward(whole_args, whole_kwargs)
        finally:
            context.enabled = True
        split = _Recorder(layers)
        with context.batch(share.position_ids[:1] if share.position_ids is not None else None), split:
            out = self._forward(split_args, split_kwargs)
        compared = [(f"the input of {names.get(id(layers[0]), 'the first layer')} (what the model computes before"
                     " its layers: embeddings and positions)", reference.first_input, split.first_input)]
        compared += [(names.get(id(layer), f"layer {i}"), reference.outputs.get(i), split.outputs.get(i))
                     for i, layer in enumerate(layers)]
        compared.append((f"the output of {name}", ref_out, out))
        for what, ref, got in compared:
            deviation = _deviation(ref, got, places, self.module)
            if deviation is not None:
                return (
                    f"cp={context.size} would train another model than one device: {what} differs between the whole"
                    f" sequence and this rank's share of it (by {deviation:.3g} of its scale). Context parallelism"
                    " splits every sequence and brings the tokens together only in scaled_dot_product_attention under"
                    " the causal (document, sliding-window) mask; this part of the model mixes tokens or reads their"
                    " places otherwise -- a mask of its own that says more (a window or chunks its config does not"
                    " declare), a convolution or recurrence along the sequence, positions it computes itself instead"
                    " of the batch's position_ids, a scaling by the longest position it sees (dynamic RoPE,"
                    " LongRoPE, attention temperature). Train this model with cp=1."
                )
        return None

    # ------------------------------------------------------------------ rows
    def _check_rows(self, args: tuple, kwargs: dict) -> Optional[str]:
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.dim() > 0]
        if not leaves:
            return None
        batch = leaves[0].size(0)
        if batch < 2:
            return None
        longest, shortest = _most_different_rows(kwargs.get("position_ids"), self.whole, batch)
        # In the modes of training (BatchNorm's batch statistics show only there), the shorter row first: its part of
        # any random draw is then the one it draws alone. A model that draws anything is compared in eval mode.
        for training in (True, False):
            watch = _RandomDraws()
            with watch:
                together = self._forward(*_rows(args, kwargs, [shortest, longest], batch), training=training)
                alone = self._forward(*_rows(args, kwargs, [shortest], batch), training=training)
            if not (training and watch.drew):
                break
        if together is None or alone is None:
            return None
        deviation = _deviation(together[:1], alone, None, self.module)
        if deviation is None:
            return None
        return (
            f"{self.rows} would train another model than one device: {type(self.module).__name__}'s output for a row"
            f" depends on the other rows of its batch (row {shortest} alone differs from it beside row {longest}, by"
            f" {deviation:.3g} of its scale) -- e.g. dynamic RoPE or LongRoPE scaled by the batch's longest position,"
            " BatchNorm's batch statistics -- and this layout splits the global batch's rows over ranks,"
            " micro-batches or accumulation steps. Train with one batch of rows as one device would (dp=1, pp=1, no"
            " accumulation), rows that all have the same positions, or without it (a rope scaling of a fixed factor,"
            " a normalization per row such as LayerNorm)."
        )


# ---------------------------------------------------------------------------------------------- helpers
_PROBE_SEED = 7


class _RandomDraws(TorchFunctionMode):
    """While active: whether any random op ran (`lightning_hybrid.checks.randomness`'s list)."""

    drew = False

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        if is_random_op(func, args, kwargs):
            self.drew = True
        return func(*args, **kwargs)


class _Recorder:
    """While active: the main input of ``layers[0]`` and the main output of each layer (first tensor), detached."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.first_input: Optional[Tensor] = None
        self.outputs: dict[int, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "_Recorder":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._output(i)))
        if self.layers:
            self._handles.append(self.layers[0].register_forward_pre_hook(self._input, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _output(self, i: int) -> Callable:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            first = next((t for t in tree_leaves(output) if isinstance(t, Tensor)), None)
            if first is not None and i not in self.outputs:
                self.outputs[i] = first.detach()
        return hook

    def _input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)), None)
        if first is not None and self.first_input is None:
            self.first_input = first.detach()


def _local(t: Tensor) -> Tensor:
    local = getattr(t, "local", None)  # SplitLogits: this rank's vocabulary shard, as on the other side
    return local() if callable(local) and type(t).__name__ == "SplitLogits" else t


def _deviation(ref: Optional[Tensor], got: Optional[Tensor], places: Optional[Tensor],
               module: nn.Module) -> Optional[float]:
    """How far ``got`` is from ``ref`` (at ``places`` of its second dimension) against ``ref``'s scale, where that
    exceeds the tolerance; ``None`` where they agree or cannot be compared (other shapes: another split, SP)."""
    if ref is None or got is None:
        return None
    ref, got = _local(ref), _local(got)
    if places is not None:  # the whole sequence's, at this rank's places
        if ref.dim() < 2 or got.dim() < 2 or got.size(1) != places.numel() or ref.size(1) <= int(places.max()):
            return None
        ref = ref.index_select(1, places.to(ref.device))
    if ref.shape != got.shape or not ref.is_floating_point():
        return None
    ref, got = ref.float(), got.float()
    scale = ref.abs().max().item()
    deviation = (ref - got).abs().max().item() / max(scale, 1e-12)
    sixteen = any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters())
    return deviation if deviation > (RTOL_16 if sixteen else RTOL) else None


def _map_fields(args: tuple, kwargs: dict, share: TokenBatch,
                whole: TokenBatch) -> Optional[tuple[tuple[tuple, dict], tuple[tuple, dict]]]:
    """The call on the first row of the whole batch and of this rank's share: every tensor of the call must be a
    field of ``share`` (or the share itself); ``None`` where one is not."""
    fields = {id(getattr(share, f)): f for f in ("input_ids", "labels", "position_ids", "padding")
              if getattr(share, f) is not None}
    leaves, spec = tree_flatten((args, kwargs))
    whole_leaves, split_leaves = [], []
    for leaf in leaves:
        if leaf is share:
            whole_leaves.append(_first_row_batch(whole))
            split_leaves.append(_first_row_batch(share))
        elif isinstance(leaf, Tensor):
            field = fields.get(id(leaf))
            if field is None:
                return None
            whole_value = getattr(whole, field)
            if whole_value is None and field == "position_ids":  # the whole batch is plain: its positions
                ids = whole.input_ids
                whole_value = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
            if whole_value is None:
                return None
            whole_leaves.append(whole_value[:1])
            split_leaves.append(leaf[:1])
        else:
            whole_leaves.append(leaf)
            split_leaves.append(leaf)
    return tree_unflatten(whole_leaves, spec), tree_unflatten(split_leaves, spec)


def _first_row_batch(tokens: TokenBatch) -> TokenBatch:
    row = {f: (getattr(tokens, f)[:1] if getattr(tokens, f) is not None else None)
           for f in ("input_ids", "labels", "position_ids", "padding")}
    return TokenBatch(**row)


def _rows(args: tuple, kwargs: dict, rows: list[int], batch: int) -> tuple[tuple, dict]:
    """The call on ``rows`` of its batch: every tensor whose first dimension is the batch's, indexed."""
    def pick(leaf: Any) -> Any:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.size(0) == batch:
            return leaf[rows]
        if isinstance(leaf, TokenBatch):
            return TokenBatch(**{f: pick(getattr(leaf, f)) for f in ("input_ids", "labels", "position_ids",
                                                                       "padding")})
        return leaf

    leaves, spec = tree_flatten((args, kwargs))
    return tree_unflatten([pick(leaf) for leaf in leaves], spec)


def _most_different_rows(positions: Any, whole: Optional[TokenBatch], batch: int) -> tuple[int, int]:
    """The rows whose longest positions are the largest and the smallest (ranks that split a row's tokens agree:
    the whole batch's positions where known); rows 0 and 1 where they are all alike."""
    source = whole.position_ids if whole is not None and whole.position_ids is not None else positions
    if isinstance(source, Tensor) and source.dim() == 2 and source.size(0) == batch:
        longest = source.max(dim=1).values
        i, j = int(longest.argmax()), int(longest.argmin())
        if i != j:
            return i, j
    return 0, 1


class _State:
    """What a forward may change in ``module`` besides parameters: its buffers (a dynamic rotary embedding registers a
    new ``inv_freq``) and the plain Python values of its submodules (its ``max_seq_len_cached``); `restore` puts them
    back, so that every probe call starts from the state the real step starts from."""

    _PLAIN = (bool, int, float, str, type(None))

    def __init__(self, module: nn.Module) -> None:
        self.buffers = [(m, name, b, b.detach().clone()) for m in module.modules() for name, b in m._buffers.items()
                        if b is not None]
        self.values = [(m, {k: v for k, v in vars(m).items() if isinstance(v, self._PLAIN)}) for m in module.modules()]

    def restore(self) -> None:
        for m, name, original, value in self.buffers:
            m._buffers[name] = original
            if original.shape == value.shape:
                original.copy_(value)
        for m, values in self.values:
            m.__dict__.update(values)


@contextlib.contextmanager
def _quiet(module: nn.Module, device: torch.device) -> Iterator[_State]:
    """No gradients, eval mode, no autocast, fp32 matmuls (no TF32, no FP8: `float8_off`); random states, buffers,
    plain values and training modes as they were afterwards (and wherever the probe restores them)."""
    state = _State(module)
    devices = [device] if device.type == "cuda" else []
    # TF32 matmuls (which torch.set_float32_matmul_precision("high") turns on) round at ~1e-3: fp32 for the probe.
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        with (torch.random.fork_rng(devices=devices), torch.no_grad(), torch.autocast(device.type, enabled=False),
              float8_off(module)):
            module.eval()
            yield state
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        state.restore()
