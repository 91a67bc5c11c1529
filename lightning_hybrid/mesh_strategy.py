"""`MeshStrategy`: a Lightning `ParallelStrategy` on the layout's meshes -- the processes, the meshes and what
Lightning's own collectives mean on them. It knows nothing of the model; `HybridStrategy` builds on it.

* ``setup_environment``: `ParallelDims.for_world` validates the sizes against the world size (before any process
  group exists, so every rank raises the same error), then the process group (backend from Lightning's
  accelerator: gloo on CPU, nccl on CUDA) and every named mesh view, once (`ParallelDims.build_meshes`);
* only DP ranks see different samples, in the training loader's own order while fitting (one device's global
  batches: `lightning_hybrid.runtime.sample_order`, which takes Lightning's sampler injection over), and Lightning's
  collectives -- ``self.log(..., sync_dist=True)``, torchmetrics, ``all_gather`` -- run over the DP group: TP and
  PP ranks hold copies;
* a failing rank 0 stops the ranks it started (Lightning leaves them waiting until the timeout);
* a collective that fails -- it timed out, or a peer's connection closed because that rank died -- is reported in
  one ``error:`` line naming the collective, where it was called, and the ranks that never came or that died
  (`lightning_hybrid.runtime.forensics`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_hybrid.core.dims import Meshes, ParallelDims, barrier
from lightning_hybrid.runtime.clean_exit import register_clean_exit
from lightning_hybrid.runtime.forensics import CheckedLauncher, Forensics, without_traceback
from lightning_hybrid.runtime.ports import free_main_port
from lightning_hybrid.runtime.rank_zero import library_warnings_from_rank_zero
from lightning_hybrid.runtime.sample_order import SampleOrder

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class MeshStrategy(ParallelStrategy):
    """The processes and the meshes of the ``requested`` sizes (`lightning_hybrid.core.dims.ParallelDims`;
    ``dp=-1``: inferred from the world size). ``process_group_backend`` overrides the one chosen from the
    accelerator; ``timeout``: the process group's."""

    def __init__(
        self, requested: ParallelDims, process_group_backend: Optional[str], timeout: Optional[timedelta],
        **lightning: Any,
    ) -> None:
        super().__init__(**lightning)
        self._requested = requested
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._meshes: Optional[Meshes] = None
        self.forensics = Forensics(timeout, lambda: self._launcher, wrappers=(__file__,))
        # What lasts from `setup_environment` to `teardown`: library warnings from rank 0 only, and whatever a
        # subclass binds for the run.
        self._run_scope = ExitStack()
        self._sample_order: Optional[SampleOrder] = None

    # ------------------------------------------------------------------ layout
    @property
    def parallel_dims(self) -> ParallelDims:
        """The sizes: as requested (``dp`` may be -1) until the processes have started, then resolved against the
        world size (`setup_environment`)."""
        return self._dims if self._dims is not None else self._requested

    @property
    def meshes(self) -> Meshes:
        """Every named view of the ranks (`lightning_hybrid.core.dims.Meshes`)."""
        if self._meshes is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._meshes

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The ``(pp, dp_cp, tp)`` world mesh (the LightningModule's ``device_mesh``)."""
        return self.meshes.world

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The gradient ranks' group (``dp * cp`` ranks): where Lightning's collectives reduce."""
        return self.meshes.group("dp_cp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.meshes.group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.meshes.group("pp")

    @property
    def dp_rank(self) -> int:
        """This rank's place among the ranks with other samples (a CP group shares its samples)."""
        return self.meshes.local_rank("dp")

    @property
    def dp_size(self) -> int:
        """How many ranks see other samples: the data-parallel size (``dp``; not ``dp * cp``, the gradient ranks).
        A loader that splits its data itself splits it by `dp_rank` and `dp_size` (docs/data.md)."""
        if self._dims is None:
            raise RuntimeError("dp_size is known once the processes have started (in `setup_environment`).")
        return self._dims.dp

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
        # Only DP ranks see different samples; a TP group, a pipeline and a CP group share them.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def keep_sample_order(self, trainer: "pl.Trainer") -> None:
        """For this run, the samplers are this strategy's: each DP rank reads its share of the loader's own order
        (`lightning_hybrid.runtime.sample_order`); Lightning's injection, which would shuffle it, is off until
        teardown."""
        self._sample_order = SampleOrder(trainer)
        self._run_scope.callback(self._sample_order.close)

    def process_dataloader(self, dataloader: object) -> object:
        if self._sample_order is None:
            return dataloader
        return self._sample_order.process(dataloader, self.dp_size, self.dp_rank)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # ------------------------------------------------------------------ processes
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            if "MASTER_PORT" not in os.environ and self.num_processes * self.num_nodes > 1:
                os.environ["MASTER_PORT"] = str(free_main_port())  # see free_main_port; read by the launcher
            self._launcher = CheckedLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def check_before_launch(self, args: tuple) -> None:
        """Called with the arguments of the Trainer's entry point (``fit``'s model, data loaders, data module ...)
        before Lightning's launcher starts the other ranks: raise on what they can tell that would fail on the
        ranks. Nothing here; `HybridStrategy` checks the batch size."""

    def on_exception(self, exception: BaseException) -> None:
        """On the process that started the other ranks (Lightning's launcher): stop them. Lightning leaves them
        running on an error, and they would wait for this rank -- in the rendezvous, or in a collective -- until
        the process group's timeout. A collective that failed is named first: one that timed out with the ranks
        that never came, one that lost a peer with the ranks that died. Such a failure reaches every surviving
        rank alike; the ranks other than 0 print its message without the traceback (the line above says where)."""
        if self.forensics.report(exception) and self.global_rank != 0:
            with contextlib.suppress(Exception):
                without_traceback(exception)
        super().on_exception(exception)
        launcher = self._launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows has no SIGKILL

    def setup_environment(self) -> None:
        self._set_world_ranks()
        self._run_scope.enter_context(library_warnings_from_rank_zero(self.global_rank))
        # Validate before the process group exists: every rank raises the same error, none hangs.
        self._dims = self._requested.for_world(self.world_size)
        super().setup_environment()
        # No `reset_seed()` (Lightning's DDP re-seeds here): every rank ran the user's script up to `fit` (Lightning's
        # subprocess launcher, torchrun, SLURM), so its random state is already one device's. Re-seeding discarded
        # what the script drew after `seed_everything` (a model's default inits): dropout then drew other masks.
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
        register_clean_exit()
        self.forensics.start(self.global_rank, self.world_size)
        self._meshes = self._dims.build_meshes(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._meshes.world

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ Lightning's collectives, over DP
    def _sync_metrics_over_dp(self) -> None:
        """torchmetrics' states are reduced over the DP group (TP and PP ranks hold copies)."""
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
        if dist.is_initialized():
            barrier(self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

