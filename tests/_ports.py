"""Free TCP ports on 127.0.0.1 for the servers tests start (gloo stores, SeaweedFS).

A port from ``bind(0)`` lies in the kernel's ephemeral range, the range every outgoing
connection also draws from: between the check and the server's own bind (seconds later, once a
child process has imported torch) any ``connect()`` on the machine may take it. Ports below that
range are never handed out implicitly, so these are picked there, at random, checked free.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports", "is_free"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def is_free(port: int) -> bool:
    """Whether a listening socket can bind ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, offset: int = 0) -> list[int]:
    """``n`` distinct ports ``p`` with ``p`` and ``p + offset`` free (SeaweedFS listens on both
    a service's port and that port + 10000), all below the ephemeral range when it leaves room
    (from 10000 up), else anywhere in [10000, 65536)."""
    low = 10000
    high = _ephemeral_low() - offset
    if high - low < 1000:
        high = 65536 - offset
    rng = random.Random()
    out: list[int] = []
    taken: set[int] = set()
    while len(out) < n:
        p = rng.randrange(low, high)
        pair = {p, p + offset}
        if pair & taken or not all(is_free(q) for q in pair):
            continue
        out.append(p)
        taken |= pair
    return out


def free_port() -> int:
    """One free port (see :func:`free_ports`)."""
    return free_ports(1)[0]
