"""A finished run exits with its own exit code: no ``terminate called without an active exception`` (SIGABRT, 134)
while the interpreter shuts down.

**The cause.** A gloo process group runs every collective in one of its worker threads (``pt_gloo_runloop``),
which marks the work complete -- the caller's ``wait()`` returns -- and only then drops its own reference to the
work and the tensors it holds. A tensor whose Python object the caller has dropped meanwhile (``flag`` of
``dist.all_reduce(flag); return int(flag)``) is kept alive by that reference, and freeing it needs the GIL. If the
worker is descheduled for long enough (a loaded machine) the main thread finishes the script and the interpreter
starts finalising first; the worker's request for the GIL then makes CPython end the thread with
``pthread_exit``, whose forced unwinding meets torch's ``noexcept`` destructors (``~AsyncWork``): ``std::terminate``.
Core files show exactly that stack: ``runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject ->
THPVariable_dealloc -> PyEval_RestoreThread -> take_gil -> PyThread_exit_thread -> pthread_exit -> terminate``.

Destroying the process groups does not end those threads: gloo's ``shutdown()`` does nothing, and a group's
workers are joined only when its last reference goes, which the model's layers (TP layers, metrics) hold until the
interpreter itself clears them. So at exit, while the interpreter still runs, `register_clean_exit`'s handler
destroys the process groups (NCCL's ``shutdown`` joins its threads) and then waits, with the GIL released, until
every gloo worker thread is idle: blocked, and not on the interpreter's own lock (`_gloo_workers_settled`).
Nothing is skipped: the user's exit handlers, buffered output and files are handled by the interpreter as usual.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import time
from typing import Optional

import torch.distributed as dist

__all__ = ["register_clean_exit"]

#: The name torch gives gloo's worker threads.
GLOO_WORKER = "pt_gloo_runloop"
#: How long exit waits at most for gloo's workers (they are idle within milliseconds unless descheduled).
SETTLE_SECONDS = 10.0
_POLL_SECONDS = 0.005
#: The ``futex`` system call's number (``/proc/<pid>/task/<tid>/syscall``), where known; its operation's command
#: bits, and the command glibc's condition variables wait with (a mutex waits with ``FUTEX_WAIT``, 0).
_FUTEX = {"x86_64": "202", "aarch64": "98", "arm64": "98", "riscv64": "98"}.get(platform.machine())
_FUTEX_CMD, _FUTEX_WAIT_BITSET = 0x7F, 9

_registered = False


def register_clean_exit() -> None:
    """At interpreter exit (``atexit``, before finalisation): destroy the default process group if the script left
    it, then wait until gloo's worker threads are idle (the module doc). Registered once per process; a strategy's
    teardown cannot do it, as a later ``trainer.validate`` reuses the group."""
    global _registered
    if _registered:
        return
    atexit.register(_exit_cleanly, _interpreter_data())
    _registered = True


def _exit_cleanly(interpreter: Optional[tuple[int, int]]) -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway: nothing to report to
            pass
    wait_for_gloo_workers(interpreter)


def wait_for_gloo_workers(interpreter: Optional[tuple[int, int]], seconds: float = SETTLE_SECONDS) -> bool:
    """Sleep (the GIL released) until every gloo worker thread of this process has been idle at two polls in a
    row, at most ``seconds``; returns whether they settled. Without ``/proc`` (not Linux) there is nothing to
    watch: ``True`` at once."""
    deadline = time.monotonic() + seconds
    calm = 0
    while True:
        settled = _gloo_workers_settled(interpreter)
        if settled is None:
            return True
        calm = calm + 1 if settled else 0
        if calm >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)


def _gloo_workers_settled(interpreter: Optional[tuple[int, int]]) -> Optional[bool]:
    """Whether each gloo worker thread waits as an idle one does: on its process group's condition variable, with
    no time limit (``workProduceCV_.wait``: ``futex`` ``FUTEX_WAIT_BITSET``, no timeout, in ``/proc``'s view). A
    worker that runs, waits for the GIL to free a tensor (a timed wait on a lock inside ``_PyRuntime``), for a
    mutex (its work queue's, OpenMP's) or for data is not idle. ``None`` where ``/proc`` cannot tell (not Linux, or
    an unknown architecture)."""
    if _FUTEX is None:
        return None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()
        except OSError:  # the thread ended
            continue
        if len(call) < 5 or call[0] != _FUTEX:
            return False  # running ("running"), faulting ("-1"), or in another system call
        address, op, timeout = int(call[1], 16), int(call[2], 16), int(call[4], 16)
        if (op & _FUTEX_CMD) != _FUTEX_WAIT_BITSET or timeout:
            return False
        if interpreter is not None and interpreter[0] <= address < interpreter[1]:
            return False  # the GIL's
    return True


def _interpreter_data() -> Optional[tuple[int, int]]:
    """The address range of the memory mapping that holds CPython's ``_PyRuntime`` (and with it the GIL), from
    ``/proc/self/maps``; ``None`` where it cannot be found."""
    try:
        address = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return lo, hi
    except (OSError, ValueError, AttributeError):
        pass
    return None
