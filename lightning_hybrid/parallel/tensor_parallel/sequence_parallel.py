"""Sequence parallelism (Megatron SP, Korthikanti et al. 2022) on the units `apply_tp` splits.

Under TP alone every rank of a TP group holds the whole hidden states ``[B, T, H]`` between its TP units: the
norms, residual additions and dropout there run on all ``T`` tokens on every rank (the same work and activation
memory ``tp`` times). SP splits the hidden states along the sequence (dim 1) between the units instead, so that
each rank runs that code on ``T/tp`` tokens and keeps ``1/tp`` of its activations. For a block holding a
column/row pair (an attention or MLP module, a "paired" unit):

* at the paired unit's entry its main input is all-gathered along the sequence (`gather_sequence_at_entry`:
  `comm.gather_sequence_for_tp`; backward a reduce-scatter of the input gradient, which takes the place of the
  column layers' all-reduce);
* its row layers reduce-scatter their partial products along the sequence instead of all-reducing them
  (`RowParallelLinear` with ``sequence_parallel``: `comm.reduce_scatter_sequence`; backward an all-gather);
* a run of such blocks (consecutive elements of one ``nn.ModuleList``, or consecutive pipeline layers,
  `sequence_runs`) splits the sequence once at its first block's input (`comm.split_sequence`; backward an
  all-gather) and gathers it once at its last block's output (`comm.gather_sequence`; backward this rank's
  part): `install_sequence_runs`. Between pipeline stages the split activations travel.

Every one of these collectives runs on the TP group `apply_tp` is given: the sequence is split over the ranks that
split the heads, and the bytes moved equal TP's (an all-reduce is a reduce-scatter and an all-gather). Replicated
parameters between the units (norm weights, row biases) then see only this rank's tokens: the verification of
each block on sequence parts finds them, and training sums their gradients over TP.

A unit keeps its input's sequence shard for backward, not the gathered sequence, and all-gathers it again there
(`lightning_hybrid.parallel.tensor_parallel.unit_backward.Regather`), as Megatron does; its column layers' weight
gradients are computed under the reduce-scatter of its input's gradient (`unit_backward`). `apply_tp` refuses SP,
naming the blocks, where it would change results: a block that is itself a column/row unit
(`blocks_without_regions`), a model doing something between the blocks of a run (`chain_breaks`, from
`recording_chain`), or a paired unit left replicated (`replicated_sequence_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_hybrid.core.collectives import gather_sequence, gather_sequence_for_tp, split_sequence
from lightning_hybrid.parallel.tensor_parallel.layers import deferrable_columns
from lightning_hybrid.parallel.tensor_parallel.plan import TPPlan, Unit, block_of
from lightning_hybrid.parallel.tensor_parallel.unit_backward import Regather, UnitGrads, gather_unit_input
from lightning_hybrid.parallel.tensor_parallel.variants import Variant
from lightning_hybrid.parallel.tensor_parallel.verify import main_input, replace_main_input


# ------------------------------------------------------------------------- which blocks run on part of the sequence
def sequence_runs(plan: TPPlan, modules: dict[str, nn.Module], pipeline_layers: tuple[str, ...]) -> list[list[str]]:
    """Runs of consecutive blocks holding a paired unit (whose hidden states sequence parallelism splits), from
    the whole plan (also blocks that other pipeline ranks hold): elements of one ``nn.ModuleList`` in index
    order, or pipeline layers in pipeline order."""
    blocks = {block_of(u.name, modules, pipeline_layers) for u in plan.units.values() if u.paired}

    def position(block: str) -> tuple[str, int] | None:
        parent, _, leaf = block.rpartition(".")
        if block in pipeline_layers:
            return "", pipeline_layers.index(block)
        return (parent, int(leaf)) if leaf.isdigit() else None

    ordered = sorted((position(b), b) for b in blocks if position(b) is not None)
    runs: list[list[str]] = [[b] for b in blocks if position(b) is None]
    for (container, index), block in ordered:
        previous = position(runs[-1][-1]) if runs and runs[-1] else None
        if previous is not None and previous == (container, index - 1):
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def blocks_without_regions(runs: list[list[str]], plan: TPPlan) -> list[str]:
    """Errors for sequence-split blocks that are themselves a column/row unit: their norms and residual
    additions sit between the unit's own layers, so nothing in them can run on part of the sequence."""
    blocks = {b for run in runs for b in run}
    paired_blocks = sorted(u.name for u in plan.units.values() if u.name in blocks and u.paired)
    return [
        f"sequence_parallel: {name} holds its column and row layers itself (attention and MLP in one module), so"
        " its norms and residual additions cannot run on part of the sequence. Sequence parallelism needs the"
        " attention and the MLP as modules of their own inside each block (as transformers models have them);"
        " use sequence_parallel=False for this model."
        for name in paired_blocks
    ]


def recording_chain(run: Callable, names: list[str], modules: dict[str, nn.Module], record: dict) -> Callable:
    """``run`` with hooks recording each named block's main input and main output (first tensor) of its first call."""

    def wrapped():
        handles = []
        for name in names:
            def hook(module, args, kwargs, output, name=name):
                if name not in record:
                    inputs = main_input(args, kwargs)
                    tensors = [output] if isinstance(output, Tensor) else output if isinstance(output, tuple) else ()
                    out = next((o for o in tensors if isinstance(o, Tensor)), None)
                    record[name] = tuple(t.detach().clone() if t is not None else None for t in (inputs, out))

            handles.append(modules[name].register_forward_hook(hook, with_kwargs=True))
        try:
            return run()
        finally:
            for handle in handles:
                handle.remove()

    return wrapped


def chain_breaks(runs: list[list[str]], record: dict) -> list[str]:
    """Errors where, in the example forward, a block of a sequence-split run did not receive the previous
    block's output as its hidden states (the model does something between them that would see split tokens).
    Without an example forward (a model split on the meta device) the blocks are pipeline layers, which the
    pipeline protocol chains."""
    errors = []
    for run in runs:
        for before, after in zip(run, run[1:]):
            if before in record and after in record:
                out, nxt = record[before][1], record[after][0]
                if out is None or nxt is None or out.shape != nxt.shape or not torch.equal(out, nxt):
                    errors.append(
                        f"sequence_parallel: {after} does not receive {before}'s output as its hidden states (the model"
                        " does something between them), so the sequence cannot stay split between them. Use"
                        " sequence_parallel=False."
                    )
    return errors


def replicated_sequence_blocks(
    runs: list[list[str]], blocks: dict[str, list[Unit]], per_unit: dict[str, Variant]
) -> list[str]:
    """Errors for this rank's blocks of sequence-split runs whose attention/MLP units found no exact split:
    they would see only part of the sequence."""
    errors = []
    for block in (b for run in runs for b in run if b in blocks):
        replicated = [u.name for u in blocks[block] if u.paired and u.name not in per_unit]
        if replicated:
            errors.append(
                f"sequence_parallel: {', '.join(replicated)} found no split that is exact on sequence-split hidden"
                " states (see the log of the attempts), so its block cannot run on part of the sequence. Use"
                " sequence_parallel=False, or a tp_plan that splits it."
            )
    return errors


# ------------------------------------------------------------------------- where the sequence is split and gathered
def install_sequence_runs(runs: list[list[str]], group: dist.ProcessGroup, modules: dict[str, nn.Module]) -> None:
    """Split the sequence at each run's first block and gather it after its last, where this rank holds them
    (another pipeline rank's layer is a parameterless stand-in here)."""
    def held(name: str) -> nn.Module | None:
        block = modules.get(name)
        return None if block is None or getattr(block, "pipeline_standin", False) else block

    for run in runs:
        if (first := held(run[0])) is not None:
            # First of the block's pre-hooks: any other (a model's own argument hooks) sees the split sequence.
            first.register_forward_pre_hook(_sequence_splitter(group), with_kwargs=True, prepend=True)
        if (last := held(run[-1])) is not None:
            last.register_forward_hook(_sequence_joiner(group))


def _sequence_splitter(group: dist.ProcessGroup) -> Callable:
    """Pre-hook of the first block of a sequence-split run: this rank's part of the sequence."""

    def hook(module, args, kwargs):
        return replace_main_input(args, kwargs, lambda x: split_sequence(x, group))

    return hook


def _sequence_joiner(group: dist.ProcessGroup) -> Callable:
    """Hook of the last block of a sequence-split run: its main output (the first tensor) whole again."""

    def hook(module, args, output):
        if isinstance(output, Tensor):
            return gather_sequence(output, group)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (gather_sequence(output[0], group), *output[1:])
        raise TypeError(
            f"sequence_parallel: {type(module).__name__} returned {type(output).__name__}, not its hidden states."
        )

    return hook


# -------------------------------------------------------------------------------------------- a paired unit's entry
def gather_sequence_at_entry(unit: nn.Module, group: dist.ProcessGroup) -> None:
    """Hooks of a paired unit under sequence parallelism: the whole sequence of its main input, gathered at
    entry. What the unit's layers keep of it for their backward is this rank's part, all-gathered again in
    backward (as Megatron does), so the gathered sequence does not stay alive from forward to backward; that
    all-gather starts when the unit's backward starts (a hook on its output's gradient), under the backward of
    its row layer and attention, and is waited for where the column layers' weight gradients need it. Those are
    deferred to the gather's own backward, under the reduce-scatter of the input's gradient
    (`lightning_hybrid.parallel.tensor_parallel.unit_backward`; ``ColumnParallelLinear.overlap_backward``), also
    inside a checkpoint, where the checkpoint decides what is kept (the gathered input, recomputed or kept: not
    gathered again). Compiled, the unit keeps the op-by-op form (the compiler traces its backward)."""
    scopes: list = []

    def pre(module, args, kwargs):
        # Saved-tensor hooks already active mean activation checkpointing: it decides what is kept. Under
        # torch.compile the compiler decides (dynamo cannot trace saved-tensor hooks): the unit keeps its gathered
        # input, as without sequence parallelism.
        grad = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        keep_shard = grad and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        columns = deferrable_columns(module, sequence_parallel=True) if grad else []
        # (inside a checkpoint the entry keeps the gathered input as the checkpoint keeps it)
        state = UnitGrads(columns, group, keeps_input=not keep_shard) if columns else None
        regather = None

        def gather(x: Tensor) -> Tensor:
            nonlocal regather
            full = gather_sequence_for_tp(x, group) if state is None else gather_unit_input(x, state)
            if keep_shard:
                regather = Regather(x, full, group, takers=int(state is not None))
            return full

        args, kwargs = replace_main_input(args, kwargs, gather)
        scope = None
        if regather is not None:
            scope = torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack)
            scope.__enter__()
        if state is not None:
            state.regather = regather
            for column in columns:
                column.unit_grads = state
        scopes.append((scope, regather, columns if state is not None else []))
        return args, kwargs

    def post(module, args, kwargs, output):
        scope, regather, columns = scopes.pop()
        for column in columns:
            column.unit_grads = None
        if scope is None:
            return
        scope.__exit__(None, None, None)
        main = next((t for t in tree_leaves(output) if isinstance(t, Tensor)), None)
        if main is not None and main.requires_grad:
            main.register_hook(lambda grad: regather.prefetch())

    unit.register_forward_pre_hook(pre, with_kwargs=True)
    unit.register_forward_hook(post, with_kwargs=True, always_call=True)
