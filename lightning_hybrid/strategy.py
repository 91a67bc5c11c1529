"""`HybridStrategy`: the seam between Lightning and the parallel dimensions; it composes nothing and names none.

* the processes, the meshes and Lightning's collectives over DP: `MeshStrategy`;
* the sizes (`lightning_hybrid.core.dims.ParallelDims`) and the options (`lightning_hybrid.options.ParallelOptions`),
  validated before any process exists;
* ``setup``: `parallelize` (every dimension, in its one order) -> to device -> precision -> gradient sync
  (`lightning_hybrid.grad_sync.GradientSync`) -> optimizers (wrapped by it for ZeRO 0-2) -> `TrainingSteps`;
* each batch passes the dimensions' hooks (`lightning_hybrid.core.hooks.StepHooks`); the training step and its
  backward are `lightning_hybrid.steps.TrainingSteps`'; clipping by the global norm is the gradient sync's
  (through the precision plugin, `lightning_hybrid.precision`); checkpoints are `lightning_hybrid.checkpoint`'s;
  a SIGTERM stops every rank at one step boundary (`lightning_hybrid.runtime.preemption`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ContextManager, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.checks.user_checks import UserCodeChecks
from lightning_hybrid.core.dims import ParallelDims
from lightning_hybrid.grad_sync import GradientSync
from lightning_hybrid.mesh_strategy import MeshStrategy
from lightning_hybrid.options import DEFAULT_BUCKET_CAP_MB, Compile, ParallelOptions, Recompute
from lightning_hybrid.parallelize import Parallelized, builds_on_meta, parallelize
from lightning_hybrid.precision import with_global_norm_clipping
from lightning_hybrid.runtime.preemption import Preemption
from lightning_hybrid.runtime.rank_zero import BatchError, raise_from_rank_zero
from lightning_hybrid.steps import TrainingSteps
from lightning_hybrid.strategy_checkpoints import ShardedCheckpoints, refuse_checkpoint_io


class HybridStrategy(ShardedCheckpoints, MeshStrategy):
    """Data x tensor x pipeline x context x expert parallelism with ZeRO on one device mesh.

    Every argument is described in docs/strategy.md; in short: ``dp``, ``tp``, ``pp``, ``cp``, ``ep`` are the sizes
    (``dp=-1``: ``world_size // (tp * pp * cp)``; ``ep`` divides ``dp * cp``); ``zero_stage`` 0-3 over the gradient
    ranks, with gradient buckets of ``bucket_cap_mb``; under ZeRO-3 ``dp_shard`` (hybrid sharding: shard within groups
    of ``dp_shard`` ranks, replicate across them) and ``grad_reduce`` (``"micro_batch"``, ``"window"`` or ``"auto"``:
    when gradients are reduce-scattered under accumulation); ``tp_plan`` (``"auto"`` or glob patterns -> ``"colwise" |
    "rowwise" | "replicate"``), ``sequence_parallel``, ``loss_parallel``, ``async_tp`` (CUDA, compiled) for TP; ``fp8``
    (torchao's ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` or a ``Float8LinearConfig``), ``fp8_exclude``
    (globs of linears kept out of it) and ``fp8_all_gather`` (ZeRO-3 gathers their weights in float8, tensorwise);
    ``cp_attention`` (``"all_gather"`` or ``"ring"``: how CP's attention meets the other ranks' keys and values);
    ``overlap_param_gather`` (ZeRO 1-2: the updated parameters all-gathered under the next forward, ``None``: wherever
    it can be); ``micro_batches``, ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``),
    ``virtual_stages``, ``split_points`` for PP (refused at ``pp=1``); ``activation_checkpointing``, ``recompute``,
    ``compile``; ``randomness`` (``"exact"``: one device's draws or refused; ``"independent"``: per-rank streams);
    ``batch_check_interval`` (every n-th batch compared between the ranks that share it); ``process_group_backend``
    (default from the accelerator: gloo on CPU, nccl on CUDA) and ``timeout``.
    """

    strategy_name = "hybrid"

    def __init__(
        self, dp: int = -1, tp: int = 1, pp: int = 1, zero_stage: int = 0, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        tp_plan: Union[str, dict[str, Any]] = "auto", sequence_parallel: bool = False, loss_parallel: bool = True,
        micro_batches: Optional[int] = None, schedule: Optional[str] = None, virtual_stages: Optional[int] = None,
        split_points: Optional[list[int]] = None, activation_checkpointing: Union[bool, str] = False,
        recompute: Recompute = "full", compile: Compile = False, ep: int = 1, cp: int = 1,
        batch_check_interval: int = 100, randomness: str = "exact", dp_shard: Optional[int] = None,
        grad_reduce: str = "auto", async_tp: bool = False, fp8: Any = None, fp8_exclude: Optional[list[str]] = None,
        fp8_all_gather: bool = False, cp_attention: str = "all_gather", overlap_param_gather: Optional[bool] = None,
        process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None, cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None, precision_plugin: Optional[Any] = None,
    ) -> None:
        requested = ParallelDims.request(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard)
        super().__init__(requested, process_group_backend, timeout, accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.options = ParallelOptions.create(
            requested, zero_stage=zero_stage, tp_plan=tp_plan, sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel, micro_batches=micro_batches, schedule=schedule,
            virtual_stages=virtual_stages, split_points=split_points, activation_checkpointing=activation_checkpointing,
            recompute=recompute, compile=compile, batch_check_interval=batch_check_interval, randomness=randomness,
            bucket_cap_mb=bucket_cap_mb, grad_reduce=grad_reduce, async_tp=async_tp, fp8=fp8,
            fp8_exclude=fp8_exclude, fp8_all_gather=fp8_all_gather, cp_attention=cp_attention,
            overlap_param_gather=overlap_param_gather,
        )
        refuse_checkpoint_io(checkpoint_io)
        self._parallelized: Optional[Parallelized] = None
        self._sync: Optional[GradientSync] = None
        self._checks: Optional[UserCodeChecks] = None  # what users write (`lightning_hybrid.checks.user_checks`)
        self._steps: Optional[TrainingSteps] = None
        self._preemption = Preemption()
        self.last_grad_norm: Optional[Tensor] = None

    @property
    def parallelized(self) -> Optional[Parallelized]:
        """What `parallelize` made of the module (after setup): its TP report, pipeline, hooks, ..."""
        return self._parallelized

    @ParallelStrategy.precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning hands the plugin it chose for `Trainer(precision=...)` to this setter. Its stock
        # `clip_grad_by_norm` would clip by this rank's local norm; ours clips by the global one.
        self._precision_plugin = None if plugin is None else with_global_norm_clipping(
            plugin, self.clip_grad_by_norm, self._prepare_gradients, self._watch_gradients, self._settle_gradients)

    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: Optional[Any]) -> None:
        refuse_checkpoint_io(io)  # a CheckpointIO given to the Trainer as a plugin: refused, as the argument
        self._checkpoint_io = io

    # ------------------------------------------------------------------ batches
    def check_before_launch(self, args: tuple) -> None:
        """Before the other ranks start: a data module or training loader among ``fit``'s arguments whose batch
        size the layout cannot train (`ParallelOptions.data_error`) is a `BatchError` here."""
        for arg in args:
            self._check_data(arg)

    def _check_data(self, data: Any) -> None:
        if (error := self.options.data_error(data)) is not None:
            raise_from_rank_zero(BatchError(error))

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """The batch on the device, compared with its peers' where due, then as the dimensions' hooks make it."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        stage = trainer.state.stage.value if trainer is not None and trainer.state.stage else "a"
        if self._checks is not None:
            self._checks.check_batch(batch, stage)
        read = batch
        for hook in self._parallelized.hooks if self._parallelized is not None else ():
            try:
                batch = hook.on_batch(batch, stage)
            except (ValueError, TypeError) as e:
                raise_from_rank_zero(BatchError(str(e)))
        if batch is not read and self._checks is not None:
            self._checks.split(read, batch, trainer is not None and trainer.training)
        return batch

    # ------------------------------------------------------------------ model and optimizers
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.keep_sample_order(trainer)
        module = self.lightning_module
        if self._parallelized is None or self._parallelized.module is not module:  # a second fit reuses it
            self._parallelized = parallelize(module, self.meshes, self.options, self.root_device)
        if trainer.state.fn == "fit":  # launched by torchrun or SLURM: checked here, before any step, alike on all
            self._check_data(trainer.datamodule)  # (the model's own errors first)
        self.model_to_device()
        if self._checks is not None:
            self._checks.close()
        self._checks = UserCodeChecks(module, self._parallelized, self.parallel_dims, self.options, self.root_device,
                                      self.global_rank, self.world_size, self.dp_rank, trainer.accumulate_grad_batches)
        self.model = self.precision_plugin.convert_module(self.model)
        if self._sync is None or self._sync.parallelized is not self._parallelized:
            self._sync = GradientSync(self._parallelized, self.options.zero_stage, self.options.bucket_cap_mb,
                                      self.root_device, self.options.grad_reduce)
        self._steps = TrainingSteps(module, self._parallelized, self._sync, self._checks,
                                    trainer.accumulate_grad_batches)
        if trainer.state.fn == "fit":  # the optimizers, wrapped by the gradient sync (ZeRO 0-2 over DP)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._sync_metrics_over_dp()
        evaluation = self._steps.evaluation()  # `self(x)` outside training steps, where a schedule runs the model
        if evaluation is not None:
            self._run_scope.enter_context(evaluation)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        assert self._sync is not None
        self.optimizers = self._sync.wrap_optimizers(
            self.optimizers, self.options.defers_param_gather(self.lightning_module))

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """A module the layout builds per rank (`builds_on_meta`) is built on the meta device: each rank then
        materialises only its own layers (under ``tp > 1`` only its slices of them)."""
        if builds_on_meta(self._requested, self.lightning_module):
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    # ------------------------------------------------------------------ the run
    def on_train_start(self) -> None:
        super().on_train_start()
        self._preemption.catch(self._run_scope, self.global_rank)  # after Lightning's handlers, which it replaces
        if self._checks is not None:  # after Lightning has seeded: randomness="independent"'s own streams
            self._checks.seed_streams()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._steps is not None
        trainer = module.trainer
        self.forensics.mark_progress(trainer.fit_loop.total_batch_idx)
        first_in_window = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        return self._steps.training_step(lambda: super(HybridStrategy, self).training_step(*args, **kwargs),
                                         args[0] if args else kwargs.get("batch"), first_in_window)

    on_validation_start = on_train_end = ShardedCheckpoints._gathered  # Lightning's own are no-ops

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        assert self._steps is not None
        return self._steps.backward(closure_loss, lambda loss: super(HybridStrategy, self).backward(
            loss, optimizer, *args, **kwargs))

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for the backward passes of an accumulation window but the last one."""
        assert self._sync is not None
        with self._sync.accumulating():
            yield

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._prepare_gradients()  # manual optimization: the backward passes since the last step, reduced once
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._checks is not None:
            self._checks.stepped()
        if torch.distributed.is_initialized():
            self._preemption.agree(self.lightning_module.trainer, self.root_device)
        if self._sync is not None:  # ZeRO 1-2's gathers start: until the next forward ends, reads wait for them
            self._sync.after_step()
        return output

    def on_exception(self, exception: BaseException) -> None:
        """On a SIGTERM every rank agreed on: ``last.ckpt`` first; then stop as on any error."""
        if self._sync is not None:
            self._sync.stop()
        self._preemption.save_on_stop(exception, getattr(self.lightning_module, "_trainer", None), self.global_rank)
        super().on_exception(exception)

    # ------------------------------------------------------------------ gradients
    def _prepare_gradients(self) -> None:
        if self._sync is not None:
            self._sync.flush()

    def _settle_gradients(self) -> ContextManager[Any]:
        assert self._steps is not None  # Lightning's on_after_backward runs in it (`TrainingSteps.settled`)
        return self._steps.settled()

    def _watch_gradients(self) -> ContextManager[Any]:
        """The hooks between a backward and its optimizer step (`UserCodeChecks.watch_gradients`)."""
        unreduced = self._sync is not None and self._sync.holds_local_parts()
        return self._checks.watch_gradients(unreduced) if self._checks is not None else contextlib.nullcontext()

    @contextmanager
    def _own_norms(self) -> Generator[GradientSync, None, None]:
        """The gradients reduced (`GradientSync.flush`), for the strategy's own norms: not the user's
        (`UserCodeChecks.own_norms`)."""
        assert self._sync is not None
        self._sync.flush()
        with self._checks.own_norms() if self._checks is not None else contextlib.nullcontext():
            yield self._sync

    def grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The global L2 norm of the gradients of ``optimizer``'s parameters (equal to one device's)."""
        with self._own_norms() as sync:
            return sync.grad_norm(optimizer)

    def parameter_grad_norms(self) -> dict[str, Tensor]:
        """Each parameter's whole-gradient L2 norm by name (`GradientSync.parameter_grad_norms`; collective)."""
        with self._own_norms() as sync:
            return sync.parameter_grad_norms()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the global norm across TP and ZeRO shards and pipeline stages (kept in ``last_grad_norm``); the
        precision plugin's ``clip_grad_by_norm`` (``gradient_clip_val``) calls it."""
        with self._own_norms() as sync:
            self.last_grad_norm = sync.clip(getattr(optimizer, "_optimizer", optimizer), float(clip_val))

    def teardown(self) -> None:
        # As Lightning's ModelParallelStrategy: the module stays where it is (moving it to the CPU would also fail
        # on a pipelined module whose setup stopped on the meta device, and hide the error that stopped it).
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._sync is not None:  # a later fit wraps new optimizers with buckets of their own
            self._sync.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self._run_scope.close()
