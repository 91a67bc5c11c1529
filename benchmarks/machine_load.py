"""CPU accounting shared by the benchmarks: how busy the whole machine was, and how much of that was ours,
so a measurement disturbed by other processes can be recognised."""

from __future__ import annotations

import os
import resource


def system_busy_s() -> float | None:
    """CPU-seconds spent busy by the whole machine since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
        steal = fields[7] if len(fields) > 7 else 0
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_s(*who: int) -> float:
    """CPU seconds (user + system) of ``resource.RUSAGE_SELF`` and/or ``RUSAGE_CHILDREN`` (finished, reaped)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))
