"""What a daemon tells the fleet about itself, and how it finds those facts out.

``DaemonMember`` is ``varunad.cluster.membership.Member`` plus what the leader needs to place workers:
the TCP port each slot's worker binds for tensor streams and the port of the torch.distributed
rendezvous (used when this member hosts rank 0), the two ports of its link probes (varunad.control.links:
a probe never touches a worker's port, so a probe that outlives its welcome cannot take the port
a job's worker is about to bind), whether the daemon is leaving (a preemption notice arrived;
plan without it), and the machine it runs on: daemons that report one ``machine`` (the kernel's
boot id: a local ring, network namespaces, containers) share its ``cores`` and memory bandwidth,
and each of their CPU workers runs ``threads`` torch threads (0: its slots are GPUs, which share
nothing). Older readers ignore the extra fields; a record without them is a machine of its own.

Ports are chosen free at start and held (bound, not listening) until a worker needs one, so
other processes on the VM cannot take them in the meantime.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.net.ports import bind_quiet_ports
from trainer.worker_env import available_cores
from varunad.cluster.membership import Member

__all__ = ["DaemonMember", "PortReservation", "detect_slots", "detect_device_kind", "detect_memory",
           "gpu_count", "gpu_models", "is_local_address", "machine_id", "parse_member", "version", "worker_threads"]

log = logging.getLogger(__name__)


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _v

        return _v("varunad")
    except (ImportError, PackageNotFoundError):  # running from a checkout
        return "0.1.0"


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonMember(Member):
    worker_ports: tuple[int, ...] = ()  # one per slot: tcp://host:port is that slot's stream endpoint
    rendezvous_port: int = 0  # torch.distributed store when this member hosts rank 0
    probe_ports: tuple[int, ...] = ()  # (stream, rendezvous) of link probes (varunad.control.links); () = not probed
    draining: bool = False  # leaving after a preemption notice: plan without it
    lease_ttl: float = 0.0  # the TTL it asked for, so `varunactl nodes` can show the lease's age
    machine: str = ""  # the kernel's boot id ("" = unknown: a machine of its own)
    cores: int = 0  # CPUs this daemon's workers may run on (0 = unknown)
    threads: int = 0  # torch threads per worker on CPU slots (0 = GPU slots, or unknown)
    # its spare workers (varunad.node.spares) are not ready: a daemon that has not yet started them
    # (until it sees a job run, with or without it) or whose spares are still importing torch. A
    # leader taking it into a running job waits for them (a bounded while): the morph then does
    # not wait for the import
    warming: bool = False

    def __post_init__(self) -> None:
        Member.__post_init__(self)  # zero-argument super() does not work in slotted dataclasses
        ports = tuple(self.worker_ports)
        object.__setattr__(self, "worker_ports", ports)
        if any(not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536 for p in ports):
            raise ValueError(f"member {self.name}: worker_ports must be TCP ports, got {ports!r}")
        if ports and len(ports) != self.slots:
            raise ValueError(f"member {self.name}: {len(ports)} worker ports for {self.slots} slots")
        if not isinstance(self.rendezvous_port, int) or not 0 <= self.rendezvous_port < 65536:
            raise ValueError(f"member {self.name}: rendezvous_port must be a TCP port")
        probe = tuple(self.probe_ports)
        object.__setattr__(self, "probe_ports", probe)
        if probe and (len(probe) != 2 or any(not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536
                                             for p in probe)):
            raise ValueError(f"member {self.name}: probe_ports must be two TCP ports, got {probe!r}")
        if set(probe) & ({*ports, self.rendezvous_port}):
            raise ValueError(f"member {self.name}: probe_ports {probe!r} overlap the worker ports")
        if not isinstance(self.draining, bool) or not isinstance(self.warming, bool):
            raise ValueError(f"member {self.name}: draining and warming must be true or false")
        if not isinstance(self.machine, str) or len(self.machine) > 128:
            raise ValueError(f"member {self.name}: machine must be a string of at most 128 characters")
        for name in ("cores", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1 << 16:
                raise ValueError(f"member {self.name}: {name} must be a count, got {value!r}")

    @property
    def machine_key(self) -> str:
        """What daemons on one machine have in common: its boot id, else (unknown) this member."""
        return self.machine or f"member:{self.name}"

    @property
    def usable_slots(self) -> int:
        """Slots the leader may use: none while leaving or when the ports are unknown."""
        if self.draining or len(self.worker_ports) != self.slots or not self.rendezvous_port:
            return 0
        return self.slots

    def stream_endpoint(self, slot: int) -> str:
        return f"tcp://{self.host}:{self.worker_ports[slot]}"

    def rendezvous_url(self) -> str:
        return f"tcp://{self.host}:{self.rendezvous_port}"


def parse_member(data: bytes) -> DaemonMember:
    """A ``members/<name>`` value; ValueError when it is not a member."""
    return DaemonMember.decode(data)


# --- detection ---------------------------------------------------------------------------------------

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def machine_id(path: str = _BOOT_ID) -> str:
    """The kernel's boot id: one per machine and boot, the same in every network namespace and
    container on it, so daemons that report the same one share its cores. "" where unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            value = f.read(128).strip()
    except (OSError, UnicodeError):
        return ""
    return value if re.fullmatch(r"[0-9A-Za-z._:-]{1,128}", value) else ""


def worker_threads(configured: int, slots: int) -> int:
    """torch threads per worker: ``configured``, else the cores shared out among the slots."""
    return configured or max(1, available_cores() // max(1, slots))


_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def gpu_count(environ: Mapping[str, str] | None = None, *, dev: str = "/dev") -> int:
    """NVIDIA GPUs this daemon's workers may use: the host's (their /dev nodes), or as many as
    CUDA_VISIBLE_DEVICES shows them (workers inherit it, so slot k is its k-th device)."""
    try:
        present = sum(1 for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        present = 0
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None or not present:
        return present
    shown = 0
    for entry in visible.split(","):   # CUDA stops at the first entry that is no device
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        shown += 1
    return min(shown, present)


def detect_slots(gpus: int | None = None) -> int:
    """One slot per GPU (`gpus`, default counted), else 1 on a CPU-only host."""
    return (gpu_count() if gpus is None else gpus) or 1


def gpu_models(root: str = _NVIDIA_GPUS) -> list[str]:
    """The model name of each GPU the NVIDIA driver lists ("NVIDIA A100-SXM4-80GB"), by bus id;
    read from /proc so the daemon need not import torch or run nvidia-smi."""
    models = []
    with contextlib.suppress(OSError):
        for bus in sorted(os.listdir(root)):
            with contextlib.suppress(OSError), open(os.path.join(root, bus, "information"), encoding="utf-8") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() == "Model" and value.strip():
                        models.append(value.strip())
                        break
    return models


def detect_device_kind(slots: int = 1, *, gpus: int | None = None, models: list[str] | None = None) -> str:
    """The calibration kind of this host's slots. Calibrations, plans and prices are per kind, so
    kinds must tell apart hosts whose slots run at different speeds: a GPU host is its GPU model
    (an A100 and a T4 fleet are planned apart), a CPU host is "cpu" or, when n workers share
    its cores, "cpu-<n>slots" (each is slower than a lone one; the profiler's name for it)."""
    gpus = gpu_count() if gpus is None else gpus
    if not gpus:
        return "cpu" if slots <= 1 else f"cpu-{slots}slots"
    names = sorted(set(gpu_models() if models is None else models))
    if len(names) != 1:
        if names:
            log.warning("this host mixes GPU models %s; its slots are calibrated as one kind, 'cuda' "
                        "(pass --device-kind to name it, or run one daemon per model)", names)
        return "cuda"
    # a key component cannot hold '/', and the kind names an etcd key
    return names[0].replace("/", "-")


def is_local_address(host: str) -> bool:
    """Whether `host` (a name or an address) is one of this host's interface addresses."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
        mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except (OSError, UnicodeError):
        return False
    return bool(wanted & mine)


def gpu_memory() -> int | None:
    """Bytes of the smallest GPU of the host, from nvidia-smi; None when it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        sizes = [int(float(line)) for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) * 2**20 if sizes else None


def detect_memory(slots: int, gpus: int = 0) -> int:
    """Bytes per slot: a GPU's memory on a GPU host, else the host's memory shared out."""
    if gpus:
        size = gpu_memory()
        if size:
            return size
        log.warning("cannot read the GPUs' memory (nvidia-smi); planning with host memory / slots: "
                    "pass --memory BYTES")
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or /proc unreadable: a conservative guess
        total = 8 * 2**30
    return max(1, total // max(1, slots))


# --- ports ---------------------------------------------------------------------------------------------

class PortReservation:
    """Hold TCP ports bound (not listening) so no other process takes them until released."""

    def __init__(self, host: str, ports: list[int] | None = None, count: int = 0) -> None:
        self.host = host
        self._held: dict[int, socket.socket] = {}
        if ports:
            for p in ports:
                self._held[p] = self._bind(p)
        # below the kernel's ephemeral range (trainer.net.ports): released to a worker, a port
        # bind(0) had handed out could meanwhile become some outgoing connection's source port
        for s in bind_quiet_ports(count, lambda port: self._bind(port, reuse=False)) if count else ():
            self._held[s.getsockname()[1]] = s
        if count and len(self._held) != count:
            self.close()
            raise OSError(f"reserved {len(self._held)} distinct TCP ports on {host}, not {count}")

    def _bind(self, port: int, *, reuse: bool = True) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # SO_REUSEADDR: a port a worker just left in TIME_WAIT can be held again at once. Not
        # when drawing new ports: with it, a port another daemon holds the same way binds too.
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self._bind_host(), port))
        except OSError as exc:
            s.close()
            raise OSError(f"cannot reserve TCP port {port} on {self.host}: {exc.strerror or exc}") from None
        return s

    def _bind_host(self) -> str:
        try:
            socket.inet_aton(self.host)
        except OSError:
            return "0.0.0.0"
        return self.host if self.host.startswith("127.") else "0.0.0.0"

    @property
    def ports(self) -> list[int]:
        return list(self._held)

    def release(self, port: int) -> None:
        s = self._held.get(port)
        if s is not None:
            s.close()
            self._held[port] = None  # type: ignore[assignment]

    def reacquire(self, port: int) -> bool:
        if self._held.get(port) is not None:
            return True
        try:
            self._held[port] = self._bind(port)
            return True
        except OSError as exc:
            log.warning("%s; it stays free until the next worker", exc)
            return False

    def close(self) -> None:
        for s in self._held.values():
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self._held.clear()
