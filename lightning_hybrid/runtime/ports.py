"""The port of rank 0's store when Lightning's launcher starts the ranks (`free_main_port`)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_main_port"]


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes local ports of outgoing connections from (Linux's, else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_main_port(tries: int = 64) -> int:
    """A free TCP port for rank 0's store, below the ephemeral range. Lightning's choice (a port the OS hands out
    on a bind to port 0) lies inside that range and stays unbound until rank 0 creates its store, after the other
    ranks have started: any connection opened meanwhile on the machine can take it as its local port, and then
    rank 0 fails to bind while the ranks it started wait for it. A port outside the range is taken only by a
    program that binds it on purpose. Falls back to the OS's choice when none of ``tries`` random ports is free."""
    low, _ = _ephemeral_ports()
    candidates = range(max(1024, low - 12000), max(1025, low))
    for port in random.Random().sample(candidates, min(tries, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
