"""Activation checkpointing per layer, full or selective.

Full: a checkpointed layer keeps only its input during forward and recomputes all its activations in backward
(``torch.utils.checkpoint``, non-reentrant, RNG state preserved, so dropout masks are the same in the
recomputation).

Selective, on torch's selective checkpointing (`create_selective_checkpoint_contexts`), with a policy that
decides op by op during the forward which outputs the layer keeps:

- ``"attention"`` (Korthikanti et al. 2022): the attention core is recomputed -- from the scores ``Q K^T`` (a
  batched matmul of two activations) through everything computed from them (scale, mask, softmax, dropout)
  up to the product with ``V``, whose output the output projection needs and which is kept; or a fused
  scaled-dot-product kernel. Its activations grow with the square of the sequence (the ``5 a s / h`` term of
  Korthikanti's per-layer memory). Everything else is kept.
- ``"pointwise"``: the attention core and every element-wise op (norm pieces, activations, residual sums):
  only matmul, norm and reduction outputs are kept -- less memory than ``"attention"`` for a few more FLOPs
  (TorchTitan's op-level policy).
- a list of aten op names: those ops.

Always recomputed, whatever the choice, because keeping them would be wrong or saves nothing: views, copies
(a kept copy would keep its source's bytes twice), new buffers, in-place ops (torch.distributed's in-place
collectives included, whose schemas do not say they write), random ops (dropout: the recomputation restores
the random state at the layer's start and replays the random ops in their order, which gives the forward's
masks only if it replays all of them) and the element-wise ops that apply a random mask (what follows them
keeps what it needs).

An op whose output the layer later changes in place cannot be kept (the recomputation would need the value before
the change; torch's selective checkpoint refuses it in backward): transformers' MoE routers divide ``topk``'s
weights in place (Mixtral, Qwen-MoE, DeepSeek). The policy sees the change during the forward; the layer then
recomputes that op (``topk``: no FLOPs) and runs its forward again from the same random state, once, at its first
step (`_selective_forward`). Not under ``compile=True``, whose graphs a retry would break: there such a layer fails
in backward with torch's error.

The forward collectives of TP/SP layers run as functional collectives inside a selective checkpoint
(`tensor_parallel.comm.functional_collectives`). Reductions (a row layer's all-reduce or reduce-scatter) are
kept, so the recomputation never runs them again; all-gathers run again, which is what sequence parallelism
does without recompute too (a unit keeps its sequence shard and all-gathers it again in backward). An op that
would change a kept output in place is an error (torch's check), never a silently different recomputation.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hybrid.core.collectives import functional_collectives
from lightning_hybrid.core.protocol import PipelineLayers

#: Fused attention kernels: recomputed whole under ``"attention"`` and ``"pointwise"``.
SDPA_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_fused_attention_overrideable",
})
_BATCHED_MATMULS = frozenset({"aten.bmm", "aten.baddbmm"})
_COPIES = frozenset({"aten.clone", "aten._to_copy", "aten.contiguous", "aten._unsafe_view"})
_FACTORIES = ("aten.empty", "aten.zeros", "aten.ones", "aten.full", "aten.new_", "aten.scalar_tensor")

Recompute = Union[str, Sequence[str]]


@dataclass(frozen=True)
class Selection:
    """What a selective checkpoint recomputes besides the always-recomputed ops (see the module's text)."""

    ops: frozenset[str] = frozenset()  # aten op names ("aten.gelu")
    attention_core: bool = False  # eager attention's core, followed from the scores
    pointwise: bool = False  # every element-wise op


def recompute_selection(recompute: Recompute) -> Selection | None:
    """What ``recompute`` asks a checkpointed layer to recompute; ``None`` for full recomputation.
    Raises ``ValueError`` for an unknown mode or op name, and for selective recompute on a torch whose selective
    checkpoint does not hand the policy each op's output (older than 2.13; the policy follows tensors by it)."""
    if recompute == "full":
        return None
    if "op_output" not in inspect.signature(SelectiveCheckpointContext.__init__).parameters:
        raise ValueError(
            f"recompute={recompute!r} needs torch >= 2.13 (its selective checkpoint passes each op's output to the"
            f" policy); this is torch {torch.__version__}. Use recompute='full'."
        )
    if recompute == "attention":
        return Selection(ops=SDPA_OPS, attention_core=True)
    if recompute == "pointwise":
        return Selection(ops=SDPA_OPS, attention_core=True, pointwise=True)
    if isinstance(recompute, str) or not recompute:
        raise ValueError(
            f"recompute={recompute!r} is invalid: use 'full' (the whole layer), 'attention' (the attention core"
            " only), 'pointwise' (the attention core and element-wise ops) or a list of aten op names to"
            " recompute (e.g. ['aten.gelu', 'aten._softmax'])."
        )
    names = frozenset(name if name.startswith("aten.") else f"aten.{name}" for name in recompute)
    unknown = sorted(n for n in names if not hasattr(torch.ops.aten, n[len("aten."):]))
    if unknown:
        raise ValueError(f"recompute names unknown aten ops {unknown}; names look like 'aten.gelu' or '_softmax'.")
    return Selection(ops=names)


def _from_parameter(t: torch.Tensor) -> bool:
    while t._base is not None:
        t = t._base
    return isinstance(t, nn.Parameter)


class _KeptOutputMutated(Exception):
    """A layer's forward changes in place the output of an op its selective checkpoint keeps (``op``): torch's
    selective checkpoint would refuse it in backward (the kept tensor is no longer what the recomputation needs)."""

    def __init__(self, op: str, mutation: str) -> None:
        super().__init__(op, mutation)
        self.op, self.mutation = op, mutation


class _Policy:
    """The policy of one checkpointed forward (a new one each call: it follows the attention core's tensors).
    ``mutated``: ops whose outputs the layer changes in place, recomputed (`_selective_forward` learns them)."""

    def __init__(self, selection: Selection, mutated: frozenset[str] = frozenset(), track: bool = True) -> None:
        self.selection = selection
        self.mutated = mutated
        self.track = track  # follow the kept outputs (not under compile, which traces the policy)
        self.core = WeakIdKeyDictionary()  # tensors computed from attention scores
        self.gathered = WeakIdKeyDictionary()  # outputs of all-gathers
        self.random = WeakIdKeyDictionary()  # outputs of random ops (dropout masks)
        self.kept = WeakIdKeyDictionary()  # outputs kept -> the op that made them

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = self._decide(ctx, op, *args, **kwargs)
        if not self.track:
            return decision
        if op._schema.is_mutable:  # an in-place op: does it change a kept output (or a view of one)?
            for value, argument in zip(args, op._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                    base = value
                    while base._base is not None:
                        base = base._base
                    made_by = self.kept.get(base) or self.kept.get(value)
                    if made_by is not None:
                        raise _KeptOutputMutated(made_by, str(op.overloadpacket))
        if decision == CheckpointPolicy.MUST_SAVE:
            name = str(op.overloadpacket)
            for out in tree_leaves(ctx.op_output):
                if isinstance(out, torch.Tensor):
                    self.kept[out] = name
        return decision

    def _decide(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = str(op.overloadpacket)
        if op.namespace == "_c10d_functional":
            # A TP/SP collective. Reductions are kept (never run again); all-gathers run again, as Megatron
            # all-gathers a sequence-split input again in backward rather than keep it whole; a wait follows
            # its collective.
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            if name == "_c10d_functional.all_gather_into_tensor" or (
                name == "_c10d_functional.wait_tensor" and inputs and inputs[0] in self.gathered
            ):
                for out in tree_leaves(ctx.op_output):
                    if isinstance(out, torch.Tensor):
                        self.gathered[out] = True
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.selection.attention_core and self._in_core(name, inputs):
            for out in tree_leaves(ctx.op_output):
                if isinstance(out, torch.Tensor):
                    self.core[out] = True
            return CheckpointPolicy.PREFER_RECOMPUTE
        if torch.Tag.nondeterministic_seeded in op.tags:
            for out in tree_leaves(ctx.op_output):
                if isinstance(out, torch.Tensor):
                    self.random[out] = True
            return CheckpointPolicy.PREFER_RECOMPUTE
        # Applying a random mask (dropout's product) is recomputed too: what it gives is kept by the ops after
        # it where they need it, and its other input is kept already.
        masked = torch.Tag.pointwise in op.tags and any(t in self.random for t in inputs)
        always = (
            op.is_view or op._schema.is_mutable or op.namespace == "c10d" or name in _COPIES
            or name.startswith(_FACTORIES) or masked
        )
        chosen = (name in self.selection.ops or name in self.mutated
                  or (self.selection.pointwise and torch.Tag.pointwise in op.tags))
        return CheckpointPolicy.PREFER_RECOMPUTE if always or chosen else CheckpointPolicy.MUST_SAVE

    def _in_core(self, name: str, inputs: list[torch.Tensor]) -> bool:
        """Scores (a batched matmul of two activations) and what is computed from them, up to the product
        with ``V`` (a batched matmul of a core tensor and an activation), which ends the core and is kept."""
        from_core = [t in self.core for t in inputs]
        if name in _BATCHED_MATMULS:
            operands = inputs[-2:]
            if any(_from_parameter(t) for t in operands):
                return False
            return not any(from_core[-2:])
        return any(from_core)


def _with_functional_collectives(forward: Callable, *args, **kwargs):
    with functional_collectives():
        return forward(*args, **kwargs)


def _selective_contexts(selection: Selection, mutated: frozenset[str] = frozenset(), track: bool = True):
    return create_selective_checkpoint_contexts(_Policy(selection, mutated, track))


def _selective_forward(forward: Callable, selection: Selection, mutated: set[str], *args, **kwargs):
    """``forward`` under a selective checkpoint. A layer that changes in place the output of an op the policy keeps
    (transformers' MoE routers divide ``topk``'s weights in place, ``/=``) cannot keep it: its recomputation would
    need the value before the change. The policy sees the change in the forward, before anything is kept for good;
    the op joins ``mutated`` (the layer's own set, recomputed from then on: ``topk`` costs no FLOPs) and the forward
    runs again from the same random state -- every rank of a collective does the same, at the same op, as they run
    the same layer. Once per such op and layer, at the first step."""
    while True:
        cpu_state = torch.get_rng_state()
        devices, device_states = get_device_states(*args)
        try:
            return checkpoint(partial(_with_functional_collectives, forward), *args, use_reentrant=False,
                              context_fn=partial(_selective_contexts, selection, frozenset(mutated)), **kwargs)
        except _KeptOutputMutated as change:
            if change.op in mutated or change.op.startswith("_c10d_functional."):
                raise RuntimeError(
                    f"selective recompute: the layer changes in place ({change.mutation}) the output of {change.op},"
                    " which its selective checkpoint must keep; use recompute='full' for this model") from None
            mutated.add(change.op)
            torch.set_rng_state(cpu_state)
            set_device_states(devices, device_states)


def _outermost(names: list[str]) -> list[str]:
    """``names`` but those inside another of them: a module inside a chosen one is recomputed (or compiled) with it,
    and a checkpoint nested in another would recompute it twice -- under selective recompute, two policies over the
    same ops, which torch's selective checkpoint cannot replay. (A glob's ``*`` matches the dots of submodules'
    names; a ``nn.ModuleList`` may sit inside another's elements, as a MoE block's experts.)"""
    return [n for n in names if not any(n.startswith(outer + ".") for outer in names)]


def checkpoint_targets(module: nn.Module, target: bool | str, pipelined: bool = False) -> list[str]:
    """Names of the modules to checkpoint (or compile) layer by layer: ``True`` -> every layer (the pipeline layers
    when the module is ``pipelined``; else the elements of its ``nn.ModuleList``s, or without any its pipeline
    layers); a glob pattern -> the outermost modules whose names match. ``ValueError`` when that finds none: the
    option would otherwise be accepted and do nothing."""
    names = {id(m): n for n, m in module.named_modules()}
    if isinstance(target, str):
        chosen = _outermost([n for n in names.values() if n and fnmatch.fnmatchcase(n, target)])
        if not chosen:
            raise ValueError(
                f"activation_checkpointing={target!r} matches no module; names look like {list(names.values())[1:8]}"
            )
        return chosen
    listed = [] if pipelined else _outermost([
        names[id(m)] for sub in module.modules() if isinstance(sub, nn.ModuleList) for m in sub
    ])
    if not listed and isinstance(module, PipelineLayers):
        listed = [names[id(layer)] for layer in module.pipeline_layers() if id(layer) in names]
    if not listed:
        raise ValueError(
            f"{type(module).__name__} holds its layers neither in an nn.ModuleList nor in pipeline_layers(), so"
            " activation checkpointing and compile have no layer to apply to: hold the blocks in an nn.ModuleList,"
            " implement pipeline_layers(), or give activation_checkpointing a glob pattern of module names."
        )
    return listed


def _checkpointed(forward: Callable) -> Callable:
    """``forward`` recomputed in backward (full activation checkpointing). A function that calls
    ``torch.utils.checkpoint.checkpoint`` itself: torch.compile turns that call into its checkpoint operator, where a
    ``functools.partial`` of it is opaque to dynamo (the compiled layer would run without a graph: eagerly)."""

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def apply_activation_checkpointing(module: nn.Module, names: list[str], selection: Selection | None = None,
                                   compiled: bool = False) -> None:
    """Checkpoint each named submodule (in place; parameter names and state dicts do not change): fully, or
    selectively, recomputing what ``selection`` says (see `recompute_selection`). A selectively checkpointed
    layer runs its TP/SP collectives as functional collectives, in its forward and in its recomputation, and
    learns at its first forward which kept outputs it changes in place (`_selective_forward`) -- not when the layers
    are to be ``compiled`` (the retry would break their graphs: torch's selective checkpoint refuses such a layer in
    backward there)."""
    for name in names:
        layer = module.get_submodule(name)
        if getattr(layer, "_activation_checkpointed", False):
            continue
        if selection is None:
            layer.forward = _checkpointed(layer.forward)
        else:
            if compiled:
                context = partial(_selective_contexts, selection, frozenset(), False)
                forward = partial(_with_functional_collectives, layer.forward)
                layer.forward = partial(checkpoint, forward, use_reentrant=False, context_fn=context)
            else:
                layer.forward = partial(_selective_forward, layer.forward, selection, set())
        layer._activation_checkpointed = True
