"""`MeshStrategy`: a Lightning `ParallelStrategy` on a ``(pp, dp, tp)`` device mesh -- the processes, the mesh and
what Lightning's own collectives mean on it. It knows nothing of the model; `HybridStrategy` builds on it.

* ``setup_environment``: `ParallelDims.resolve` validates the sizes against the world size (before any process
  group exists, so every rank raises the same error), then the process group (backend from Lightning's
  accelerator: gloo on CPU, nccl on CUDA) and the mesh;
* only DP ranks see different samples (the sampler's arguments), and Lightning's collectives -- ``self.log(...,
  sync_dist=True)``, torchmetrics, ``all_gather`` -- run over the DP group: TP and PP ranks hold copies;
* a failing rank 0 stops the ranks it started (Lightning leaves them waiting until the timeout);
* a collective that fails -- it timed out, or a peer's connection closed because that rank died -- is reported in
  one ``error:`` line naming the collective, where it was called, and the ranks that never came or that died.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_hybrid.clean_exit import register_clean_exit
from lightning_hybrid.mesh import ParallelDims, barrier
from lightning_hybrid.ports import free_main_port
from lightning_hybrid.rank_zero import library_warnings_from_rank_zero

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshStrategy(ParallelStrategy):
    """The processes and the ``(pp, dp * cp, tp)`` mesh of ``sizes`` ``(dp, tp, pp, cp)`` (``dp=-1``: inferred from
    the world size; `lightning_hybrid.mesh.ParallelDims`).
    ``process_group_backend`` overrides the one chosen from the accelerator; ``timeout``: the process group's."""

    def __init__(
        self, sizes: tuple[int, int, int, int], process_group_backend: Optional[str], timeout: Optional[timedelta],
        **lightning: Any,
    ) -> None:
        super().__init__(**lightning)
        self._sizes = sizes  # (dp, tp, pp, cp) as requested
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._dims: Optional[ParallelDims] = None
        self._device_mesh: Optional["DeviceMesh"] = None
        # Set once this process reported a collective's failure (the launcher's observer then adds no line).
        self._reported = threading.Event()
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
        """This rank's place among the ranks with other samples (the ``dp * cp`` ranks of the mesh's ``"dp"``
        dimension hold ``dp`` samples' shares: a CP group shares its samples)."""
        return self.device_mesh["dp"].get_local_rank() // self.parallel_dims.cp

    @property
    def dp_size(self) -> int:
        """How many ranks see other samples: the data-parallel size (``dp``; not ``dp * cp``, the gradient ranks).
        A loader that splits its data itself splits it by `dp_rank` and `dp_size` (docs/data.md)."""
        return self.parallel_dims.dp

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
        write per batch), so that a rank whose collective times out can name the ranks that never came. The first
        call also reads the ranks' processes (`_record_process`), for a rank that loses a peer to name it even
        when the store has gone with rank 0."""
        store = _store()
        if store is not None:
            store.set(f"{_PROGRESS_KEY}/{self.global_rank}", str(batch))
            self._batch = batch
            if getattr(self, "_processes", None) is None:
                keys = [f"{_PROCESS_KEY}/{rank}" for rank in range(self.world_size)]
                if store.check(keys):
                    self._processes = _read_processes(store, self.world_size)

    def _record_process(self) -> None:
        """One store write at setup: this rank's host and process (`_this_process`), for `_report_dead_peer`."""
        store = _store()
        if store is not None:
            self._processes = None
            store.set(f"{_PROCESS_KEY}/{self.global_rank}", json.dumps(_this_process()))

    def _report_timeout(self, exception: BaseException) -> None:
        """If ``exception`` is a collective that timed out: one line on stderr naming the collective, where it was
        called, and the ranks that had not reached this rank's batch (from `mark_progress`)."""
        text = str(exception)
        if not (isinstance(exception, RuntimeError) and re.search(r"(?i)timed? ?out", text)):
            return
        collective, where = _collective_and_caller(exception)
        if collective is None:
            return
        behind = []
        mine = getattr(self, "_batch", None)
        if mine is not None:
            batches = _bounded_store_read(lambda store: _read_batches(store, range(self.world_size)),
                                          seconds=10 * _STORE_SECONDS) or {}
            for rank in range(self.world_size):
                theirs = batches.get(rank, -1)
                if theirs < mine:
                    behind.append(f"rank {rank} (at batch {theirs})" if theirs >= 0 else f"rank {rank} (no batch)")
        who = ("; ranks that never reached this rank's batch " + f"{mine}: " + ", ".join(behind)) if behind else ""
        seconds = self._timeout.total_seconds() if self._timeout is not None else "?"
        os.write(2, f"error: rank {self.global_rank} waited {seconds:g} s in {collective}{where},"
                    f" and a rank never joined it{who}.\n".encode())
        self._reported.set()

    def _report_dead_peer(self, exception: BaseException) -> bool:
        """If ``exception`` is a collective that failed because a peer's connection closed (gloo: "Connection
        closed/reset by peer"; NCCL: "remote process exited", a communicator aborted): one line on stderr naming
        the collective, where it was called, and the ranks that died. A peer on this host (and in this PID
        namespace) is dead if its process (recorded at setup) is gone or a zombie, with its exit status when this
        rank launched it; a peer on another host cannot be checked from here: the line says so, with the address
        the backend lost. Store reads are bounded (`_bounded_store_read`): the store may have gone with rank 0.
        Returns whether it reported."""
        text = str(exception)
        if not isinstance(exception, RuntimeError):
            return False
        lost = _PEER_LOST.search(text)
        if lost is None and not (_ABORTED.search(text) and not re.search(r"(?i)timed? ?out", text)):
            return False
        collective, where = _collective_and_caller(exception, anywhere=True)
        if collective is None:
            return False
        address = _PEER_ADDRESS.search(text)
        address_text = next((g for g in address.groups() if g), "") if address else ""
        quote = _clause(text, lost or _ABORTED.search(text))  # type: ignore[arg-type]
        if address_text in quote:  # gloo's "Connection closed by peer [127.0.0.1]:30408": said once
            address_text = ""
        head = (f"error: rank {self.global_rank} lost a peer in {collective}{where} (\"{quote}\")")

        me = _this_process()
        processes = getattr(self, "_processes", None)
        store_answers = True
        if processes is None:  # failed before the first batch: read them now
            processes = _bounded_store_read(lambda store: _read_processes(store, self.world_size))
            store_answers = processes is not None
            processes = processes or {}
        others = [rank for rank in range(self.world_size) if rank != self.global_rank]
        local = [r for r in others if r in processes and processes[r].get("ns") == me["ns"]]
        deadline = time.monotonic() + _SETTLE_SECONDS
        while True:  # a peer that closed its connections after its own error may still be exiting
            children = _children_status(self._launcher)
            dead = {r: why for r in local if (why := _process_gone(processes[r], children)) is not None}
            if dead or not local or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        remote = [r for r in others if r not in local]
        batches = None
        if store_answers and (dead or 0 in remote):  # the dead ranks' batches; and is rank 0's store there?
            batches = _bounded_store_read(lambda store: _read_batches(store, sorted(dead) or [0]))
            store_answers = batches is not None
        batches = batches or {}
        store_host_gone = not store_answers and 0 in remote and _store_lives_in_rank_zero()

        parts = []
        for rank, why in sorted(dead.items()):
            facts = [f"pid {processes[rank]['pid']} on this host", why]
            if rank in batches:
                facts.append(f"at batch {batches[rank]}")
            store_host = rank == 0 and not store_answers and _store_lives_in_rank_zero()
            parts.append(f"rank {rank}{' (the store host)' if store_host else ''} died ({', '.join(facts)})")
        if store_host_gone:
            parts.append("rank 0 (the store host) is gone: the store does not answer")
        unknown = [r for r in remote if not (store_host_gone and r == 0)]
        if unknown:
            hosts = sorted({processes[r]["host"] for r in unknown if r in processes})
            on = f" on {', '.join(hosts)}" if 0 < len(hosts) <= 3 else f" on {len(hosts)} other hosts" if hosts else ""
            lost_at = f"; the peer {_backend_name(text)} lost is {address_text}" if address_text else ""
            if not dead and not store_host_gone:
                parts.append(("no rank on this host died; " if local else "")
                             + f"{_ranks(unknown)}{on} cannot be checked from here{lost_at}")
            else:
                parts.append(f"{_ranks(unknown)}{on} cannot be checked from here")
        elif not dead and not store_host_gone:
            parts.append(f"no rank has died yet (within {_SETTLE_SECONDS:g} s): a rank that closed its connections"
                         " after an error of its own says why in its output")
        os.write(2, (head + ": " + "; ".join(parts) + ".\n").encode())
        self._reported.set()
        return True

    def on_exception(self, exception: BaseException) -> None:
        """On the process that started the other ranks (Lightning's launcher): stop them. Lightning leaves them
        running on an error, and they would wait for this rank -- in the rendezvous, or in a collective -- until
        the process group's timeout. A collective that failed is named first: one that timed out with the ranks
        that never came, one that lost a peer with the ranks that died. Such a failure reaches every surviving
        rank alike; the ranks other than 0 print its message without the traceback (the line above says where)."""
        reported = False
        with contextlib.suppress(Exception):  # a report only: never in the way of the error itself
            reported = self._report_dead_peer(exception)
            if not reported:
                self._report_timeout(exception)
        if reported and self.global_rank != 0:
            with contextlib.suppress(Exception):
                _without_traceback(exception)
        super().on_exception(exception)
        launcher = self._launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows has no SIGKILL

    def setup_environment(self) -> None:
        self._set_world_ranks()
        self._run_scope.enter_context(library_warnings_from_rank_zero(self.global_rank))
        # Validate before the process group exists: every rank raises the same error, none hangs.
        dp, tp, pp, cp = self._sizes
        self._dims = ParallelDims.resolve(dp, tp, pp, world_size=self.world_size, cp=cp)
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
        self._record_process()
        self._reported.clear()
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
    (`MeshStrategy.check_before_launch`): an error then comes from this one process, before any rank starts; and
    whose observer of the ranks it starts (`_PatientObserver`) lets this process report a rank that died."""

    def __init__(self, strategy: MeshStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._strategy.check_before_launch(args)
        if self.cluster_environment.creates_processes_externally:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        # Lightning's launch, with `_PatientObserver` for Lightning's observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._call_children_scripts()
        first = self.cluster_environment.node_rank() * self.num_processes + 1
        _PatientObserver(child_processes=self.procs, main_pid=os.getpid(), first_rank=first,
                         reported=self._strategy._reported).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _PatientObserver(_ChildProcessObserver):
    """Lightning's observer of the launched ranks (every 5 s: has one ended with an error?), which SIGKILLs them
    all, this process included, as soon as it sees one ended -- often before this process's own failed collective
    could report which rank died (`MeshStrategy._report_dead_peer`). This one first gives this process
    `_OBSERVER_GRACE_SECONDS` to end by itself (its error path reports and stops the others); if it has not, as
    when it waits in a collective that never fails, it names the ranks that ended and stops all as Lightning does."""

    def __init__(self, *, first_rank: int, reported: threading.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._first_rank, self._reported = first_rank, reported

    def _terminate_all(self) -> None:
        time.sleep(_OBSERVER_GRACE_SECONDS)
        if not self._reported.is_set():
            ended = [f"rank {self._first_rank + i} (pid {proc.pid}, {_exit_status(proc.returncode)})"
                     for i, proc in enumerate(self._child_processes) if proc.returncode]
            with contextlib.suppress(Exception):
                os.write(2, f"error: {', '.join(ended)} ended; stopping the other ranks and this one"
                            f" (rank {self._first_rank - 1}).\n".encode())
        super()._terminate_all()


_PROGRESS_KEY = "lightning_hybrid/progress"
_PROCESS_KEY = "lightning_hybrid/process"
#: How long a report waits on the store (which may have gone with rank 0, or hang with it), and for a peer
#: that closed its connections to exit.
_STORE_SECONDS = 2.0
_SETTLE_SECONDS = 2.0
#: How long the launcher's observer leaves this process to end by itself after a rank it launched ended.
_OBSERVER_GRACE_SECONDS = 5.0
#: A collective that lost a peer: gloo ("Connection closed by peer [addr]:port", "Read error [addr]:port:
#: Connection reset by peer", "Write error ...: Broken pipe"), NCCL ("remote process exited or there was a network
#: error" = ncclRemoteError, "unexpected exit of a remote peer" in ncclSystemError's text).
_PEER_LOST = re.compile(r"(?i)connection (?:closed|reset) by (?:remote )?peer|broken pipe|remote process exit\w*"
                        r"|ncclRemoteError|unexpected exit of a remote peer")
#: NCCL's watchdog aborted the communicator (not for a timeout: that is `_report_timeout`'s).
_ABORTED = re.compile(r"(?i)NCCL communicator was aborted")
#: Where torch and Lightning live: a collective's caller is named outside them.
_LIBRARY_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep
    for module in (torch, sys.modules.get("lightning"), sys.modules.get("lightning_fabric"),
                   sys.modules.get("pytorch_lightning"))
    if module is not None and getattr(module, "__file__", None)
)
#: The peer's address as the backend writes it: gloo ``[127.0.0.1]:30408``, NCCL ``10.0.0.2<33759>``.
_PEER_ADDRESS = re.compile(r"(\[[0-9A-Za-z.:%-]+\]:\d+)|([0-9A-Za-z.:%-]+<\d+>)")


def _store() -> Optional[Any]:
    """The default process group's store (where the ranks met), or ``None`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _collective_and_caller(exception: BaseException, anywhere: bool = False) -> tuple[Optional[str], str]:
    """From ``exception``'s traceback: the collective (``torch.distributed.<name>``; a ``Work.wait()`` outside
    torch.distributed: "a collective's wait()") and where it was called (`` called from file:line (function)``:
    the innermost frame outside torch, Lightning and this module's wrappers of their collectives, else outside
    torch and Lightning, else outside torch.distributed). No collective when the traceback never entered
    torch.distributed, unless ``anywhere`` (an error only a collective raises, e.g. from a C++ hook): then "a
    collective"."""
    frames = traceback.extract_tb(exception.__traceback__)
    inside = [i for i, f in enumerate(frames) if f.filename.endswith("distributed_c10d.py")]
    if inside:
        collective: Optional[str] = f"torch.distributed.{frames[inside[-1]].name}"
        outside = frames[: inside[0]]
    elif frames and re.search(r"\bwait\(\)", frames[-1].line or ""):
        collective, outside = "a collective's wait()", frames
    elif anywhere:
        collective, outside = "a collective", frames
    else:
        return None, ""
    tests = (lambda f: not f.filename.startswith(_LIBRARY_DIRS) and f.filename != __file__,
             lambda f: not f.filename.startswith(_LIBRARY_DIRS), lambda f: "torch/distributed" not in f.filename)
    caller = next((f for test in tests for f in reversed(outside) if test(f)), None)
    return collective, (f" called from {caller.filename}:{caller.lineno} ({caller.name})" if caller else "")


def _this_process() -> dict[str, Any]:
    """This process as a peer can check it: host name, pid, start time (``/proc``: a reused pid is another
    process), and ``ns``, which is equal for two processes that see each other's pids (same host and boot, same
    PID namespace)."""
    record: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    boot = namespace = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    record["ns"] = f"{record['host']}|{boot}|{namespace}"
    return record


def _parse_process(value: bytes) -> dict[str, Any]:
    return json.loads(value.decode() if isinstance(value, bytes) else value)


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), ``None`` off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def _process_gone(record: dict[str, Any], children: dict[int, int]) -> Optional[str]:
    """``None`` while the process of ``record`` (on this host) runs; otherwise how it ended, as far as known."""
    pid = int(record["pid"])
    if pid in children:  # launched by this process: its exit status
        return _exit_status(children[pid])
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:  # no /proc: ask the kernel (a zombie still counts as running there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return "exited"
    if record.get("start") is not None and fields[19] != record["start"]:
        return "gone (its pid is another process's now)"
    return None


def _exit_status(code: int) -> str:
    """A ``Popen.returncode`` in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def _children_status(launcher: Any) -> dict[int, int]:
    """The exit codes of the ranks this process launched (Lightning's launcher) that have ended, by pid."""
    codes = {}
    for proc in getattr(launcher, "procs", None) or []:
        with contextlib.suppress(Exception):
            if proc.poll() is not None:
                codes[proc.pid] = proc.returncode
    return codes


def _read_processes(store: Any, world_size: int) -> dict[int, dict[str, Any]]:
    keys = [f"{_PROCESS_KEY}/{rank}" for rank in range(world_size)]
    if store.check(keys):  # all there: one read
        return dict(enumerate(_parse_process(value) for value in store.multi_get(keys)))
    processes = {}
    for rank in range(world_size):
        key = f"{_PROCESS_KEY}/{rank}"
        if store.check([key]):
            processes[rank] = _parse_process(store.get(key))
    return processes


def _read_batches(store: Any, ranks: Any) -> dict[int, int]:
    batches = {}
    for rank in ranks:
        key = f"{_PROGRESS_KEY}/{rank}"
        if store.check([key]):
            batches[rank] = int(store.get(key))
    return batches


def _bounded_store_read(read: Any, seconds: float = _STORE_SECONDS) -> Optional[Any]:
    """``read(store)`` on the default store, or ``None`` if it raised or took over ``seconds``. The store's
    own timeout does not bound a read from a server that stopped answering (a TCPStore client waits on), so the
    read runs in a daemon thread; the warnings TCPStore prints on a dead server (C++ stack traces) are kept off
    stderr meanwhile."""
    store = _store()
    if store is None:
        return None
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = read(store)
        except Exception:  # noqa: BLE001 - a report only
            pass

    thread = threading.Thread(target=run, name="lightning_hybrid-store-read", daemon=True)
    with _stderr_silenced():
        thread.start()
        thread.join(seconds)
    return result.get("value")


@contextlib.contextmanager
def _stderr_silenced() -> Any:
    """File descriptor 2 goes to /dev/null within the block (C++ writes there directly)."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _store_lives_in_rank_zero() -> bool:
    """Whether the store is a TCPStore server in rank 0's process (env:// rendezvous, as Lightning's launcher and
    SLURM run it) rather than in torchrun's agent."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _clause(text: str, match: re.Match) -> str:
    """The clause of the backend's message around ``match``: after gloo's ``[file:line] `` and up to the next
    sentence, comma or line (``Read error [127.0.0.1]:414: Connection reset by peer``)."""
    start, end = match.span()
    left = max((i + len(mark) for mark in ("] ", "\n", ", ") if (i := text.rfind(mark, 0, start)) >= 0), default=0)
    rights = [i for i in (text.find(". ", end), text.find(".\n", end), text.find("\n", end), text.find(", ", end))
              if i >= 0]
    return text[left:min(rights, default=len(text))].strip().rstrip(".")


def _backend_name(text: str) -> str:
    return "NCCL" if "nccl" in text.lower() else "gloo" if "gloo" in text.lower() else "the backend"


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 4-7``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _without_traceback(exception: BaseException) -> None:
    """If ``exception`` ends the process uncaught, print its message without its traceback (through the hook in
    place, e.g. torch's ``[rankN]:`` prefix); any other exception as before. The exit code is unchanged."""
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if value is exception:
            value, tb = value.with_traceback(None), None
        previous(kind, value, tb)

    sys.excepthook = hook
