"""Failure forensics: a collective that fails is reported in one ``error:`` line naming the collective, where it
was called, and the ranks that never came (it timed out) or that died (a peer's connection closed).

`Forensics` (one per strategy) records at set-up where this rank's process lives and, per training batch, how far
it got (one small write to the process group's store each); on an exception the strategy asks it to `report`. Store
reads are bounded (the store may have gone with rank 0), C++ warnings kept off stderr meanwhile. `CheckedLauncher`
is Lightning's subprocess launcher that checks the entry point's arguments before any rank starts and whose observer
(`_PatientObserver`) leaves this process time to report a rank that died before it stops them all.
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class Forensics:
    """What this rank knows to name the ranks behind a failed collective. ``timeout``: the process group's;
    ``launcher()``: the launcher that started the other ranks here, if any; ``wrappers``: files whose frames are
    wrappers of collectives (a report names the caller outside them)."""

    def __init__(self, timeout: Optional[timedelta], launcher: Callable[[], Any], wrappers: tuple[str, ...] = ()
                 ) -> None:
        self.timeout, self.launcher, self.wrappers = timeout, launcher, wrappers
        self.rank, self.world_size = 0, 1
        self.batch: Optional[int] = None
        self.processes: Optional[dict[int, dict[str, Any]]] = None
        # Set once this process reported a collective's failure (the launcher's observer then adds no line).
        self.reported = threading.Event()

    def start(self, rank: int, world_size: int) -> None:
        """Once the process group exists: this rank's process recorded (`record_process`)."""
        self.rank, self.world_size = rank, world_size
        self.record_process()
        self.reported.clear()

    def report(self, exception: BaseException) -> bool:
        """One line on stderr where ``exception`` is a collective that lost a peer or timed out; never raises.
        Returns whether it reported a lost peer (the error then reaches every surviving rank alike)."""
        with contextlib.suppress(Exception):  # a report only: never in the way of the error itself
            if self.report_dead_peer(exception):
                return True
            self.report_timeout(exception)
        return False

    def mark_progress(self, batch: int) -> None:
        """Record in the process group's store that this rank started training batch ``batch`` (one small store
        write per batch), so that a rank whose collective times out can name the ranks that never came. The first
        call also reads the ranks' processes (`record_process`), for a rank that loses a peer to name it even
        when the store has gone with rank 0."""
        store = _store()
        if store is not None:
            store.set(f"{_PROGRESS_KEY}/{self.rank}", str(batch))
            self.batch = batch
            if self.processes is None:
                keys = [f"{_PROCESS_KEY}/{rank}" for rank in range(self.world_size)]
                if store.check(keys):
                    self.processes = _read_processes(store, self.world_size)

    def record_process(self) -> None:
        """One store write at setup: this rank's host and process (`_this_process`), for `report_dead_peer`."""
        store = _store()
        if store is not None:
            self.processes = None
            store.set(f"{_PROCESS_KEY}/{self.rank}", json.dumps(_this_process()))

    def report_timeout(self, exception: BaseException) -> None:
        """If ``exception`` is a collective that timed out: one line on stderr naming the collective, where it was
        called, and the ranks that had not reached this rank's batch (from `mark_progress`)."""
        text = str(exception)
        if not (isinstance(exception, RuntimeError) and re.search(r"(?i)timed? ?out", text)):
            return
        collective, where = _collective_and_caller(exception, skip=self.wrappers)
        if collective is None:
            return
        behind = []
        mine = self.batch
        if mine is not None:
            batches = _bounded_store_read(lambda store: _read_batches(store, range(self.world_size)),
                                          seconds=10 * _STORE_SECONDS) or {}
            for rank in range(self.world_size):
                theirs = batches.get(rank, -1)
                if theirs < mine:
                    behind.append(f"rank {rank} (at batch {theirs})" if theirs >= 0 else f"rank {rank} (no batch)")
        who = ("; ranks that never reached this rank's batch " + f"{mine}: " + ", ".join(behind)) if behind else ""
        seconds = self.timeout.total_seconds() if self.timeout is not None else "?"
        os.write(2, f"error: rank {self.rank} waited {seconds:g} s in {collective}{where},"
                    f" and a rank never joined it{who}.\n".encode())
        self.reported.set()

    def report_dead_peer(self, exception: BaseException) -> bool:
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
        collective, where = _collective_and_caller(exception, anywhere=True, skip=self.wrappers)
        if collective is None:
            return False
        address = _PEER_ADDRESS.search(text)
        address_text = next((g for g in address.groups() if g), "") if address else ""
        quote = _clause(text, lost or _ABORTED.search(text))  # type: ignore[arg-type]
        if address_text in quote:  # gloo's "Connection closed by peer [127.0.0.1]:30408": said once
            address_text = ""
        head = (f"error: rank {self.rank} lost a peer in {collective}{where} (\"{quote}\")")

        me = _this_process()
        processes = self.processes
        store_answers = True
        if processes is None:  # failed before the first batch: read them now
            processes = _bounded_store_read(lambda store: _read_processes(store, self.world_size))
            store_answers = processes is not None
            processes = processes or {}
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        local = [r for r in others if r in processes and processes[r].get("ns") == me["ns"]]
        deadline = time.monotonic() + _SETTLE_SECONDS
        while True:  # a peer that closed its connections after its own error may still be exiting
            children = _children_status(self.launcher())
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
        self.reported.set()
        return True


class CheckedLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, which first lets the strategy check the entry point's arguments
    (``strategy.check_before_launch``): an error then comes from this one process, before any rank starts; and
    whose observer of the ranks it starts (`_PatientObserver`) lets this process report a rank that died."""

    def __init__(self, strategy: Any, *args: Any) -> None:
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
                         reported=self._strategy.forensics.reported).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _PatientObserver(_ChildProcessObserver):
    """Lightning's observer of the launched ranks (every 5 s: has one ended with an error?), which SIGKILLs them
    all, this process included, as soon as it sees one ended -- often before this process's own failed collective
    could report which rank died (`Forensics.report_dead_peer`). This one first gives this process
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


def _collective_and_caller(exception: BaseException, anywhere: bool = False,
                           skip: tuple[str, ...] = ()) -> tuple[Optional[str], str]:
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
    tests = (lambda f: not f.filename.startswith(_LIBRARY_DIRS) and f.filename not in skip,
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


def without_traceback(exception: BaseException) -> None:
    """If ``exception`` ends the process uncaught, print its message without its traceback (through the hook in
    place, e.g. torch's ``[rankN]:`` prefix); any other exception as before. The exit code is unchanged."""
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if value is exception:
            value, tb = value.with_traceback(None), None
        previous(kind, value, tb)

    sys.excepthook = hook
