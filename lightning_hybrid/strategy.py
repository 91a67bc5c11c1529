"""`HybridStrategy`: the seam between Lightning and the parallel dimensions; it composes nothing itself.

* the processes, the ``(pp, dp, tp)`` mesh and Lightning's collectives over DP: `MeshStrategy`;
* the options, validated before any process exists: `lightning_hybrid.options.ParallelOptions`;
* ``setup``: `parallelize` (`lightning_hybrid.parallelize`: every dimension, in its one order) -> to device ->
  precision -> gradient sync (`lightning_hybrid.grad_sync.GradientSync`) -> optimizers (wrapped by it for ZeRO 0-2);
* the steps delegate: the pipeline schedule and the accumulation window to `GradientSync`, clipping by the global
  norm to it (through the precision plugin, `lightning_hybrid.precision`), sharded checkpoints to
  `lightning_hybrid.checkpoint`;
* token weighting: for a module with ``loss_items(target)`` (`lightning_hybrid.pipeline.protocol.PipelineModule`)
  each batch's backward is that of its loss *sum* and `GradientSync` divides by the items of the whole window
  on every DP rank: the loss is the global batch's token mean, as one device gives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ContextManager, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.activation_checkpointing import Recompute
from lightning_hybrid.checkpoint import full_state_dict, load_sharded, save_sharded
from lightning_hybrid.checkpoint import remove as remove_checkpoint_path
from lightning_hybrid.compile import Compile
from lightning_hybrid.batch import TokenBatch
from lightning_hybrid.context_parallel import ContextParallel, split_batch
from lightning_hybrid.grad_sync import GradientSync
from lightning_hybrid.mesh_strategy import MeshStrategy
from lightning_hybrid.options import ParallelOptions
from lightning_hybrid.parallelize import Parallelized, parallelize
from lightning_hybrid.pipeline.protocol import LayerwiseInit
from lightning_hybrid.pipeline.stages import bind_evaluation, bind_loss_items, bind_training
from lightning_hybrid.precision import with_global_norm_clipping
from lightning_hybrid.rank_zero import BatchError, raise_from_rank_zero
from lightning_hybrid.tensor_parallel import TPResult
from lightning_hybrid.user_checks import UserCodeChecks
from lightning_hybrid.zero import DEFAULT_BUCKET_CAP_MB


class HybridStrategy(MeshStrategy):
    """Data x tensor x pipeline parallelism with ZeRO on one ``(pp, dp, tp)`` device mesh (docs/strategy.md).

    Args:
        dp, tp, pp: the mesh's sizes; ``dp=-1`` infers DP as ``world_size // (tp * pp)``. TP replaces
            ``nn.Linear``/``nn.Embedding`` by column/row/vocab-parallel layers as ``tp_plan`` says; PP needs the
            pipeline protocol (`lightning_hybrid.pipeline.PROTOCOL_HELP`).
        zero_stage: over DP: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters; FSDP2).
        bucket_cap_mb: size cap of one gradient bucket (stages 0-2); a bucket's reduction starts as soon as
            backward has completed it, overlapping the rest of the backward.
        tp_plan: ``"auto"`` (the model's own plan where it ships one, else the heuristic) or a dict of glob
            patterns over module names -> ``"colwise" | "rowwise" | "replicate"`` (or a dict pinning
            ``part_sizes``, ``gather_output``, ``input_is_parallel``) overriding it where it matches.
        micro_batches, schedule, virtual_stages, split_points: under ``pp > 1`` (refused at ``pp=1``): micro-batches
            per batch (default ``2 * pp``); ``"gpipe"``, ``"1f1b"`` (default; GPipe for a module that adds a loss of
            the whole batch, `lightning_hybrid.pipeline.PipelineAuxLoss`), ``"interleaved_1f1b"``
            (``virtual_stages >= 2`` stages per rank) or ``"zero_bubble"`` (ZB-V); the indices of the layers that
            start stages 1..n-1 (default: stages balanced by parameter count).
        sequence_parallel: under ``tp > 1`` (refused at ``tp=1``), Megatron SP: the activations between the TP
            regions are split along the sequence over the TP group; verified like every split.
        loss_parallel: a column-split LM head's logits stay split over the vocabulary (`SplitLogits`):
            ``F.cross_entropy`` on them is computed from the shards, any other use gathers them on demand.
        activation_checkpointing: ``True`` recomputes every layer in backward (the pipeline layers under ``pp > 1``,
            else the elements of ``nn.ModuleList``s); a glob pattern picks modules by name.
        recompute: what a checkpointed layer recomputes: ``"full"``, ``"attention"`` (the attention core only:
            selective recompute), ``"pointwise"`` (and every element-wise op) or a list of aten op names; anything
            but ``"full"`` checkpoints every layer when ``activation_checkpointing`` is ``False``.
        compile: ``torch.compile`` each layer (those ``activation_checkpointing=True`` takes), after TP and
            checkpointing, before ZeRO-3 and the pipeline executor; ``True`` or ``torch.compile``'s arguments.
        ep: expert parallelism (mixture-of-experts models): each experts module split over ``ep`` of the DP ranks,
            tokens exchanged with all-to-alls, dropless (`lightning_hybrid.expert_parallel`); ``ep`` divides
            ``dp * cp``.
        cp: context parallelism: every sequence split over ``cp`` ranks (the zigzag split), attention over the
            whole sequence by all-gathering keys and values (`lightning_hybrid.context_parallel`); token batches
            whose length is a multiple of ``2 * cp``; ``dp=-1`` infers ``world_size // (tp * pp * cp)``.
        randomness: random ops in training (dropout, router noise): ``"exact"`` draws what one device draws where
            a rank holds what one device holds and refuses any other before the first optimizer step;
            ``"independent"`` gives every rank its own streams (data-parallel, CP and pipeline ranks apart, TP ranks
            apart where their activations are split): statistically, not bitwise, one device's run
            (`lightning_hybrid.randomness`).
        batch_check_interval: the ranks that must train on the same batch (a data-parallel rank's TP, PP and CP
            peers) compare a fingerprint of it on the first batches of every run and then every
            ``batch_check_interval``-th (`lightning_hybrid.batch_check`): a loader that splits by the world's rank
            instead of `dp_rank` is an error, not another model.
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
        ep: int = 1,
        cp: int = 1,
        batch_check_interval: int = 100,
        randomness: str = "exact",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        super().__init__(
            (dp, tp, pp, cp), process_group_backend, timeout, accelerator=accelerator,
            parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = ParallelOptions.create(
            dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, bucket_cap_mb=bucket_cap_mb, tp_plan=tp_plan,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, micro_batches=micro_batches,
            schedule=schedule, virtual_stages=virtual_stages, split_points=split_points,
            activation_checkpointing=activation_checkpointing, recompute=recompute, compile=compile, ep=ep, cp=cp,
            batch_check_interval=batch_check_interval, randomness=randomness,
        )
        _refuse_checkpoint_io(checkpoint_io)
        self._parallelized: Optional[Parallelized] = None
        self._sync: Optional[GradientSync] = None
        self._checks: Optional[UserCodeChecks] = None  # what users write (`lightning_hybrid.user_checks`)
        self.last_grad_norm: Optional[Tensor] = None
        self._batch_items: Optional[Tensor] = None  # the loss items of the step whose backward comes next
        self._sigterm = False  # this rank received SIGTERM (`_on_sigterm`)
        self._stopping = False  # every rank agreed to stop after this step (`_agree_on_sigterm`)

    @property
    def zero_stage(self) -> int:
        return self.options.zero_stage

    @property
    def sequence_parallel(self) -> bool:
        return self.options.sequence_parallel

    @property
    def expert_parallel_size(self) -> int:
        """``ep``: a module that builds its layers per rank (``CausalLM``) defers them, so that each rank fills
        (or reads from a pretrained folder) only its own experts."""
        return self.options.ep

    @property
    def context_parallel_size(self) -> int:
        """``cp``: each rank's batch holds ``1 / cp`` of every sequence (FLOPs and token counts of a batch are the
        whole sequences')."""
        return self.options.cp

    @property
    def tensor_parallel_report(self) -> Optional[TPResult]:
        """What TP split and how (after setup; ``None`` under ``tp=1``)."""
        return self._parallelized.tp_report if self._parallelized is not None else None

    @ParallelStrategy.precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning hands the plugin it chose for `Trainer(precision=...)` to this setter. Its stock
        # `clip_grad_by_norm` would clip by this rank's local norm; ours clips by the global one.
        self._precision_plugin = None if plugin is None else with_global_norm_clipping(
            plugin, self.clip_grad_by_norm, self._prepare_gradients, self._watch_gradients)

    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: Optional[Any]) -> None:
        # Lightning hands a CheckpointIO given to the Trainer as a plugin to this setter: refused, as the argument.
        _refuse_checkpoint_io(io)
        self._checkpoint_io = io

    # ------------------------------------------------------------------ checks on the data
    def check_before_launch(self, args: tuple) -> None:
        """Before the other ranks start: a data module or training data loader among ``fit``'s arguments whose
        batch size the layout cannot train (`ParallelOptions.batch_size_error`) is a `BatchError` here."""
        for arg in args:
            self._check_batch_size(_batch_size_of(arg))

    def _check_batch_size(self, batch_size: Optional[int]) -> None:
        error = None if batch_size is None else self.options.batch_size_error(batch_size)
        if error is not None:
            raise_from_rank_zero(BatchError(error))

    # ------------------------------------------------------------------ context parallelism
    @property
    def _context(self) -> Optional[ContextParallel]:
        """The attention over the CP group (after setup, under ``cp > 1``), else None."""
        return self._parallelized.context if self._parallelized is not None else None

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """The batch on the device, compared with the peers' where due (`BatchCheck`); under ``cp > 1`` this CP
        rank's share of its sequences (`lightning_hybrid.context_parallel.split_batch`), as a `TokenBatch` with the
        tokens' positions."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._checks is not None:
            self._checks.check_batch(batch, trainer.state.stage.value if trainer and trainer.state.stage else "a")
        context = self._context
        if context is None:
            return batch
        if trainer is not None and trainer.predicting:
            raise_from_rank_zero(BatchError(
                f"predict under cp={context.size} is not supported: each rank would return its share of the"
                " sequences' logits, in the split's order; predict with cp=1."
            ))
        try:
            whole = TokenBatch.from_batch(batch)
            share = split_batch(whole, context.size, context.rank)
        except (ValueError, TypeError) as e:
            raise_from_rank_zero(BatchError(f"cp={context.size}: {e}"))
        context.new_batch(share.position_ids)
        if self._checks is not None:
            self._checks.split(whole, share, trainer is not None and trainer.training)
        return share

    def _check_attention_reached(self) -> None:
        """After the first training step under ``cp > 1``: ``ValueError`` on every rank where no layer's attention
        went through ``F.scaled_dot_product_attention`` (an eager or flash attention cannot be split)."""
        context = self._context
        if context is None or context.verified:
            return
        calls = torch.tensor([context.calls], device=self.root_device)
        torch.distributed.all_reduce(calls)
        if not int(calls):
            raise ValueError(
                f"cp={context.size}: no attention of {type(self.lightning_module).__name__} went through"
                " torch.nn.functional.scaled_dot_product_attention, which context parallelism splits over the"
                " sequence: use an SDPA attention (transformers: attn_implementation='sdpa'), or cp=1."
            )
        context.verified = True

    # ------------------------------------------------------------------ model and optimizers
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._parallelized is None or self._parallelized.module is not module:  # a second fit reuses it
            self._parallelized = parallelize(module, self.device_mesh, self.options, self.root_device)
        if trainer.state.fn == "fit":  # launched by torchrun or SLURM: checked here, before any step, alike on all
            self._check_batch_size(_batch_size_of(trainer.datamodule))  # (the model's own errors first)
        self.model_to_device()
        if self._checks is not None:
            self._checks.close()
        self._checks = UserCodeChecks(module, self._parallelized, self.parallel_dims, self.options, self.root_device,
                                      self.global_rank, self.world_size, self.dp_rank, trainer.accumulate_grad_batches)
        summed = self._checks.reduction == "sum"
        pipeline = self._parallelized.pipeline
        if pipeline is not None:  # the schedule runs the backward: it applies accumulation's 1/k itself
            pipeline.loss_scale = 1.0 / trainer.accumulate_grad_batches
            pipeline.loss_items = self._loss_items()
            pipeline.loss_sum = summed
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        if self._sync is None or self._sync.parallelized is not self._parallelized:
            self._sync = GradientSync(self._parallelized, self.zero_stage, self.options.bucket_cap_mb, self.root_device)
        self._sync.sum_loss = summed and module.automatic_optimization
        self._sync.manual = not module.automatic_optimization
        if trainer.state.fn == "fit":  # the optimizers, wrapped by the gradient sync (ZeRO 0-2 over DP)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._sync_metrics_over_dp()
        if pipeline is not None:  # `self(x)` outside training steps: the pipeline's forward-only path
            self._run_scope.enter_context(bind_evaluation(module, pipeline))

    # ------------------------------------------------------------------ preemption (SIGTERM)
    def _catch_sigterm(self) -> None:
        """While the run lasts, SIGTERM only marks this rank (`_on_sigterm`). Lightning's own handler broadcasts
        inside the signal handler, which pairs with whatever collective another rank is in: a hang or worse."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._run_scope.callback(signal.signal, signal.SIGTERM, previous)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._sigterm = self._stopping = False
        self._catch_sigterm()  # after Lightning's (it registers its handlers once the strategy is set up)
        if self._checks is not None:  # after Lightning has seeded: randomness="independent"'s own streams
            self._checks.seed_streams()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        os.write(2, f"[rank {self.global_rank}] SIGTERM: stopping after this step\n".encode())

    def _agree_on_sigterm(self) -> None:
        """After every optimizer step, a consistent point of every rank: if any rank received SIGTERM, all stop
        here (Lightning's loop raises its ``SIGTERMException`` at the end of this batch on every rank), and
        `on_exception` saves ``last.ckpt`` first. One one-element all-reduce per step."""
        flag = torch.tensor([1 if self._sigterm else 0], device=self.root_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if int(flag) and not self._stopping:
            self._stopping = True
            trainer = self.lightning_module.trainer
            trainer._signal_connector.received_sigterm = True  # what Lightning's handler would set

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._prepare_gradients()  # manual optimization: the backward passes since the last step, reduced once
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._checks is not None:
            self._checks.stepped()
        if torch.distributed.is_initialized():
            self._agree_on_sigterm()
        return output

    def on_exception(self, exception: BaseException) -> None:
        """On a SIGTERM every rank agreed on: save ``last.ckpt`` in the ``ModelCheckpoint``'s folder (all ranks,
        at the same step boundary), then stop as on any error."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        if isinstance(exception, SIGTERMException) and self._stopping and getattr(checkpoint, "dirpath", None):
            path = os.path.join(checkpoint.dirpath, checkpoint.CHECKPOINT_NAME_LAST + checkpoint.FILE_EXTENSION)
            trainer.save_checkpoint(path)
            os.write(2, f"[rank {self.global_rank}] SIGTERM: saved {path} at step {trainer.global_step}\n".encode())
        super().on_exception(exception)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        assert self._sync is not None
        self.optimizers = self._sync.wrap_optimizers(self.optimizers)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Under ``pp > 1`` a module that can initialise single pipeline layers (`LayerwiseInit`) is built on the
        meta device: each rank then materialises only its own layers (under ``tp > 1`` only its slices of them).
        A module may also leave its layers to the strategy by itself (`DeferredLayers`)."""
        if self.options.pp > 1 and isinstance(self.lightning_module, LayerwiseInit):
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    # ------------------------------------------------------------------ gradients users touch
    def _prepare_gradients(self) -> None:
        if self._sync is not None:
            self._sync.flush()

    def _watch_gradients(self) -> ContextManager[Any]:
        """The hooks between a backward and its optimizer step (`UserCodeChecks.watch_gradients`)."""
        return self._checks.watch_gradients() if self._checks is not None else contextlib.nullcontext()

    def _own_norms(self) -> ContextManager[Any]:
        """The strategy's own norms of the gradients: not the user's (`UserCodeChecks.own_norms`)."""
        return self._checks.own_norms() if self._checks is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ steps and gradients
    def _loss_items(self) -> Optional[Any]:
        """The module's ``loss_items`` where the loss is token-weighted (automatic optimization), else ``None``."""
        module = self.lightning_module
        items = getattr(module, "loss_items", None)
        return items if callable(items) and module is not None and module.automatic_optimization else None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        pipeline = self._parallelized.pipeline if self._parallelized is not None else None
        module = self.lightning_module
        assert module is not None and self._sync is not None
        self.mark_progress(module.trainer.fit_loop.total_batch_idx)
        self._batch_items = None
        checks = self._checks
        assert checks is not None
        checks.refuse_undeclared_loss(args[0] if args else kwargs.get("batch"))
        loss_items = self._loss_items()
        verify = checks.loss_verifier(loss_items, pipelined=pipeline is not None)
        if pipeline is None:
            if loss_items is None and verify is None:
                with checks.first_step():
                    output = super().training_step(*args, **kwargs)
                self._check_attention_reached()
                return output
            with checks.first_step(), bind_loss_items(module, loss_items, verify) as counted:
                output = super().training_step(*args, **kwargs)
            self._check_attention_reached()
            if loss_items is not None:
                self._batch_items = counted.items(output)
            return output
        first_in_window = module.trainer.fit_loop.epoch_loop.batch_idx % module.trainer.accumulate_grad_batches == 0
        pipeline.verify_loss = verify

        def step() -> Any:
            with bind_training(module, pipeline) as binding:
                output = ParallelStrategy.training_step(self, *args, **kwargs)
            binding.check_output(output)
            return output

        with checks.first_step():
            output = self._sync.pipeline_step(step, first_in_window)
        self._check_attention_reached()
        if pipeline.loss_items is not None and output is not None:
            self._sync.add_loss_items(pipeline.last_items)
        return output

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        assert self._sync is not None
        if self._parallelized is None or self._parallelized.pipeline is None:
            items, self._batch_items = self._batch_items, None
            k = self.lightning_module.trainer.accumulate_grad_batches
            if items is not None:  # the gradient of the batch's loss sum (Lightning divided the mean by k)
                self._sync.add_loss_items(items)
                super().backward(closure_loss * (items.to(closure_loss) * k), optimizer, *args, **kwargs)
                return closure_loss
            if self._sync.sum_loss and k > 1:  # a sum over the window: Lightning's division by k undone
                super().backward(closure_loss * k, optimizer, *args, **kwargs)
                return closure_loss
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._sync.unstash()  # the schedule already ran the backward inside training_step
        self.post_backward(closure_loss)
        return closure_loss

    def post_backward(self, closure_loss: Tensor) -> None:
        assert self._sync is not None
        context = self._context
        if context is not None:  # the batch's documents: no longer needed
            context.new_batch()
        self._sync.reduce()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for the backward passes of an accumulation window but the last one."""
        assert self._sync is not None
        with self._sync.accumulating():
            yield

    def grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The global L2 norm of the gradients of ``optimizer``'s parameters (equal to one device's)."""
        assert self._sync is not None
        self._sync.flush()
        with self._own_norms():
            return self._sync.grad_norm(optimizer)

    def parameter_grad_norms(self) -> dict[str, Tensor]:
        """Each parameter's whole-gradient L2 norm by name (`GradientSync.parameter_grad_norms`; collective)."""
        assert self._sync is not None
        self._sync.flush()
        with self._own_norms():
            return self._sync.parameter_grad_norms()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the global norm across TP and ZeRO shards and pipeline stages; the norm is kept in
        ``last_grad_norm``. The precision plugin's ``clip_grad_by_norm`` (``gradient_clip_val``) calls it."""
        assert self._sync is not None
        self._sync.flush()
        with self._own_norms():
            self.last_grad_norm = self._sync.clip(getattr(optimizer, "_optimizer", optimizer), float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    # Sharded, reshardable, crash-safe folders (lightning_hybrid.checkpoint): weights and optimizer state are
    # written from the live model in `save_checkpoint` and read into it in `load_checkpoint`, so Lightning's
    # own state-dict hooks have nothing to do.
    def full_state_dict(self) -> dict[str, Tensor]:
        """The full (unsplit) state dict on every rank: gathered over TP, ZeRO-3 and the pipeline stages.
        Collective over the whole mesh; the plain (one-device) module loads it with ``load_state_dict``."""
        assert self.lightning_module is not None
        return full_state_dict(self.lightning_module, self.pp_group)

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
        assert self.lightning_module is not None
        save_sharded(
            self.broadcast(str(filepath)), self.lightning_module, self.optimizers, self.device_mesh, checkpoint,
            self.zero_stage, int(self.options.bucket_cap_mb * 2**20), self.root_device, self.options.ep,
            self.options.cp,
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        return load_sharded(self.broadcast(str(checkpoint_path)), self.lightning_module, self.optimizers)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(filepath)

    def teardown(self) -> None:
        # As Lightning's ModelParallelStrategy: the module stays where it is. (Moving it to the CPU would also
        # fail on a pipelined module whose setup stopped before its layers left the meta device, and hide
        # the error that stopped it.)
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._sync is not None:  # a later fit wraps new optimizers with buckets of their own
            self._sync.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self._run_scope.close()


def _batch_size_of(data: Any) -> Optional[int]:
    """The per-rank training batch size a data module (``batch_size`` attribute or hyperparameter) or a data loader
    says it gives, else ``None``."""
    if isinstance(data, torch.utils.data.DataLoader):
        return data.batch_size
    if isinstance(data, pl.LightningDataModule):
        size = getattr(data, "batch_size", None)
        if size is None:
            size = getattr(data, "hparams", {}).get("batch_size")
        return size if isinstance(size, int) and not isinstance(size, bool) else None
    return None


def _refuse_checkpoint_io(io: Any) -> None:
    if io is not None:
        raise ValueError(
            f"checkpoint_io={io!r} would not be used: HybridStrategy writes sharded, reshardable checkpoints itself"
            " (lightning_hybrid.checkpoint, through torch.distributed.checkpoint). Leave it unset."
        )
