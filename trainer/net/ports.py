"""Ports a worker will bind, chosen where nothing else is handed them.

A port the kernel hands out for bind(0) is an ephemeral one: until the worker binds it, any
outgoing connection on the machine (gloo's, etcd's, another job's) may take it as its source
port, and the worker fails with "Address already in use" (seen: a new epoch's worker on its
daemon's reserved port, after the old epoch's connections churned the range). Ports below that
range are never handed out to outgoing connections, so only another listener could take one
(torchrun has the same race). The local launcher's free ports and the daemon's reserved ones
are both drawn here.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

__all__ = ["LOWEST_PORT", "bind_quiet_ports", "ephemeral_low"]

LOWEST_PORT = 10000   # below this sit well-known services
_TRIES = 200


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; else the IANA default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def bind_quiet_ports(n: int, bind: Callable[[int], socket.socket]) -> list[socket.socket]:
    """n sockets from `bind(port)` (which raises OSError for a taken port) on distinct ports below
    the ephemeral range when it can, else the kernel's choice (`bind(0)`): a range crowded below,
    or none known. The caller closes them. `bind` must not set SO_REUSEADDR: two sockets that
    both set it may bind one port while neither listens, so another process's reservation would
    not exclude this one (seen: a daemon's reserved ports coming back with one missing)."""
    socks: list[socket.socket] = []
    chosen: set[int] = set()
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(_TRIES if low > LOWEST_PORT + 8 * n else 0):
        if len(socks) == n:
            break
        port = rng.randrange(LOWEST_PORT, low)
        if port in chosen:
            continue
        try:
            socks.append(bind(port))
        except OSError:
            continue
        chosen.add(port)
    while len(socks) < n:
        socks.append(bind(0))
    return socks
