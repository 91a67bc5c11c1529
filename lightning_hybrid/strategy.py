"""`HybridStrategy`: the seam between Lightning and the parallel dimensions.

It composes, in one fixed order, what the other modules implement:
1. `ParallelDims.resolve` validates the layout against the world size (before any process group exists),
2. the process group and the ``(pp, dp, tp)`` `DeviceMesh` are built from Lightning's accelerator,
3. after ``configure_model``: `resolve_tp_plan` + `apply_tp` (TP by module replacement; a module still on
   the meta device is split there and then materialised layer by layer, each rank holding only its slices:
   `tensor_parallel.layerwise`), then `apply_fsdp` for ZeRO-3,
4. the user's optimizers are created (they see the split parameters) and wrapped by `ZeroOptimizer` for
   ZeRO-1/2,
5. during training: gradients reduced over DP once per optimizer step, clipping by the global norm (through
   the precision plugin the strategy provides, `lightning_hybrid.precision`), metrics and
   ``self.log(..., sync_dist=True)`` reduced over the DP group.
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.activation_checkpointing import Recompute, apply_activation_checkpointing, checkpoint_targets, recompute_selection
from lightning_hybrid.checkpoint import load_sharded, save_sharded
from lightning_hybrid.checkpoint import remove as remove_checkpoint_path
from lightning_hybrid.compile import Compile, apply_compile, compile_options
from lightning_hybrid.devices import is_meta, module_device
from lightning_hybrid.grad_norm import clip_grads_, global_grad_norm, parameter_grad_norms
from lightning_hybrid.mesh import ParallelDims, validate_zero_stage
from lightning_hybrid.pipeline import PipelineExecutor, check_protocol, resolve_schedule, stage_module
from lightning_hybrid.pipeline.executor import forward_through_stages
from lightning_hybrid.pipeline.protocol import PROTOCOL_HELP
from lightning_hybrid.pipeline.stages import (
    StageLayout,
    bind_evaluation,
    bind_training,
    check_materialised,
    drop_remote_layers,
    keep_local_layers,
    plan_stages,
)
from lightning_hybrid.ports import free_main_port
from lightning_hybrid.precision import with_global_norm_clipping
from lightning_hybrid.rank_zero import library_warnings_from_rank_zero
from lightning_hybrid.tensor_parallel import (
    TPPlan,
    TPResult,
    apply_tp,
    gather_full_state_dict,
    resolve_tp_plan,
    tp_sharded_parameter_names,
)
from lightning_hybrid.tensor_parallel.comm import sum_grads_over_tp_
from lightning_hybrid.tensor_parallel.examples import first_layer_example, model_example, synthetic_call
from lightning_hybrid.tensor_parallel.layerwise import Representatives, materialise_split_layers
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB, ZeroOptimizer, apply_fsdp, apply_fsdp_units

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh



class HybridStrategy(ParallelStrategy):
    """Data x tensor x pipeline parallelism with ZeRO on one ``(pp, dp, tp)`` device mesh.

    Args:
        dp: data-parallel size; ``-1`` infers it as ``world_size // (tp * pp)``.
        tp: tensor-parallel size (adjacent ranks). ``nn.Linear``/``nn.Embedding`` layers are replaced by
            column/row/vocab-parallel layers according to ``tp_plan``.
        pp: pipeline-parallel size. The LightningModule must implement the pipeline protocol
            (`lightning_hybrid.pipeline.PROTOCOL_HELP`).
        zero_stage: ZeRO stage over the DP dimension: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients),
            3 (+ parameters; FSDP2).
        bucket_cap_mb: size cap of one gradient bucket (stages 0-2): each bucket's reduction starts as soon as
            backward has completed it, overlapping the rest of the backward.
        tp_plan: ``"auto"`` (the model's own plan where it ships one, else the heuristic) or a dict of glob
            patterns over module names -> ``"colwise" | "rowwise" | "replicate"`` (or a dict pinning
            ``part_sizes``, ``gather_output``, ``input_is_parallel``) overriding it where it matches.
        micro_batches: micro-batches per training batch under ``pp > 1`` (default ``2 * pp``).
        schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"`` (``virtual_stages >= 2``) or
            ``"zero_bubble"`` (ZB-V: two stages per rank).
        virtual_stages: stages per rank for the interleaved schedule (default 1).
        split_points: explicit pipeline split: indices of the layers that start stages 1..n-1 (default: stages
            balanced by parameter count).
            The four pipeline arguments are refused at ``pp=1``, where nothing would use them.
        sequence_parallel: under ``tp > 1`` (refused at ``tp=1``), split the activations between the TP regions
            (norms, residuals, dropout) along the sequence over the TP group (Megatron SP): blocks holding an
            attention or MLP pair take and give ``[B, T/tp, H]``; verified like every split.
        loss_parallel: a column-split LM head's logits stay split over the vocabulary (`SplitLogits`):
            ``F.cross_entropy`` on them is computed from the shards, any other use gathers them on demand.
        activation_checkpointing: ``True`` recomputes every layer's activations in backward (the pipeline
            layers under ``pp > 1``, else the elements of ``nn.ModuleList``s); a glob pattern picks modules by name.
        recompute: what a checkpointed layer recomputes: ``"full"`` (everything), ``"attention"`` (the attention
            core only: selective recompute, Korthikanti et al.), ``"pointwise"`` (the attention core and every
            element-wise op) or a list of aten op names; anything but ``"full"`` checkpoints every layer when
            ``activation_checkpointing`` is ``False``.
        compile: ``torch.compile`` each layer (the decoder blocks -- the elements of the module's
            ``nn.ModuleList``s, or without any its pipeline layers -- or under ``pp > 1`` the pipeline layers;
            `checkpoint_targets`), after TP and activation checkpointing
            and before ZeRO-3 and the pipeline executor, as TorchTitan does; ``True`` or a dict of
            ``torch.compile`` arguments (``{"mode": "max-autotune"}``). Off by default.
        process_group_backend: overrides the backend chosen from the accelerator (gloo on CPU, nccl on CUDA).
        timeout: process group timeout.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        zero_stage: int = 0,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        tp_plan: Union[str, dict[str, Any]] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        micro_batches: Optional[int] = None,
        schedule: Optional[str] = None,
        virtual_stages: Optional[int] = None,
        split_points: Optional[list[int]] = None,
        activation_checkpointing: Union[bool, str] = False,
        recompute: Recompute = "full",
        compile: Compile = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        ParallelDims.check_sizes(dp, tp, pp)
        _refuse_unused(pp=pp, tp=tp, schedule=schedule, micro_batches=micro_batches, virtual_stages=virtual_stages,
                       split_points=split_points, sequence_parallel=sequence_parallel, tp_plan=tp_plan)
        _refuse_checkpoint_io(checkpoint_io)
        schedule, virtual_stages = schedule or "1f1b", virtual_stages or 1
        self._schedule_spec, self._stages_per_rank, micro_batches = (
            resolve_schedule(schedule, pp, micro_batches, virtual_stages) if pp > 1 else (None, 1, micro_batches)
        )
        self.split_points = list(split_points) if split_points is not None else None
        self._recompute_selection = recompute_selection(recompute)
        self.recompute = recompute
        self.activation_checkpointing = activation_checkpointing or self._recompute_selection is not None
        self._compile_options = compile_options(compile)
        self.compile = compile
        if not (tp_plan == "auto" or isinstance(tp_plan, Mapping)):
            raise ValueError(f"tp_plan={tp_plan!r} is invalid: use 'auto' or a dict of glob pattern -> style.")
        self._requested = {"dp": dp, "tp": tp, "pp": pp}
        self.zero_stage = validate_zero_stage(zero_stage)
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is invalid: it must be a positive number of MiB.")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.tp_plan = dict(tp_plan) if isinstance(tp_plan, Mapping) else tp_plan
        self.sequence_parallel = bool(sequence_parallel)
        self.loss_parallel = bool(loss_parallel)
        self.micro_batches, self.schedule, self.virtual_stages = micro_batches, schedule, virtual_stages
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._device_mesh: Optional["DeviceMesh"] = None
        self._parallelized_module: Optional[torch.nn.Module] = None
        self._tp_sharded_names: set[str] = set()
        self._partial_grads: list[str] = []  # replicated parameters whose per-rank gradient is a part: summed over TP
        self._fsdp_roots: list[torch.nn.Module] = []
        self._pipeline: Optional[PipelineExecutor] = None
        self._remote_prefixes: list[str] = []
        self._stashed_grads: list[tuple[torch.nn.Parameter, Optional[Tensor]]] = []
        self._sync_blocked = False
        self.last_grad_norm: Optional[Tensor] = None
        self.tensor_parallel_report: Optional[TPResult] = None  # what TP split and how (set at setup)
        # What lasts from `setup_environment` to `teardown`: library warnings from rank 0 only, and under PP the
        # forward-only binding of `self(x)` outside training steps.
        self._run_scope = ExitStack()

    # ------------------------------------------------------------------ layout
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("The layout is resolved once the processes have started (in `setup_environment`).")
        return self._dims

    @property
    def device_mesh(self) -> "DeviceMesh":
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh["dp"].get_group()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.device_mesh["tp"].get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh["pp"].get_group()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh["dp"].get_local_rank()

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only DP ranks see different samples; a TP group (and a pipeline) shares them.
        return {"num_replicas": self.parallel_dims.dp, "rank": self.dp_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @ParallelStrategy.precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning hands the plugin it chose for `Trainer(precision=...)` to this setter. Its stock
        # `clip_grad_by_norm` would clip by this rank's local norm; ours clips by the global one.
        self._precision_plugin = None if plugin is None else with_global_norm_clipping(plugin, self.clip_grad_by_norm)

    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: Optional[Any]) -> None:
        # Lightning hands a CheckpointIO given to the Trainer as a plugin to this setter: refused, as the argument.
        _refuse_checkpoint_io(io)
        self._checkpoint_io = io

    # ------------------------------------------------------------------ processes
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            if "MASTER_PORT" not in os.environ and self.num_processes * self.num_nodes > 1:
                os.environ["MASTER_PORT"] = str(free_main_port())  # see free_main_port; read by the launcher
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def on_exception(self, exception: BaseException) -> None:
        """On the process that started the other ranks (Lightning's launcher): stop them. Lightning leaves them
        running on an error, and they would wait for this rank -- in the rendezvous, or in a collective -- until
        the process group's timeout."""
        super().on_exception(exception)
        launcher = self._launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(_sigkill())

    def setup_environment(self) -> None:
        self._set_world_ranks()
        self._run_scope.enter_context(library_warnings_from_rank_zero(self.global_rank))
        # Validate before the process group exists: every rank raises the same error, none hangs.
        self._dims = ParallelDims.resolve(**self._requested, world_size=self.world_size)
        super().setup_environment()
        reset_seed()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        # Binding the process group to the device (NCCL's eager init) also makes DeviceMesh split it, which deep-copies
        # the backend's options: gloo's cannot be copied (torch 2.11, ranks sharing a GPU over gloo). Only NCCL gains.
        device_id = self.root_device if self._process_group_backend == "nccl" else None
        assert self.cluster_environment is not None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        self._device_mesh = self._dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model and optimizers
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._parallelize()
        self.model_to_device()
        if self._pipeline is not None:  # the schedule runs the backward: it applies accumulation's 1/k itself
            self._pipeline.loss_scale = 1.0 / trainer.accumulate_grad_batches
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._sync_metrics_over_dp()
        if self._pipeline is not None:  # `self(x)` outside training steps: the pipeline's forward-only path
            self._run_scope.enter_context(bind_evaluation(self.lightning_module, self._pipeline))

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _parallelize(self) -> None:
        """TP by module replacement, then ZeRO-3 sharding; once per module (a second fit/validate reuses it)."""
        module = self.lightning_module
        assert module is not None
        if self._parallelized_module is module:
            return
        dims = self.parallel_dims
        # A module left on the meta device (built per pipeline rank, or by itself under TP) is split over TP there
        # and then materialised layer by layer, each rank filling only its slices (`tensor_parallel.layerwise`).
        layerwise = dims.tp > 1 and is_meta(module)
        if dims.pp > 1 or layerwise:
            check_protocol(module)
        if layerwise and not callable(getattr(module, "init_pipeline_layer", None)):
            raise TypeError(f"{type(module).__name__} was built on the meta device but has no `init_pipeline_layer`. {PROTOCOL_HELP}")
        layer_names = self._pipeline_layer_names(module) if dims.pp > 1 or layerwise else ()
        # The plan is made on the whole model (before a pipeline cuts it), so it is the same for every pp.
        plan = resolve_tp_plan(module, dims.tp, self.tp_plan, pipeline_layers=layer_names) if dims.tp > 1 else None
        checkpointed = checkpoint_targets(module, self.activation_checkpointing, pipelined=dims.pp > 1) if self.activation_checkpointing else []
        layout, first_input = None, None
        if dims.pp > 1 or layerwise:
            # Known on every rank before the cut (layers are still there, perhaps on the meta device).
            first_input = first_layer_example(module, module.pipeline_layers()[0], self.root_device, self._example_multiple)
        if dims.pp > 1:
            assert self._schedule_spec is not None
            layout = plan_stages(
                module, dims.pp, self.device_mesh["pp"].get_local_rank(), self._stages_per_rank,
                self._schedule_spec.style, self.split_points,
            )
            if layerwise:
                drop_remote_layers(module, layout)
            else:
                keep_local_layers(module, layout, self.root_device)
            self._remote_prefixes = layout.remote_prefixes
        if layerwise:
            assert plan is not None
            layers = module.pipeline_layers()
            local = layout.local_layers() if layout is not None else list(range(len(layers)))
            unsplit = {i: copy.deepcopy(layers[i]) for i in local}  # on meta: what random init fills, layer by layer
            self._apply_tp(module, plan, layer_names, layout, first_input, layerwise=True)

            def materialise() -> None:
                materialise_split_layers(module, local, unsplit, self.root_device)
                check_materialised(module)

            self._on_every_rank(materialise)
        elif plan is not None:
            self._apply_tp(module, plan, layer_names, layout, first_input)
        self._tp_sharded_names = tp_sharded_parameter_names(module)
        apply_activation_checkpointing(module, [n for n in checkpointed if not _is_under(n, self._remote_prefixes)], self._recompute_selection)
        if self._compile_options is not None:
            layers = checkpoint_targets(module, True, pipelined=dims.pp > 1)
            apply_compile(module, [n for n in layers if not _is_under(n, self._remote_prefixes)], self._compile_options)
        if layout is not None:
            self._pipeline = self._build_pipeline(module, layout)
        elif self.zero_stage == 3 and dims.dp > 1:
            self._fsdp_roots = apply_fsdp(module, self.device_mesh["dp"])
        self._parallelized_module = module

    def _on_every_rank(self, step: Callable[[], None]) -> None:
        """Run ``step()``; an exception on any rank is raised on every rank (this rank's own, else one naming the
        ranks that failed), so that none goes on to a collective the others never reach."""
        error: Optional[BaseException] = None
        try:
            step()
        except Exception as e:  # re-raised below, on every rank
            error = e
        failures: list[Any] = [None] * self.world_size
        dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = {rank: message for rank, message in enumerate(failures) if message is not None}
        if failed:
            raise RuntimeError(f"materialising the model failed on rank(s) {sorted(failed)}: {next(iter(failed.values()))}")

    @property
    def _example_multiple(self) -> int:
        """Example inputs for the TP verification have a sequence length divisible by this."""
        return self.parallel_dims.tp if self.sequence_parallel else 1

    @staticmethod
    def _pipeline_layer_names(module: "pl.LightningModule") -> tuple[str, ...]:
        names = {id(m): n for n, m in module.named_modules()}
        return tuple(names[id(layer)] for layer in module.pipeline_layers() if id(layer) in names)

    def _apply_tp(
        self, module: "pl.LightningModule", plan: TPPlan, layer_names: tuple[str, ...], layout: Optional[StageLayout],
        first_input: Optional[Tensor], layerwise: bool = False,
    ) -> None:
        """Split this rank's modules over TP, each kind of block verified against its unsplit self first (an
        example forward captures the blocks' inputs: the whole model, or the pipeline stages in order). With
        ``layerwise`` the model is on the meta device: each kind is verified on a materialised copy of one block
        (`Representatives`: called with its pipeline layer's input, ``first_input`` for layer 0 and random hidden
        states for the others) and the split is made on meta.
        An error on any rank is raised on every rank."""
        representative = example_input_for = None
        if layerwise:
            run_example = None
            representative = Representatives(
                module, module.pipeline_layers(), layer_names, self.root_device, first_input, self._example_multiple
            )
            example_input_for = representative.example_call
        elif layout is None:
            run_example = model_example(module, module_device(module), self._example_multiple)
        else:
            layers = module.pipeline_layers()
            stages = {s: stage_module([layers[i] for i in layout.ranges[s]]) for s in layout.local_stages}
            run_example = None if first_input is None else (
                lambda: forward_through_stages(stages, layout.owners, [first_input], self.pp_group, self.root_device)
            )
        result = apply_tp(
            module, self.tp_group, plan, run_example=run_example,
            pipeline_layers=layer_names, device=self.root_device,
            example_input_for=example_input_for or (lambda name, block: synthetic_call(block, self._example_multiple)),
            representative=representative, sequence_parallel=self.sequence_parallel, split_logits=self.loss_parallel,
        )
        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, result.errors)
        messages = list(dict.fromkeys(m for per_rank in errors for m in per_rank))
        if messages:
            raise ValueError("Tensor parallelism cannot split this model exactly:\n- " + "\n- ".join(messages))
        self._partial_grads = sorted(result.partial_grads)
        self.tensor_parallel_report = result
        rank_zero_info(result.summary())

    def _build_pipeline(self, module: "pl.LightningModule", layout: StageLayout) -> PipelineExecutor:
        layers = module.pipeline_layers()
        stages = {s: stage_module([layers[i] for i in layout.ranges[s]]) for s in layout.local_stages}
        if self.zero_stage == 3 and self.parallel_dims.dp > 1:
            # Each stage is an FSDP2 root (the pipeline stage drives its gradient sync), each layer a unit.
            self._fsdp_roots = [apply_fsdp_units(list(stage), stage, self.device_mesh["dp"]) for stage in stages.values()]
        assert self._schedule_spec is not None
        rank_zero_info(
            f"pipeline: {len(layout.ranges)} stages over pp={self.parallel_dims.pp} ({self.schedule},"
            f" {self.micro_batches} micro-batches), layers per stage {[len(r) for r in layout.ranges]}"
        )
        return PipelineExecutor(
            stages, len(layout.ranges), layout.owners, self._schedule_spec, self.micro_batches, module.loss_fn,
            self.pp_group, self.root_device,
        )

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Under ``pp > 1`` a module that can initialise single pipeline layers is built on the meta device:
        each rank then materialises only its own layers (under ``tp > 1`` only its slices of them). A module may
        also stay on the meta device by itself (`lightning_hybrid.hf.CausalLM` under ``tp > 1``)."""
        module = self.lightning_module
        if self._requested["pp"] > 1 and callable(getattr(module, "init_pipeline_layer", None)):
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        first_in_window = module.trainer.fit_loop.epoch_loop.batch_idx % module.trainer.accumulate_grad_batches == 0
        self._pipeline.reduce_grads = not self._sync_blocked  # Lightning blocks the sync for a window's earlier batches
        buckets = self._gradient_buckets()
        if buckets:
            # The schedule runs its backward passes inside training_step; gradients collect in the buckets
            # (Lightning's zero_grad, which comes after this, leaves them there) and are reduced in `backward`.
            # A window starts from no gradients: the zero_grad Lightning would have done before a backward.
            for b in buckets:
                if first_in_window:
                    b.clear()
                b.sync = False
            with bind_training(module, self._pipeline) as binding:
                output = super().training_step(*args, **kwargs)
            binding.check_output(output)
            return output
        # No buckets (dp=1, ZeRO-3): Lightning zeroes gradients between training_step and backward, but the
        # schedule ran the backward inside training_step. So the schedule starts from no gradients; what earlier
        # batches of an accumulation window left is added back afterwards; and the sum is kept away from
        # Lightning's zero_grad until `backward` puts it back.
        params = list(module.parameters())
        earlier = _take_grads(params)
        with bind_training(module, self._pipeline) as binding:
            output = super().training_step(*args, **kwargs)
        binding.check_output(output)
        now = _take_grads(params)
        self._stashed_grads = [(p, g if first_in_window else _add(e, g)) for p, e, g in zip(params, earlier, now)]
        return output

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        for p, grad in self._stashed_grads:  # the schedule already ran the backward inside training_step
            p.grad = grad
        self._stashed_grads = []
        self.post_backward(closure_loss)
        return closure_loss

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if self.zero_stage in (0, 1, 2) and self.parallel_dims.dp > 1:
            assert self.lightning_module is not None
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            tp_sharded = {i for i, n in names.items() if n in self._tp_sharded_names}
            self.optimizers = [
                ZeroOptimizer(opt, self.dp_group, self.zero_stage, tp_sharded, self.bucket_cap_mb, names)
                for opt in self.optimizers
            ]

    def _gradient_buckets(self) -> list[Any]:
        return [opt.gradients for opt in self.optimizers if isinstance(opt, ZeroOptimizer)]

    # ------------------------------------------------------------------ gradients
    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._sync_blocked:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Reduce the accumulated gradients over DP (ZeRO-3: FSDP2 already did, in backward), then sum over TP
        the gradients that are per-rank parts (`_partial_grads`)."""
        for buckets in self._gradient_buckets():  # ZeRO 0-2 with dp > 1
            if self._pipeline is not None:
                buckets.reduce()  # the schedule's backward passes ran without sync
            else:
                buckets.wait()  # started during the backward
            buckets.sync = True
        self._sum_partial_grads_over_tp()

    def _sum_partial_grads_over_tp(self) -> None:
        """One all-reduce over TP of every gradient that is a per-rank part (norms and row biases in sequence-
        split regions, per-head norms), once per optimizer step, after the DP reduction (both are sums, so their
        order does not matter): where the optimizer reads them -- the parameters' ``.grad`` (FSDP2's local
        shards under ZeRO-3), or under ZeRO 1-2 the parts of the bucket slices that hold them (the TP peers of a
        DP rank lay out their buckets alike). A hook per parameter would stop the backward at each of them."""
        if not self._partial_grads:
            return
        assert self.lightning_module is not None
        params = {id(self.lightning_module.get_parameter(n)) for n in self._partial_grads}
        sharding = [opt for opt in self.optimizers if isinstance(opt, ZeroOptimizer) and opt.shards_state]
        grads: list[Tensor] = [g for opt in sharding for g in opt.grad_slices(params)]
        sliced = {id(p) for opt in sharding for bucket in opt.buckets for p in bucket.params}
        for name in self._partial_grads:
            param = self.lightning_module.get_parameter(name)
            if id(param) not in sliced and param.grad is not None:
                grads.append(param.grad._local_tensor if hasattr(param.grad, "_local_tensor") else param.grad)
        sum_grads_over_tp_(grads, self.tp_group)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for the backward passes of an accumulation window but the last one."""
        self._sync_blocked = True
        for root in self._fsdp_roots:
            root.set_requires_gradient_sync(False)
        for buckets in self._gradient_buckets():
            buckets.sync = False
        try:
            yield
        finally:
            self._sync_blocked = False
            for root in self._fsdp_roots:
                root.set_requires_gradient_sync(True)
            for buckets in self._gradient_buckets():
                buckets.sync = True

    def grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The global L2 norm of the gradients of ``optimizer``'s parameters (equal to one device's)."""
        if isinstance(optimizer, ZeroOptimizer) and optimizer.shards_state:
            grads = [(g, tp_shard, True) for g, tp_shard in optimizer.grad_shards()]
        else:
            assert self.lightning_module is not None
            wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
            dp_shard = bool(self._fsdp_roots)
            grads = [
                (p.grad, name in self._tp_sharded_names, dp_shard)
                for name, p in self.lightning_module.named_parameters()
                if id(p) in wanted and p.grad is not None
            ]
        return global_grad_norm(grads, self.tp_group, self.dp_group, self.pp_group, device=self.root_device)

    def parameter_grad_norms(self) -> dict[str, Tensor]:
        """The L2 norm of each parameter's whole gradient (unsplit, reduced over DP), by name, for the parameters
        this rank holds (its pipeline stages'): what ``p.grad.norm()`` gives on one device (0 for a parameter
        without a gradient). Collective over TP and DP: every rank calls it where the gradients are complete
        (``on_before_optimizer_step``); per-layer gradient norms to log, and the parity harness's per-tensor check."""
        module = self.lightning_module
        assert module is not None
        pieces: dict[str, list[Tensor]] = {n: [] for n, _ in module.named_parameters()}
        names = {id(p): n for n, p in module.named_parameters()}
        sliced: set[str] = set()
        for opt in self.optimizers:
            if isinstance(opt, ZeroOptimizer) and opt.shards_state:
                sliced |= {names[id(p)] for bucket in opt.buckets for p in bucket.params}
                for p, g in opt.grad_pieces():
                    pieces[names[id(p)]].append(g)
        for name, p in module.named_parameters():
            if name not in sliced and p.grad is not None:
                pieces[name].append(p.grad)
        dp_sharded = sliced | {n for n, p in module.named_parameters() if hasattr(p, "_local_tensor")}
        return parameter_grad_norms(pieces, self._tp_sharded_names, dp_sharded, self.tp_group, self.dp_group, self.root_device)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the global norm across TP and ZeRO shards and pipeline stages; the norm is kept in
        ``last_grad_norm``. The precision plugin's ``clip_grad_by_norm`` (``gradient_clip_val``) calls it."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        self.last_grad_norm = self.grad_norm(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        clip_grads_(grads, float(clip_val), self.last_grad_norm)

    # ------------------------------------------------------------------ collectives for Lightning
    def _sync_metrics_over_dp(self) -> None:
        from torchmetrics import Metric

        assert self.lightning_module is not None
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.dp_group

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce over the DP group by default: TP/PP ranks hold copies of the same value."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self.dp_group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group=group if group is not None else self.dp_group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, _group.WORLD, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    def barrier(self, name: Optional[str] = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    # ------------------------------------------------------------------ checkpoints
    # Sharded, reshardable, crash-safe folders (lightning_hybrid.checkpoint): weights and optimizer state are
    # written from the live model in `save_checkpoint` and read into it in `load_checkpoint`, so Lightning's
    # own state-dict hooks have nothing to do.
    def full_state_dict(self) -> dict[str, Tensor]:
        """The full (unsplit) state dict on every rank: gathered over TP, ZeRO-3 and the pipeline stages.
        Collective over the whole mesh; the plain (one-device) module loads it with ``load_state_dict``."""
        assert self.lightning_module is not None
        state = gather_full_state_dict(self.lightning_module)
        if self.parallel_dims.pp > 1:
            parts: list[Any] = [None] * self.parallel_dims.pp
            dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=self.pp_group)
            state = {k: v for part in parts for k, v in part.items()}
        return state

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint is read into the parallelised model and the wrapped optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("HybridStrategy.save_checkpoint(..., storage_options=...) is not supported.")
        save_sharded(self.broadcast(str(filepath)), self, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return load_sharded(self.broadcast(str(checkpoint_path)), self)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(filepath)

    def teardown(self) -> None:
        # As Lightning's ModelParallelStrategy: the module stays where it is. (Moving it to the CPU would also
        # fail on a pipelined module whose setup stopped before its layers left the meta device, and hide
        # the error that stopped it.)
        assert self.cluster_environment is not None and self.accelerator is not None
        for buckets in self._gradient_buckets():  # a later fit wraps new optimizers with buckets of their own
            buckets.remove()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self._run_scope.close()


_PIPELINE_ARGUMENTS = ("schedule", "micro_batches", "virtual_stages", "split_points")


def _refuse_unused(pp: int, tp: int, **given: Any) -> None:
    """``ValueError`` naming the arguments that were given but that nothing would use with this ``pp`` and ``tp``
    (every accepted argument is used or refused: a run never differs silently from what was asked)."""
    unused = [f"{k}={given[k]!r}" for k in _PIPELINE_ARGUMENTS if pp == 1 and given.get(k) is not None]
    if tp == 1 and given.get("sequence_parallel"):
        unused.append(f"sequence_parallel={given['sequence_parallel']!r}")
    if tp == 1 and isinstance(given.get("tp_plan"), Mapping):
        unused.append(f"tp_plan={given['tp_plan']!r}")
    if unused:
        raise ValueError(
            f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used with pp={pp}, tp={tp}: the pipeline"
            f" arguments ({', '.join(_PIPELINE_ARGUMENTS)}) need pp > 1, sequence_parallel and a tp_plan dict need"
            " tp > 1. Leave them unset for this layout."
        )


def _refuse_checkpoint_io(io: Any) -> None:
    if io is not None:
        raise ValueError(
            f"checkpoint_io={io!r} would not be used: HybridStrategy writes sharded, reshardable checkpoints itself"
            " (lightning_hybrid.checkpoint, through torch.distributed.checkpoint). Leave it unset."
        )


def _sigkill() -> signal.Signals:
    return getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL


def _is_under(name: str, prefixes: list[str]) -> bool:
    """Whether ``name`` is one of ``prefixes`` or inside one of them (``a.b`` is under ``a``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _take_grads(params: list[torch.nn.Parameter]) -> list[Optional[Tensor]]:
    """The parameters' gradients; the parameters are left without any."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def _add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    return b if a is None else a if b is None else a + b
