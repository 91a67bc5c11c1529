"""`parallelize`: the one place the parallel dimensions are composed, in the order they must run.

    plan -> checkpoint targets -> pipeline cut -> TP/SP split (verified) -> materialise
         -> EP split (verified) -> FP8 linears -> context split (hooks) -> activation checkpointing -> compile
         -> ZeRO-3 (FSDP2) -> pipeline executor

Each step is one named function taking the meshes (`lightning_hybrid.core.dims.Meshes`, built once from
`ParallelDims`) and plain values from the frozen `ParallelOptions`, never the strategy. The steps here are named by
what they do (plan, cut, split, materialise, shard, build); each calls its dimension's entry point in the wing,
``apply_*`` (`apply_tp`, `apply_ep`, `apply_cp`, `apply_activation_checkpointing`, `apply_compile`, `apply_fsdp`)
or the pipeline's stages and executor. A new dimension is one more step here, and what it does during a step a
`StepHooks` it appends to ``Parallelized.hooks`` (docs/adding-a-dimension.md). `HybridStrategy.setup` calls
`parallelize` and then moves the module to its device, applies the precision, builds the `GradientSync`
(`lightning_hybrid.grad_sync`) and the `TrainingSteps` (`lightning_hybrid.steps`) from the returned
`Parallelized`. It runs without a ``Trainer``: ``parallelize(module, meshes, options, device)`` on every rank of a
process group (collective over the meshes).

Building per rank: a module whose layers are still to be built (`builds_per_rank`: it says so, or the strategy's
init context built it on the meta device under ``pp > 1``) is cut on the meta device, split over TP there, and
then each rank materialises only its own layers -- under TP only its slices of them
(`lightning_hybrid.parallel.tensor_parallel.layerwise`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid.core.devices import module_device
from lightning_hybrid.core.dims import Meshes, ParallelDims
from lightning_hybrid.core.hooks import StepHooks
from lightning_hybrid.core.protocol import LayerwiseInit, PipelineAuxLoss, PipelineLayerContext, builds_per_rank
from lightning_hybrid.options import ParallelOptions
from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing, checkpoint_targets
from lightning_hybrid.parallel.compile import apply_compile, enable_async_tp
from lightning_hybrid.parallel.context_parallel import ContextParallel, ContextParallelHooks, apply_cp
from lightning_hybrid.parallel.expert_parallel import (
    apply_ep,
    check_experts,
    expert_parameter_names,
    expert_units,
    iter_expert_modules,
)
from lightning_hybrid.parallel.float8 import Float8Groups, Float8Report, apply_float8, float8_config
from lightning_hybrid.parallel.float8_all_gather import register_float8_scales, wrap_float8_weights
from lightning_hybrid.parallel.pipeline import PipelineExecutor, check_protocol, stage_module
from lightning_hybrid.parallel.pipeline.aux import AuxLossExchange, Source
from lightning_hybrid.parallel.pipeline.executor import SCHEDULES, forward_through_stages
from lightning_hybrid.parallel.pipeline.stages import (
    StageLayout,
    check_materialised,
    drop_remote_layers,
    keep_local_layers,
    plan_stages,
)
from lightning_hybrid.parallel.tensor_parallel import (
    TPPlan,
    TPResult,
    apply_tp,
    resolve_tp_plan,
    tp_sharded_parameter_names,
)
from lightning_hybrid.parallel.tensor_parallel.examples import first_layer_example, model_example, synthetic_call
from lightning_hybrid.parallel.tensor_parallel.layerwise import Representatives, materialise_split_layers
from lightning_hybrid.parallel.tied import TiedAcrossStages, broadcast_tied, shared_parameters, ties_across_stages
from lightning_hybrid.parallel.zero import apply_fsdp, apply_fsdp_experts, apply_fsdp_units

__all__ = ["Parallelized", "parallelize"]


@dataclass
class Parallelized:
    """What `parallelize` made of a module (split, cut and wrapped in place) and what the later pieces need.

    ``tp_sharded``: names of the parameters that are TP shards (the gradient norm counts their pieces once per TP
    rank). ``partial_grads``: replicated parameters whose per-rank gradient is a part, summed over TP once per
    step. ``fsdp_roots``: the FSDP2 roots of ZeRO-3 (their gradient sync is switched off inside an accumulation
    window). ``pipeline``: the executor under ``pp > 1``. ``remote_prefixes``: module names of the pipeline layers
    other ranks hold. ``tp_report``: what TP split and how. ``expert_params``: names of the parameters that are
    this rank's experts (`lightning_hybrid.parallel.expert_parallel`), split over ``meshes["ep"]`` and reduced
    over ``meshes["edp"]``. ``context``: the attention over the CP group under ``cp > 1``
    (`lightning_hybrid.parallel.context_parallel`). ``tied``: parameters shared by modules on different pipeline
    stages, of which this rank may hold a copy (`lightning_hybrid.parallel.tied`). ``hooks``: what the dimensions do
    during a step (`lightning_hybrid.core.hooks.StepHooks`), called by the strategy in this order.
    """

    module: nn.Module
    meshes: Meshes
    tp_sharded: frozenset[str] = frozenset()
    partial_grads: tuple[str, ...] = ()
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    pipeline: Optional[PipelineExecutor] = None
    remote_prefixes: tuple[str, ...] = ()
    tp_report: Optional[TPResult] = None
    expert_params: frozenset[str] = frozenset()
    context: Optional[ContextParallel] = None
    tied: tuple[TiedAcrossStages, ...] = ()
    hooks: tuple[StepHooks, ...] = ()


def parallelize(module: nn.Module, meshes: Meshes, options: ParallelOptions, device: torch.device) -> Parallelized:
    """Parallelise ``module`` in place over ``meshes`` (`ParallelDims.build_meshes`) as ``options`` say; its layers
    end on ``device`` where they were built here (the rest moves with the strategy's ``model_to_device``). Collective
    over the meshes; an error on any rank is raised on every rank before the next collective."""
    dims = meshes.dims
    pp, tp, ep, cp, gradient_ranks = dims.pp, dims.tp, dims.ep, dims.cp, meshes.size("dp_cp")
    if options.async_tp:  # refused off CUDA/NCCL here, alike on every rank, before any collective
        enable_async_tp(meshes.group("tp"), device)
    per_rank = builds_per_rank(module)
    shared = shared_parameters(module)  # before any dimension replaces a module that holds one
    # Split on the meta device, then materialise (or read) each rank's slices: TP's, and its experts.
    layerwise = (tp > 1 or ep > 1) and per_rank
    layer_names = pipeline_layer_names(module) if pp > 1 or layerwise else ()
    plan = plan_tp(module, tp, options, layer_names)
    checkpointed = []
    if options.activation_checkpointing:  # named on the whole model, before the cut
        checkpointed = checkpoint_targets(module, options.activation_checkpointing, pp > 1)
    first_input = None
    if pp > 1 or layerwise:  # known on every rank before the cut (the layers are still there, perhaps on meta)
        first_input = first_layer_example(module, module.pipeline_layers()[0], device, options.example_multiple(dims))
    ties = []
    if pp > 1 and shared:  # read on the whole model, before the cut
        ties = tie_across_stages(module, shared, layer_names, meshes, options)
    layout = cut_pipeline(module, meshes, options, device, keep_unbuilt=layerwise) if pp > 1 else None
    unbuilt = unsplit_copies(module, layout) if layerwise else {}  # on meta: what random init fills, layer by layer
    report = None
    if plan is not None:
        report = split_tp(module, meshes, plan, options, device, layer_names, layout, first_input, layerwise)
    if ep > 1 and layerwise:  # on the meta device: verified once materialised
        split_experts(module, meshes, verify=False)
    if layerwise:
        materialise(module, unbuilt, device)
    if ep > 1 and layerwise:
        verify_experts(module)
    elif ep > 1:
        split_experts(module, meshes)
    if options.fp8 is not None:
        convert_float8(module, meshes, options, device)
    experts = expert_parameter_names(module)
    tp_sharded = frozenset(tp_sharded_parameter_names(module)) - experts
    remote = tuple(layout.remote_prefixes) if layout is not None else ()
    hooks: list[StepHooks] = []  # what the dimensions do during a step, in this order
    context = None
    if cp > 1:
        context_hooks = split_context(module, meshes, options, remote, device)
        hooks.append(context_hooks)
        context = context_hooks.context
    apply_activation_checkpointing(module, _held_here(checkpointed, remote), options.recompute,
                                   compiled=options.compile is not None)
    if options.compile is not None:
        apply_compile(module, _held_here(checkpoint_targets(module, True, pp > 1), remote), dict(options.compile))
    stages = local_stages(module, layout) if layout is not None else None
    if ties:  # every holder's copy from the first holder's, before ZeRO-3 shards them
        broadcast_tied(ties, module, meshes.group("pp"), device)
    fsdp_roots = []
    if options.zero_stage == 3 and gradient_ranks > 1:
        fsdp_roots = shard_zero3(module, stages, meshes["fsdp"], meshes["edp"] if ep > 1 else None,
                                 parts=options.compile is None, shared=shared)
    pipeline = build_pipeline(module, stages, layout, meshes, options, device) if layout is not None else None
    return Parallelized(
        module, meshes, tp_sharded,
        tuple(sorted(report.partial_grads)) if report is not None else (), fsdp_roots, pipeline, remote, report,
        experts, context, tuple(ties), hooks=tuple(hooks),
    )


# ----------------------------------------------------------------------------------------------- the steps
def plan_tp(module: nn.Module, tp: int, options: ParallelOptions, layer_names: tuple[str, ...]) -> Optional[TPPlan]:
    """The TP plan, made on the whole model (before a pipeline cuts it), so that it is the same for every pp."""
    if tp == 1:
        return None
    plan = dict(options.tp_plan) if options.tp_plan != "auto" else "auto"
    return resolve_tp_plan(module, tp, plan, pipeline_layers=layer_names)


def tie_across_stages(
    module: nn.Module, shared: list[tuple[str, ...]], layer_names: tuple[str, ...], meshes: Meshes,
    options: ParallelOptions,
) -> list[TiedAcrossStages]:
    """The groups of one shared Parameter whose modules the pipeline cut puts on different PP ranks
    (`lightning_hybrid.parallel.tied`), from the stages `cut_pipeline` will make (planned here alike on every rank)."""
    assert options.schedule_spec is not None
    pp_mesh = meshes["pp"]
    plan = plan_stages(module, pp_mesh.size(), pp_mesh.get_local_rank(), options.stages_per_rank,
                       options.schedule_spec.style, list(options.split_points) if options.split_points else None)
    owner_of_layer = [plan.owners[s] for i in range(len(layer_names)) for s, r in enumerate(plan.ranges) if i in r]
    return ties_across_stages(module, shared, layer_names, owner_of_layer, pp_mesh.get_local_rank())


def cut_pipeline(
    module: nn.Module, meshes: Meshes, options: ParallelOptions, device: torch.device, keep_unbuilt: bool
) -> StageLayout:
    """Partition the pipeline layers into stages and keep this rank's: the others become `RemoteLayer` stand-ins.
    The kept layers are materialised on ``device`` here, unless ``keep_unbuilt`` (TP splits them on meta first)."""
    assert options.schedule_spec is not None
    pp_mesh = meshes["pp"]
    layout = plan_stages(module, pp_mesh.size(), pp_mesh.get_local_rank(), options.stages_per_rank,
                         options.schedule_spec.style, list(options.split_points) if options.split_points else None)
    if keep_unbuilt:
        drop_remote_layers(module, layout)
    else:
        keep_local_layers(module, layout, device)
    return layout


def split_tp(
    module: nn.Module, meshes: Meshes, plan: TPPlan, options: ParallelOptions, device: torch.device,
    layer_names: tuple[str, ...], layout: Optional[StageLayout], first_input: Optional[Tensor], layerwise: bool,
) -> TPResult:
    """Split this rank's modules over TP, each kind of block verified against its unsplit self first (an example
    forward captures the blocks' inputs: the whole model, or the pipeline stages in order). With ``layerwise`` the
    model is on the meta device: each kind is verified on a materialised copy of one block (`Representatives`:
    called with its pipeline layer's input, ``first_input`` for layer 0, random hidden states for the others) and
    the split is made on meta. A split that is not exact on any rank is a ``ValueError`` on every rank."""
    multiple = options.example_multiple(meshes.dims)
    run_example: Optional[Callable[[], Any]] = None
    representative = example_input_for = None
    if layerwise:
        representative = Representatives(module, module.pipeline_layers(), layer_names, device, first_input, multiple)
        example_input_for = representative.example_call
    elif layout is None:
        run_example = model_example(module, module_device(module), multiple)
    elif first_input is not None:
        stages = local_stages(module, layout)
        pp_group = meshes.group("pp")
        run_example = lambda: forward_through_stages(stages, layout.owners, [first_input], pp_group, device)  # noqa: E731
    result = apply_tp(
        module, meshes.group("tp"), plan, run_example=run_example, pipeline_layers=layer_names, device=device,
        example_input_for=example_input_for or (lambda name, block: synthetic_call(block, multiple)),
        representative=representative, sequence_parallel=options.sequence_parallel, split_logits=options.loss_parallel,
    )
    raise_on_every_rank(result.errors, "Tensor parallelism")
    rank_zero_info(result.summary())
    return result


def split_experts(module: nn.Module, meshes: Meshes, verify: bool = True) -> None:
    """Split this rank's experts modules over the ``ep`` ranks of ``meshes["ep"]``
    (`lightning_hybrid.parallel.expert_parallel.apply_ep`; built ones verified first, ``verify=False`` for those
    still on the meta device: `verify_experts` once they are materialised). An error on any rank is raised on every
    rank."""
    raise_on_every_rank(apply_ep(module, meshes.group("ep"), verify), "Expert parallelism")
    count = len(list(iter_expert_modules(module)))
    rank_zero_info(f"expert parallelism: {count} experts modules split over ep={meshes.dims.ep} (their gradients"
                   f" reduced over {meshes.size('edp')} data-parallel ranks each)")


def verify_experts(module: nn.Module) -> None:
    """`lightning_hybrid.parallel.expert_parallel.check_experts` on this rank's experts, split on the meta device and
    now
    materialised; an error on any rank is raised on every rank."""
    split = set(iter_expert_modules(module))
    reasons = [check_experts(name, experts) for name, experts in module.named_modules() if experts in split]
    raise_on_every_rank([reason for reason in reasons if reason is not None], "Expert parallelism")


def convert_float8(module: nn.Module, meshes: Meshes, options: ParallelOptions, device: torch.device) -> Float8Report:
    """This rank's linears in FP8 (`lightning_hybrid.parallel.float8.apply_float8`), their amaxes reduced over the
    groups that split their operands (`Float8Groups`; the stage's ranks and the context-parallel x TP ones made
    here, alike on every rank). ``ValueError`` on every rank for an ``fp8_exclude`` pattern that matches no linear
    on any rank, or a model with no linear to convert."""
    dims = meshes.dims

    def group_of(key: Callable[[tuple[int, int, int, int]], Any]) -> Optional[dist.ProcessGroup]:
        """This rank's group of the ranks whose coordinates (pp, dp, cp, tp) give the same ``key`` (made for
        every key, alike on every rank); ``None`` where it is this rank alone."""
        members: dict[Any, list[int]] = {}
        for rank in range(dims.world_size):
            members.setdefault(key(dims.coordinates(rank)), []).append(rank)
        if all(len(ranks) == 1 for ranks in members.values()):
            return None
        mine, _ = dist.new_subgroups_by_enumeration(list(members.values()))
        return mine

    optional = {name: meshes.group(name) if name in meshes and meshes.size(name) > 1 else None
                for name in ("dp_cp", "tp", "cp")}
    groups = Float8Groups(stage=group_of(lambda c: c[0]), together=group_of(lambda c: c[:2]), **optional)
    errors: list[str] = []
    report = Float8Report([], [], set())
    try:
        config = float8_config(options.fp8, device)
        if options.fp8_all_gather:  # ZeRO-3's weights gathered in float8 (`shard_zero3` wraps them)
            config = replace(config, enable_fsdp_float8_all_gather=True)
        report = apply_float8(module, config, groups, options.fp8_exclude)
    except Exception as e:  # raised below on every rank: none goes on to a collective the others never reach
        errors.append(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (errors, sorted(report.matched), len(report.converted)))
    errors = list(dict.fromkeys(m for each, _, _ in gathered for m in each))
    matched = {p for _, each, _ in gathered for p in each}
    unmatched = [p for p in options.fp8_exclude if p not in matched]
    if unmatched:
        errors.append(f"fp8_exclude patterns {unmatched} match no linear layer of the model; valid names are those of"
                      f" its linears, e.g. {(report.converted + report.kept)[:4]}.")
    if not errors and not any(count for _, _, count in gathered):
        errors.append(f"fp8={options.fp8!r}: no linear layer of the model has both dimensions multiples of"
                      f" 16 outside fp8_exclude (kept: {report.kept[:8]}); nothing would train in FP8.")
    if errors:
        raise ValueError("FP8 cannot convert this model:\n- " + "\n- ".join(errors))
    rank_zero_info(report.summary())
    return report


def raise_on_every_rank(errors: list[str], what: str) -> None:
    """Every rank's ``errors`` (the same message once), raised on every rank as one ``ValueError`` saying that
    ``what`` cannot split this model exactly. Collective over the world."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    messages = list(dict.fromkeys(m for per_rank in gathered for m in per_rank))
    if messages:
        raise ValueError(f"{what} cannot split this model exactly:\n- " + "\n- ".join(messages))


def unsplit_copies(module: nn.Module, layout: Optional[StageLayout]) -> dict[int, nn.Module]:
    """Copies of this rank's pipeline layers, still on the meta device and not split: taken before the TP split,
    they are what `materialise` initialises (one at a time) to keep this rank's slices of."""
    layers = module.pipeline_layers()
    local = layout.local_layers() if layout is not None else range(len(layers))
    return {i: copy.deepcopy(layers[i]) for i in local}


def materialise(module: nn.Module, unsplit: dict[int, nn.Module], device: torch.device) -> None:
    """Build this rank's layers (split on the meta device) on ``device``, each rank filling only its slices of
    ``unsplit`` copies; the values are those of a one-device init (or the module's stored weights). Errors are
    raised on every rank."""

    def build() -> None:
        materialise_split_layers(module, list(unsplit), unsplit, device)
        check_materialised(module)

    on_every_rank(build, "materialising the model")


def local_stages(module: nn.Module, layout: StageLayout) -> dict[int, nn.Module]:
    """This rank's pipeline stages: stage index -> the stage's layers as one module (each layer's call inside the
    module's `PipelineLayerContext`, where it has one)."""
    layers = module.pipeline_layers()
    context = module.pipeline_layer_context if isinstance(module, PipelineLayerContext) else None
    return {s: stage_module([layers[i] for i in layout.ranges[s]], context) for s in layout.local_stages}


def shard_zero3(
    module: nn.Module, stages: Optional[dict[int, nn.Module]], dp_mesh: DeviceMesh,
    edp_mesh: Optional[DeviceMesh] = None, parts: bool = True, shared: Sequence[tuple[str, ...]] = (),
) -> list[nn.Module]:
    """ZeRO-3 over DP with FSDP2; returns the FSDP roots. Expert-parallel experts first, each over its own DP
    group (``edp_mesh``). Under PP each stage is a root (the pipeline stage drives its gradient sync)
    and each of its layers a unit; else `apply_fsdp` picks the units of the whole module. A parameter that several
    modules share (``shared``, `lightning_hybrid.parallel.tied`) stays in one unit. Float8 linears that ask for the
    float8 all-gather get their weights wrapped first and a scale hook on each unit
    (`lightning_hybrid.parallel.float8_all_gather`)."""
    if edp_mesh is not None:
        apply_fsdp_experts(expert_units(module), edp_mesh, dp_mesh.size())
    tied = {id(p) for names in shared for p in [_parameter_or_none(module, names)] if p is not None}
    wrap_float8_weights(module, tied)
    if stages is None:
        roots = apply_fsdp(module, dp_mesh, parts, tied)
    else:
        roots = [apply_fsdp_units(list(stage), stage, dp_mesh, parts, tied) for stage in stages.values()]
    register_float8_scales(roots)
    return roots


def _parameter_or_none(module: nn.Module, names: tuple[str, ...]) -> Optional[nn.Parameter]:
    """The shared Parameter of ``names`` as this rank holds it (any of its names), or ``None`` (another stage's)."""
    held = dict(module.named_parameters(remove_duplicate=False))
    return next((held[n] for n in names if n in held), None)


def split_context(
    module: nn.Module, meshes: Meshes, options: ParallelOptions, remote: tuple[str, ...], device: torch.device,
) -> ContextParallelHooks:
    """Context parallelism (``cp > 1``, `apply_cp`): each of this rank's layers (those activation checkpointing
    takes, wrapped first so that recomputation runs through it too) attends over ``meshes["cp"]``; returns the
    hooks of its steps."""
    try:
        layers = _held_here(checkpoint_targets(module, True, meshes.dims.pp > 1), remote)
    except ValueError as e:  # no layer found: the message says where the layers must be
        raise ValueError(f"cp={meshes.dims.cp}: context parallelism wraps the layers. {e}") from e
    # A layer checkpointed as a whole (or selectively) recomputes its attention already.
    return apply_cp(module, layers, meshes.group("cp"), not options.activation_checkpointing, device,
                    ring=options.cp_attention == "ring")


def build_pipeline(
    module: nn.Module, stages: Optional[dict[int, nn.Module]], layout: StageLayout, meshes: Meshes,
    options: ParallelOptions, device: torch.device,
) -> PipelineExecutor:
    assert stages is not None and options.schedule_spec is not None and options.micro_batches is not None
    aux = pipeline_aux_loss(module, layout, meshes, device)
    schedule, spec = options.schedule, options.schedule_spec
    if aux is not None and schedule != "gpipe":
        if not options.schedule_default:
            aux.close()
            raise ValueError(
                f"{type(module).__name__} adds an auxiliary loss of the whole batch (e.g. a mixture-of-experts model's"
                " load-balancing loss), which pipeline stages can compute exactly only when every micro-batch's"
                f" forward runs before the first backward: use schedule='gpipe' (got schedule={schedule!r})."
            )
        schedule, spec = "gpipe", SCHEDULES["gpipe"]  # the default schedule, for such a module
    rank_zero_info(
        f"pipeline: {len(layout.ranges)} stages over pp={meshes.dims.pp} ({schedule},"
        f" {options.micro_batches} micro-batches), layers per stage {[len(r) for r in layout.ranges]}"
        + (" -- GPipe: the module adds an auxiliary loss of the whole batch" if aux is not None else "")
    )
    return PipelineExecutor(
        stages, len(layout.ranges), layout.owners, spec, options.micro_batches, module.loss_fn,
        meshes.group("pp"), device, aux=aux, dp_group=meshes.group("dp_cp"),
    )


def pipeline_aux_loss(
    module: nn.Module, layout: StageLayout, meshes: Meshes, device: torch.device,
) -> Optional[AuxLossExchange]:
    """The exchange of the module's auxiliary loss of the whole batch (`PipelineAuxLoss`), where any rank's layers
    hold a source of it (every rank decides alike: collective)."""
    if not isinstance(module, PipelineAuxLoss):
        return None
    layers = module.pipeline_layers()
    local = {i: layers[i] for i in layout.local_layers()}
    sources = [Source(i, k, m, index) for i, layer in local.items()
               for k, (m, index) in enumerate(module.pipeline_aux_sources(layer))]
    anywhere = torch.tensor([len(sources)], device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if not int(anywhere):
        return None
    return AuxLossExchange(sources, local, module.pipeline_aux_loss, meshes.group("dp_cp"), meshes.group("pp"),
                           device)


# ----------------------------------------------------------------------------------------------- helpers
def builds_on_meta(dims: ParallelDims, module: Any) -> bool:
    """Whether the strategy's init context builds ``module`` on the meta device: under ``pp > 1`` a module that can
    initialise single pipeline layers (`LayerwiseInit`), so that each rank materialises only its own. (A module may
    also leave its layers to the strategy by itself: `lightning_hybrid.core.protocol.DeferredLayers`.)"""
    return dims.pp > 1 and isinstance(module, LayerwiseInit)


def pipeline_layer_names(module: nn.Module) -> tuple[str, ...]:
    """The module-tree names of the pipeline layers, in order (checks the pipeline protocol first)."""
    check_protocol(module)
    names = {id(m): n for n, m in module.named_modules()}
    return tuple(names[id(layer)] for layer in module.pipeline_layers() if id(layer) in names)


def on_every_rank(step: Callable[[], None], what: str) -> None:
    """Run ``step()``; an exception on any rank is raised on every rank (this rank's own, else one naming the
    ranks that failed), so that none goes on to a collective the others never reach. Collective over the world."""
    error: Optional[BaseException] = None
    try:
        step()
    except Exception as e:  # re-raised below, on every rank
        error = e
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {rank: message for rank, message in enumerate(failures) if message is not None}
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)}: {next(iter(failed.values()))}")


def _held_here(names: list[str], remote: tuple[str, ...]) -> list[str]:
    """``names`` without those inside a layer another pipeline rank holds (``a.b`` is inside ``a``)."""
    return [n for n in names if not any(n == p or n.startswith(p + ".") for p in remote)]
