"""Module replacement: turn a plain model into its tensor-parallel form, in place, after verifying each split.

`apply_tp` takes the plan's units that this rank holds (layers of other pipeline ranks are skipped), groups
them into blocks (see `verify.py`), and for one block of each kind picks, unit by unit, the first candidate
variant that keeps the block equal to the unsplit one; every unit of that kind then gets that variant. A unit
of an explicit ``tp_plan`` whose split fails is an error naming the module; any other unit without an exact
split stays replicated, and the report says so. `apply_variant` does the replacement of one unit: TP layers
for its linear-like modules and embeddings, head-count and size attributes divided by tp (those on a shared
``config`` on the unit's own copy of it), and a pre-hook that cuts per-head inputs to this rank's heads.

Sequence parallelism (`sequence_parallel.py`) works on the same units: `apply_tp` finds the runs of blocks
whose hidden states it splits along the sequence, verifies their blocks on sequence parts, and places its hooks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.core.devices import module_device
from lightning_hybrid.core.linears import lora_base
from lightning_hybrid.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    deferrable_columns,
    is_tp_split,
    shard_embedding,
    split_adapted,
    split_shape,
)
from lightning_hybrid.parallel.tensor_parallel.plan import TPPlan, Unit, _join, block_of
from lightning_hybrid.parallel.tensor_parallel.sequence_parallel import (
    blocks_without_regions,
    chain_breaks,
    gather_sequence_at_entry,
    install_sequence_runs,
    recording_chain,
    replicated_sequence_blocks,
    sequence_runs,
)
from lightning_hybrid.parallel.tensor_parallel.unit_backward import reduce_at_entry
from lightning_hybrid.parallel.tensor_parallel.variants import Variant
from lightning_hybrid.parallel.tensor_parallel.verify import Captured, capture_inputs, check_block, main_input


@dataclass
class TPResult:
    """What `apply_tp` did: the variant of every split unit, the replicated parameters whose gradients are
    per-rank parts (sum them over TP), units left whole, errors (explicit splits that failed), and timing."""

    chosen: dict[str, Variant] = field(default_factory=dict)
    partial_grads: set[str] = field(default_factory=set)
    left_whole: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    attempts: dict[str, list[str]] = field(default_factory=dict)  # unit -> variants that failed, and why
    verified_kinds: int = 0
    seconds: float = 0.0
    # blocks whose hidden states are split over the sequence
    sequence_runs: list[list[str]] = field(default_factory=list)

    def summary(self) -> str:
        kinds: dict[str, list[str]] = {}
        for name, variant in self.chosen.items():
            head_keys = [k for k, _ in variant.head_inputs]
            kinds.setdefault(
                f"{variant.label}{' /' + ','.join(variant.divide) if variant.divide else ''}"
                f"{' (per-head inputs ' + str(head_keys) + ')' if variant.head_inputs else ''}",
                [],
            ).append(name)
        split = "; ".join(
            f"{names[0]}{f' (+{len(names) - 1})' if len(names) > 1 else ''}: {label}" for label, names in kinds.items()
        )
        kept = ", ".join(f"{n} ({why})" for n, why in self.left_whole.items())
        partial = f"; gradients summed over TP: {sorted(self.partial_grads)}" if self.partial_grads else ""
        runs = "; ".join(f"{run[0]}..{run[-1]}" if len(run) > 1 else run[0] for run in self.sequence_runs)
        sequence = f"; sequence split in [{runs}]" if runs else ""
        return (f"tensor parallel: [{split or 'nothing split'}]; left whole: [{kept or 'nothing'}]{partial}{sequence};"
                f" verified {self.verified_kinds} block kinds in {self.seconds:.2f}s")


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, module)


def is_paired(variant: Variant) -> bool:
    """Whether the unit is a column/row pair inside a module (an attention or MLP), not a lone split module."""
    return any(rel for rel, _ in variant.layers)


def apply_variant(
    root: nn.Module, unit_name: str, variant: Variant, group: dist.ProcessGroup, detect: list | None = None, *,
    sequence_parallel: bool = False, split_logits: bool = False,
) -> None:
    """Split the unit ``unit_name`` of ``root`` as ``variant`` says (in place). With ``detect`` (a list), the
    per-head inputs to cut are found at the unit's first call and appended to it. ``sequence_parallel``: a
    paired unit takes its main input split along the sequence (all-gathered at entry) and its row layers
    reduce-scatter over the sequence. ``split_logits``: a lone column layer whose output is gathered (an LM
    head) returns `SplitLogits`, gathered only where used."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    sequence_parallel = sequence_parallel and is_paired(variant)
    for rel, layer in variant.layers:
        name = _join(unit_name, rel)
        original = root.get_submodule(name)
        if isinstance(original, nn.Embedding):
            shard_embedding(original, group)
            continue
        if lora_base(original) is not None:  # a LoRA wrapper: its base and adapters split, the wrapper kept
            for part in split_adapted(original, layer.style, group, layer.gather_output, layer.part_sizes,
                                      layer.input_is_parallel):
                part.sequence_parallel = sequence_parallel
            continue
        if layer.style == "colwise":
            split = ColumnParallelLinear(
                original, group, layer.gather_output, layer.part_sizes, split_logits=split_logits and not rel
            )
        else:
            split = RowParallelLinear(original, group, layer.input_is_parallel)
        split.sequence_parallel = sequence_parallel
        _set_submodule(root, name, split)
    unit = root.get_submodule(unit_name)
    if sequence_parallel:
        gather_sequence_at_entry(unit, group)
    elif is_paired(variant):  # one all-reduce of the column layers' input gradients, under their weights'
        reduce_at_entry(unit, group, functools.partial(deferrable_columns, sequence_parallel=False))
    for attr in variant.divide:
        owner = unit
        if attr.startswith("config."):
            if not getattr(unit, "_tp_own_config", False):
                unit.config = copy.copy(unit.config)  # the other modules keep seeing the full counts
                unit._tp_own_config = True
            owner, attr = unit.config, attr[len("config."):]
        setattr(owner, attr, getattr(owner, attr) // tp)
    if variant.slice_heads and (detect is not None or variant.head_inputs):
        unit.register_forward_pre_hook(_head_slicer(variant, rank, tp, detect), with_kwargs=True)




def _head_slicer(variant: Variant, rank: int, tp: int, detect: list | None) -> Callable:
    """A forward pre-hook cutting the inputs that hold one entry per head (a dim of size heads or
    batch*heads, batch-major) to this rank's heads."""
    heads, local = variant.heads, variant.heads // tp

    def hook(module, args, kwargs):
        main = main_input(args, kwargs)
        keys = variant.head_inputs
        if detect is not None and not detect and main is not None:
            batch = main.size(0)
            entries = list(enumerate(args)) + list(kwargs.items())
            for key, value in entries:
                if isinstance(value, Tensor) and value is not main and value.shape != main.shape:
                    dim = next(
                        (d for d, size in enumerate(value.shape) if size % heads == 0 and size // heads in (1, batch)),
                        None,
                    )
                    if dim is not None:
                        detect.append((key, dim))
            detect.append(("", -1))  # searched: nothing more to find
        keys = keys or tuple(k for k in (detect or []) if k[0] != "")
        args = list(args)
        for key, dim in keys:
            value = (
                args[key] if isinstance(key, int) and key < len(args)
                else kwargs.get(key) if isinstance(key, str) else None
            )
            if isinstance(value, Tensor) and value.size(dim) % heads == 0:
                cut = (
                    value.unflatten(dim, (value.size(dim) // heads, heads))
                    .narrow(dim + 1, rank * local, local)
                    .flatten(dim, dim + 1)
                )
                if isinstance(key, int):
                    args[key] = cut
                else:
                    kwargs[key] = cut
        return tuple(args), kwargs

    return hook



def apply_tp(
    model: nn.Module,
    group: dist.ProcessGroup,
    plan: TPPlan,
    *,
    run_example: Callable[[], object] | None = None,
    pipeline_layers: tuple[str, ...] = (),
    device: torch.device | None = None,
    example_input_for: Callable[[str, nn.Module], Captured | None] | None = None,
    representative: Callable[[str, nn.Module], nn.Module] | None = None,
    sequence_parallel: bool = False,
    split_logits: bool = False,
) -> TPResult:
    """Split ``model`` in place over ``group`` as ``plan`` says, each kind of block verified first.

    ``run_example`` runs the (still unsplit) model once on an example input (its calls are captured);
    ``example_input_for(name, block)`` may supply a call for blocks that example did not reach.
    ``representative(name, block)`` gives the module verified for a kind of block in its place (a materialised
    copy of a block on the meta device; the model itself is then split on the meta device). Collective over
    ``group``. Idempotent: units already split are left alone. ``sequence_parallel`` and ``split_logits``: see
    `apply_variant`. There is no unverified path: a unit is split only as a verified variant says (the
    verification also finds the parameters whose gradients are per-rank parts).
    """
    start = time.perf_counter()
    result = TPResult()
    modules = dict(model.named_modules())
    split_unit = functools.partial(apply_variant, sequence_parallel=sequence_parallel, split_logits=split_logits)
    runs = sequence_runs(plan, modules, pipeline_layers) if sequence_parallel else []
    result.errors += blocks_without_regions(runs, plan)
    units = {n: u for n, u in plan.units.items() if _splittable_here(u, modules)}
    blocks: dict[str, list[Unit]] = {}
    for unit in units.values():
        blocks.setdefault(block_of(unit.name, modules, pipeline_layers), []).append(unit)
    kinds: dict[tuple, list[str]] = {}
    for block, members in blocks.items():
        kind = (type(modules[block]), tuple(u.kind for u in members), tuple(_rel(block, u.name) for u in members))
        kinds.setdefault(kind, []).append(block)
    decisions: dict[tuple, tuple[dict[str, Variant], set[str]]] = {}
    if kinds:
        device = device or module_device(model)
        first_of_kind = {names[0]: modules[names[0]] for names in kinds.values()}
        chain: dict[str, tuple[Tensor | None, Tensor | None]] = {}
        if run_example is not None:
            in_runs = [b for run in runs for b in run if b in modules]
            example = recording_chain(run_example, in_runs, modules, chain) if runs else run_example
            calls = _capture(model, first_of_kind, example, device)
        else:
            calls = {}
        result.errors += chain_breaks(runs, chain)
        for kind, names in kinds.items():
            block = representative(names[0], modules[names[0]]) if representative else modules[names[0]]
            call = calls.get(names[0]) or (example_input_for(names[0], block) if example_input_for else None)
            decisions[kind] = _search(
                names[0], block, blocks[names[0]], call, group, device, result, split_unit, sequence_parallel
            )
            del block  # a materialised representative lives while its kind is verified
        result.verified_kinds = len(kinds)
    if not result.errors:
        per_unit: dict[str, Variant] = {}
        partial_by_block: dict[str, set[str]] = {}
        for kind, names in kinds.items():
            chosen, partial = decisions[kind]
            for block in names:
                per_unit.update(
                    {u.name: chosen[_rel(block, u.name)] for u in blocks[block] if _rel(block, u.name) in chosen}
                )
                partial_by_block[block] = {_join(block, p) for p in partial}
        tied = _tied_weights(model)
        for name in _split_apart(tied, per_unit, modules):
            del per_unit[name]
            result.left_whole[name] = "shares a weight with a module that is not split the same way"
        result.errors += replicated_sequence_blocks(runs, blocks, per_unit)
    if not result.errors:
        for name, variant in per_unit.items():
            split_unit(model, name, variant, group)
        _retie(model, tied)
        install_sequence_runs(runs, group, modules)
        result.chosen = {name: _as_applied(variant, split_logits) for name, variant in per_unit.items()}
        result.sequence_runs = runs
        result.partial_grads = {
            p for block, names in partial_by_block.items() for p in names
            if all(u.name in per_unit for u in blocks[block])
        }
    result.seconds = time.perf_counter() - start
    return result


def _as_applied(variant: Variant, split_logits: bool) -> Variant:
    """The variant as the report names it: a lone gathered column layer keeps its logits split under
    ``split_logits``."""
    if split_logits and not is_paired(variant) and any(plan.gather_output for _, plan in variant.layers):
        return dataclasses.replace(variant, label="logits split over the vocabulary (gathered on demand)")
    return variant


def _capture(model: nn.Module, blocks: dict[str, nn.Module], run: Callable,
             device: torch.device) -> dict[str, Captured]:
    """The representatives' calls in one example forward, in eval mode (no dropout) and without touching the
    global random state."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return capture_inputs(blocks, run)
    finally:
        for module, mode in modes.items():
            module.training = mode


def _rel(block: str, name: str) -> str:
    return name[len(block) + 1:] if block and name != block else ("" if name == block else name)


def _splittable_here(unit: Unit, modules: dict[str, nn.Module]) -> bool:
    """Whether this rank holds the unit's modules (not layers of another pipeline rank), not yet split."""
    layers = [modules.get(_join(unit.name, rel)) for rel in unit.layers]
    return all(
        m is not None and not is_tp_split(m) and (split_shape(m) is not None or isinstance(m, nn.Embedding))
        for m in layers
    )


def _search(
    block_name: str, block: nn.Module, units: list[Unit], call: Captured | None, group, device, result: TPResult,
    split_unit: Callable = apply_variant, sequence_parallel: bool = False,
) -> tuple[dict[str, Variant], set[str]]:
    """Unit by unit, the first variant that keeps ``block`` exact given the earlier units' choices (``split_unit``
    applies a variant; with ``sequence_parallel`` a block with a paired unit is checked on sequence parts)."""
    chosen: dict[str, Variant] = {}
    partial: set[str] = set()
    runnable = call is not None and check_block(block, {}, call, group, device, split_unit).ok
    if not runnable:
        result.errors.append(
            f"{block_name}: no example input reaches it, so its split cannot be verified. Set `example_input_array`"
            " on the LightningModule to an input of its forward."
        )
        return chosen, partial
    for unit in units:
        rel = _rel(block_name, unit.name)
        failures = []
        for variant in unit.variants:
            choices = {**chosen, rel: variant}
            on_parts = sequence_parallel and any(is_paired(v) for v in choices.values())
            verdict = check_block(block, choices, call, group, device, split_unit, on_parts)
            if verdict.ok:
                found = verdict.head_inputs.get(rel, ())
                chosen[rel] = variant.with_head_inputs(tuple(k for k in found if k[0] != ""))
                partial = set(verdict.partial)
                break
            failures.append(f"{variant.label}{' /' + ','.join(variant.divide) if variant.divide else ''}"
                            f"{' +per-head inputs' if variant.slice_heads else ''}: {verdict.detail}")
        else:
            if unit.explicit:
                result.errors.append(
                    f"tp_plan splits {unit.name} in a way that changes its results: {'; '.join(failures[:3])}."
                    f" Give it other part_sizes, or mark it 'replicate' in tp_plan."
                )
            else:
                result.left_whole[unit.name] = f"no exact split found among {len(failures)} candidates"
        if failures:
            result.attempts[unit.name] = failures
    return chosen, partial


def _tied_weights(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one Parameter (tied embeddings)."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(_join(module_name, param_name))
    return [sorted(set(names)) for names in owners.values() if len(set(names)) > 1]


def _split_apart(tied: list[list[str]], per_unit: dict[str, Variant], modules: dict[str, nn.Module]) -> set[str]:
    """Units to leave whole because a weight they share is not split in every module that uses it."""
    layers = {_join(unit, rel): unit for unit, variant in per_unit.items() for rel, _ in variant.layers}
    drop: set[str] = set()
    for names in tied:
        users = [layers.get(name.rpartition(".")[0]) for name in names]
        if any(users) and not all(users):
            drop.update(u for u in users if u)
    return drop


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Point every user of a tied weight at the one split Parameter (each split made an identical copy)."""
    for names in tied:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            module_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(module_name) if module_name else model
            if getattr(owner, leaf) is not first:
                if getattr(owner, leaf).shape != first.shape:
                    raise ValueError(
                        f"Tied parameters {names} were split differently"
                        f" ({list(first.shape)} vs {list(getattr(owner, leaf).shape)})."
                    )
                setattr(owner, leaf, first)
