"""Bind a worker's collective transports to the address its daemon advertises.

Left to itself, gloo picks its address from the host name: ``gethostname()`` then
``getaddrinfo`` of it. On a stock Debian VM that name resolves to 127.0.0.1 through
/etc/hosts, so every worker listens on loopback and peers on other VMs are refused; on a host
whose name is not in /etc/hosts the lookup goes to DNS (10 s per try without a reachable
server). Both are wrong for a fleet: the daemon knows the one address its peers reach it at
(``--advertise``) and hands it to each worker as ``VARUNA_BIND_ADDRESS``.

gloo: a device created for that *address* (``ProcessGroupGloo.create_device(hostname=ADDR)``),
not for its interface (``GLOO_SOCKET_IFNAME``, ``create_device(interface=...)``). The address is
what peers dial; an interface can carry several addresses (a secondary private address, IPv4
and IPv6) and gloo would take the first; a numeric address needs no name lookup. torch's
``init_process_group`` ignores gloo options, so the device reaches every group (the default
one and each ``new_group``) through a backend registered under its own name whose factory
builds ``ProcessGroupGloo`` with it.

NCCL has no per-group address option: its bootstrap and sockets follow ``NCCL_SOCKET_IFNAME``,
so a CUDA worker gets the interface holding the address (``=eth0``: exactly that one, not
every name starting with it).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from datetime import timedelta

__all__ = ["BOUND_GLOO", "bound_gloo_backend", "interface_of", "is_numeric", "nccl_environment", "numeric_address"]

log = logging.getLogger(__name__)

BOUND_GLOO = "boundgloo"
_bound: dict[str, str] = {}   # backend name -> the address its devices bind


def is_numeric(host: str) -> bool:
    """Whether `host` is an IP address literal (resolving it asks no name server)."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%")[0])
        return True
    except ValueError:
        return False


def numeric_address(host: str) -> str:
    """`host` as an IP address: itself when it is one (no lookup), else resolved once (a name
    was given, so asking the resolver is what the user chose)."""
    import socket

    if is_numeric(host):
        return host.strip("[]")
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds `address`, or None."""
    import psutil

    wanted = address.strip("[]").split("%")[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == wanted for a in addrs):
            return name
    return None


def bound_gloo_backend(address: str) -> str:
    """The name of a torch.distributed backend: gloo with its device bound to `address`.

    torch keeps one global registry, so the backend is registered once per process; its
    factory reads the address when each group is created, and a later call (a forked helper
    that measures another link) moves the groups created after it."""
    import torch.distributed as dist

    if not is_numeric(address):
        raise ValueError(f"VARUNA_BIND_ADDRESS must be an IP address, not {address!r} "
                         "(a name would cost a DNS lookup in every worker; the daemon passes its --advertise address)")
    first = not _bound
    _bound[BOUND_GLOO] = address.strip("[]")
    if first:
        def create(store, rank: int, size: int, timeout: timedelta):
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_bound[BOUND_GLOO])]
            return dist.ProcessGroupGloo(store, rank, size, opts)

        # CUDA too: ranks that share one GPU reduce its tensors over gloo (WorkerAssignment.gpu_collectives)
        dist.Backend.register_backend(BOUND_GLOO, create, devices=["cpu", "cuda"])
    return BOUND_GLOO


def nccl_environment(address: str) -> dict[str, str]:
    """NCCL's socket settings for a worker bound to `address` (empty when no interface holds it)."""
    iface = interface_of(address)
    if iface is None:
        log.warning("no interface of this host holds %s; NCCL picks its own", address)
        return {}
    env = {"NCCL_SOCKET_IFNAME": f"={iface}"}
    if ":" in address:
        env["NCCL_SOCKET_FAMILY"] = "AF_INET6"
    user = os.environ.get("NCCL_SOCKET_IFNAME")
    if user and user != env["NCCL_SOCKET_IFNAME"]:
        log.warning("NCCL_SOCKET_IFNAME=%s replaced by %s, the interface of the advertised address %s",
                    user, env["NCCL_SOCKET_IFNAME"], address)
    return env
