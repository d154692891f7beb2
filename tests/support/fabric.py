"""A small network of "VMs" for tests: Linux network namespaces on a bridge, etcd on the bridge.

    host (root namespace)                 namespace vnet<K>-1 ... vnet<K>-N
    bridge vnet<K>br  10.77.K.1  <-veth->  eth0 10.77.K.11 ... 10.77.K.(10+N)
    etcd listens on 10.77.K.1

Each namespace is what a new user's VM looks like: its own address, a host name (vm1..vmN, set
in a private UTS namespace) that resolves to 127.0.0.1 through its /etc/hosts as on stock
Debian, and a resolver with no reachable name server (a DNS lookup waits for its timeout, as
in the issue: nothing on the daemon's path may ask). The files are bind-mounted by
``ip netns exec`` from /etc/netns/<ns>/: the host's own /etc/hosts is never touched.

Each daemon runs with default addressing (no --advertise, no --name). ``cap`` puts a ``tc tbf``
rate on a namespace's egress; ``cut``/``heal`` take its link down and up (no TCP reset: packets
vanish, as in a partition). Every name carries "net". ``close`` removes everything, also after
a failure; ``Fabric.available()`` says why the tests must skip (no root, no ``ip netns``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import REPO
from support.etcd_server import EtcdServer
from support.ring import DaemonProc

__all__ = ["Fabric", "NetnsDaemon", "unavailable_reason"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the `ip` (iproute2) and `unshare` (util-linux) commands are needed for network-namespace tests"
    if os.geteuid() != 0:
        return "network-namespace tests need root (`ip netns add`); CI runs them as root"
    probe = f"vnetprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsDaemon(DaemonProc):
    """A daemon of tests/support/ring.py's kind, running inside network namespace `ns`."""

    def __init__(self, index: int, ns: str, proc: subprocess.Popen, log: Path) -> None:
        super().__init__(f"vm{index}", proc, log)
        self.index = index
        self.ns = ns


class Fabric:
    def __init__(self, n: int, base: Path) -> None:
        self.n = n
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.k = self._free_subnet()
        self.tag = f"vnet{self.k}"
        self.bridge = f"{self.tag}br"
        self.host_addr = f"10.77.{self.k}.1"
        self.namespaces = [f"{self.tag}-{i}" for i in range(1, n + 1)]
        self.etcd: EtcdServer | None = None
        self.daemons: dict[str, NetnsDaemon] = {}
        self._incarnation: dict[str, int] = {}

    # -- the network ---------------------------------------------------------------------------

    @staticmethod
    def _free_subnet() -> int:
        taken = _ip("-4", "addr").stdout
        start = os.getpid() % 200 + 20
        for k in [*range(start, 240), *range(20, start)]:
            if f"10.77.{k}." not in taken and not Path(f"/var/run/netns/vnet{k}-1").exists():
                return k
        raise RuntimeError("no free 10.77.K.0/24 subnet for the test network")

    def address(self, i: int) -> str:
        """The address of VM i (1-based)."""
        return f"10.77.{self.k}.{10 + i}"

    def veth(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def up(self) -> None:
        self._made_etc = not Path("/etc/netns").exists()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces, 1):
                _ip("netns", "add", ns)
                inner = f"{self.tag}n{i}"
                _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", self.veth(i), "master", self.bridge)
                _ip("link", "set", self.veth(i), "up")
                self.exec(i, "ip", "link", "set", inner, "name", "eth0")
                self.exec(i, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self.exec(i, "ip", "link", "set", "eth0", "up")
                self.exec(i, "ip", "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                # stock Debian: the host name resolves to loopback
                (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.0.1\tvm{i}\n")
                # a name server on the subnet that nobody answers for: a DNS lookup hangs until timeout
                (etc / "resolv.conf").write_text(f"nameserver 10.77.{self.k}.250\noptions timeout:5 attempts:2\n")
            self.etcd = EtcdServer(host=self.host_addr, name=f"{self.tag}-etcd")
            self.etcd.start()
        except BaseException:
            self.close()
            raise

    def exec(self, i: int, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespaces[i - 1], *cmd], capture_output=True, text=True,
                              check=check)

    def cap(self, i: int, rate: str | None) -> None:
        """Limit VM i's egress to `rate` ("1gbit", "10mbit"; None: uncapped) with a token bucket."""
        self.exec(i, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate:
            bits = _rate_bits(rate)
            # burst: 10 ms at the rate, at least a few full frames, so short bursts keep the rate
            burst = max(32 * 1024, bits // 8 // 100)
            self.exec(i, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", str(burst),
                      "latency", "200ms")

    def cap_all(self, rate: str | None) -> None:
        for i in range(1, self.n + 1):
            self.cap(i, rate)

    def cut(self, i: int) -> None:
        """VM i's link goes down: its packets vanish, nobody gets a reset."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    # -- daemons ---------------------------------------------------------------------------------

    def start_daemon(self, i: int, *args: str) -> NetnsDaemon:
        """varunad in namespace i, host name vm<i>, default name and address (the route to etcd)."""
        assert self.etcd is not None
        name = f"vm{i}"
        n = self._incarnation.get(name, 0) + 1
        self._incarnation[name] = n
        log = self.base / f"{name}.{n}.log"
        daemon = [sys.executable, "-m", "varunad.node.daemon", "--etcd", self.etcd.endpoint,
                  "--state-dir", str(self.base / name), "--log-level", "INFO", *args]
        script = f"hostname {name} && exec " + " ".join(_quote(a) for a in daemon)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for k in ("VARUNAD_ADVERTISE", "VARUNAD_NAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(k, None)
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[i - 1], "unshare", "--uts", "sh", "-c",
                                     script], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(REPO), env=env)
        d = NetnsDaemon(i, self.namespaces[i - 1], proc, log)
        self.daemons[name] = d
        return d

    def tails(self, lines: int = 30) -> str:
        out = []
        for name, d in sorted(self.daemons.items()):
            text = d.log_text().splitlines()[-lines:]
            out.append(f"--- {name} ({'alive' if d.alive else 'exited'}) {d.log}\n" + "\n".join(text))
        return "\n".join(out)

    def stop_daemons(self, grace: float = 15.0) -> None:
        for d in self.daemons.values():
            if d.alive:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for d in self.daemons.values():
            try:
                d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.kill9()

    def close(self) -> None:
        """Remove everything this fabric made; safe to call twice and after a partial `up`."""
        try:
            self.stop_daemons()
        finally:
            if self.etcd is not None:
                self.etcd.close()
                self.etcd = None
            for ns in self.namespaces:
                # processes left in the namespace (a worker that outlived its daemon) keep it alive
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", ns, check=False)
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            for i in range(1, self.n + 1):
                _ip("link", "del", self.veth(i), check=False)
            _ip("link", "del", self.bridge, check=False)
            if getattr(self, "_made_etc", False):
                with contextlib.suppress(OSError):   # only if empty: another fabric may be using it
                    Path("/etc/netns").rmdir()


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    r = rate.lower()
    for u, f in units.items():
        if r.endswith(u):
            return int(float(r[: -len(u)]) * f)
    raise ValueError(f"rate {rate!r}: give it like 10mbit or 1gbit")


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
