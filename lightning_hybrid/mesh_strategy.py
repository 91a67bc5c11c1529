"""`MeshStrategy`: a Lightning `ParallelStrategy` on a ``(pp, dp, tp)`` device mesh -- the processes, the mesh and
what Lightning's own collectives mean on it. It knows nothing of the model; `HybridStrategy` builds on it.

* ``setup_environment``: `ParallelDims.resolve` validates the sizes against the world size (before any process
  group exists, so every rank raises the same error), then the process group (backend from Lightning's
  accelerator: gloo on CPU, nccl on CUDA) and the mesh;
* only DP ranks see different samples (the sampler's arguments), and Lightning's collectives -- ``self.log(...,
  sync_dist=True)``, torchmetrics, ``all_gather`` -- run over the DP group: TP and PP ranks hold copies;
* a failing rank 0 stops the ranks it started (Lightning leaves them waiting until the timeout).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import traceback
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
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_hybrid.mesh import ParallelDims, barrier
from lightning_hybrid.ports import free_main_port
from lightning_hybrid.rank_zero import library_warnings_from_rank_zero

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshStrategy(ParallelStrategy):
    """The processes and the ``(pp, dp, tp)`` mesh of ``sizes`` (``dp=-1``: inferred from the world size).
    ``process_group_backend`` overrides the one chosen from the accelerator; ``timeout``: the process group's."""

    def __init__(
        self, sizes: tuple[int, int, int], process_group_backend: Optional[str], timeout: Optional[timedelta],
        **lightning: Any,
    ) -> None:
        super().__init__(**lightning)
        self._sizes = sizes  # (dp, tp, pp) as requested
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._device_mesh: Optional["DeviceMesh"] = None
        # What lasts from `setup_environment` to `teardown`: library warnings from rank 0 only, and whatever a
        # subclass binds for the run.
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

    # ------------------------------------------------------------------ processes
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            if "MASTER_PORT" not in os.environ and self.num_processes * self.num_nodes > 1:
                os.environ["MASTER_PORT"] = str(free_main_port())  # see free_main_port; read by the launcher
            self._launcher = _CheckedLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def check_before_launch(self, args: tuple) -> None:
        """Called with the arguments of the Trainer's entry point (``fit``'s model, data loaders, data module ...)
        before Lightning's launcher starts the other ranks: raise on what they can tell that would fail on the
        ranks. Nothing here; `HybridStrategy` checks the batch size."""

    # ------------------------------------------------------------------ progress, for a rank that stops answering
    def mark_progress(self, batch: int) -> None:
        """Record in the process group's store that this rank started training batch ``batch`` (one small store
        write per batch), so that a rank whose collective times out can name the ranks that never came."""
        store = _store()
        if store is not None:
            store.set(f"{_PROGRESS_KEY}/{self.global_rank}", str(batch))
            self._batch = batch

    def _report_timeout(self, exception: BaseException) -> None:
        """If ``exception`` is a collective that timed out: one line on stderr naming the collective, where it was
        called, and the ranks that had not reached this rank's batch (from `mark_progress`)."""
        text = str(exception)
        if not (isinstance(exception, RuntimeError) and re.search(r"(?i)timed? ?out", text)):
            return
        frames = traceback.extract_tb(exception.__traceback__)
        inside = [i for i, f in enumerate(frames) if f.filename.endswith("distributed_c10d.py")]
        if not inside:
            return
        collective = frames[inside[-1]].name
        caller = next((f for f in reversed(frames[: inside[0]]) if "torch/distributed" not in f.filename), None)
        where = f" called from {caller.filename}:{caller.lineno} ({caller.name})" if caller else ""
        behind = []
        store, mine = _store(), getattr(self, "_batch", None)
        if store is not None and mine is not None:
            for rank in range(self.world_size):
                key = f"{_PROGRESS_KEY}/{rank}"
                theirs = int(store.get(key)) if store.check([key]) else -1
                if theirs < mine:
                    behind.append(f"rank {rank} (at batch {theirs})" if theirs >= 0 else f"rank {rank} (no batch)")
        who = ("; ranks that never reached this rank's batch " + f"{mine}: " + ", ".join(behind)) if behind else ""
        seconds = self._timeout.total_seconds() if self._timeout is not None else "?"
        os.write(2, f"error: rank {self.global_rank} waited {seconds:g} s in torch.distributed.{collective}{where},"
                    f" and a rank never joined it{who}.\n".encode())

    def on_exception(self, exception: BaseException) -> None:
        """On the process that started the other ranks (Lightning's launcher): stop them. Lightning leaves them
        running on an error, and they would wait for this rank -- in the rendezvous, or in a collective -- until
        the process group's timeout. A collective that timed out is named first, with the ranks that never came."""
        with contextlib.suppress(Exception):  # a report only: never in the way of the error itself
            self._report_timeout(exception)
        super().on_exception(exception)
        launcher = self._launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows has no SIGKILL

    def setup_environment(self) -> None:
        self._set_world_ranks()
        self._run_scope.enter_context(library_warnings_from_rank_zero(self.global_rank))
        # Validate before the process group exists: every rank raises the same error, none hangs.
        dp, tp, pp = self._sizes
        self._dims = ParallelDims.resolve(dp, tp, pp, world_size=self.world_size)
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


class _CheckedLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, which first lets the strategy check the entry point's arguments
    (`MeshStrategy.check_before_launch`): an error then comes from this one process, before any rank starts."""

    def __init__(self, strategy: MeshStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._strategy.check_before_launch(args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


_PROGRESS_KEY = "lightning_hybrid/progress"


def _store() -> Optional[Any]:
    """The default process group's store (where the ranks met), or ``None`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()
