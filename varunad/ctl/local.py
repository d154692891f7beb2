"""A local ring: a private etcd and N varunad daemons on loopback, for a first run on one machine.

``up`` starts them detached (each in its own session, so that a Ctrl-C in the terminal that
started them does not reach them, and so that a whole daemon, workers included, can be killed as
one process group) and records what it started in ``STATE_DIR/ring.json``. ``down`` reads that
file and stops everything, whichever process started it. Any ``varunactl`` command then finds the
ring's etcd without ``--etcd`` (``default_etcd``).

The default state directory is ``$VARUNAD_LOCAL_DIR``, else ``$XDG_STATE_HOME/varunad/ring``
(``~/.local/state/varunad/ring``): not a path relative to the working directory, because
``varunactl down`` or ``status`` typed in another directory must find the same ring.

Processes are recorded with their start time: a pid the kernel has since given to an unrelated
process is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from trainer.launch import free_ports
from varunad.ctl.commands import CtlError

__all__ = ["LocalRingError", "RingProc", "Ring", "RING_FILE", "default_dir", "default_etcd", "find_etcd_binary",
           "read_ring", "free_port_range", "up", "down", "add_daemon", "kill_daemon", "alive"]

RING_FILE = "ring.json"
INSTALL_HINT = ("install it with `apt-get install -y etcd-server` (Debian/Ubuntu), `brew install etcd` (macOS), "
                "or a release binary from https://github.com/etcd-io/etcd/releases on PATH")
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent.parent


class LocalRingError(CtlError):
    """The local ring cannot be started or stopped; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class RingProc:
    """One process of the ring, as recorded in ring.json."""

    name: str
    pid: int
    create_time: float  # psutil's, to tell our process from a later one with the same pid
    log: str
    metrics_port: int | None = None


@dataclass(frozen=True, slots=True)
class Ring:
    """What ``up`` started: read back from ring.json by ``down`` and the other commands."""

    dir: str
    etcd: str
    root: str
    store: str
    ttl: float
    etcd_proc: RingProc
    daemons: tuple[RingProc, ...] = ()
    daemon_args: tuple[str, ...] = ()
    metrics_base: int = 0
    started_at: float = field(default_factory=time.time)

    def daemon(self, name: str) -> RingProc:
        for d in self.daemons:
            if d.name == name:
                return d
        raise LocalRingError(f"the ring has no daemon {name} (it has {', '.join(d.name for d in self.daemons)})")


# --- where things are ---------------------------------------------------------------------------------

def default_dir() -> Path:
    explicit = os.environ.get("VARUNAD_LOCAL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "varunad" / "ring"


def find_etcd_binary(path: str | None = None) -> str:
    """The etcd server on PATH (or on ``path``); LocalRingError with the install hint when missing."""
    found = shutil.which("etcd", path=path)
    if found is None:
        raise LocalRingError(f"no `etcd` binary on PATH; {INSTALL_HINT}")
    return found


def read_ring(state_dir: Path | str | None = None) -> Ring | None:
    """The ring recorded in ``state_dir`` (default ``default_dir()``), or None."""
    path = Path(state_dir or default_dir()) / RING_FILE
    try:
        doc = json.loads(path.read_text())
        doc["etcd_proc"] = RingProc(**doc["etcd_proc"])
        doc["daemons"] = tuple(RingProc(**d) for d in doc["daemons"])
        doc["daemon_args"] = tuple(doc.get("daemon_args", ()))
        return Ring(**doc)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LocalRingError(f"{path} is unreadable ({exc}); remove it once nothing of that ring runs") from None


def default_etcd() -> str:
    """varunactl's etcd when none is given: $VARUNAD_ETCD, else a live local ring's, else 127.0.0.1:2379."""
    if os.environ.get("VARUNAD_ETCD"):
        return os.environ["VARUNAD_ETCD"]
    try:
        ring = read_ring()
    except LocalRingError:
        ring = None
    if ring is not None and alive(ring.etcd_proc):
        return ring.etcd
    return "127.0.0.1:2379"


def stopped_ring() -> Ring | None:
    """The local ring recorded in the default directory whose etcd no longer runs (None: no ring
    recorded there, or a live one): `default_etcd` passes it over, and an error must say so."""
    try:
        ring = read_ring()
    except LocalRingError:
        return None
    return ring if ring is not None and not alive(ring.etcd_proc) else None


def _write_ring(ring: Ring) -> None:
    path = Path(ring.dir) / RING_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(ring), indent=2) + "\n")
    os.replace(tmp, path)  # readers never see half a file


# --- processes --------------------------------------------------------------------------------------------

def _process(rec: RingProc) -> psutil.Process | None:
    try:
        p = psutil.Process(rec.pid)
        if abs(p.create_time() - rec.create_time) < 0.5 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


def alive(rec: RingProc) -> bool:
    """Whether the recorded process still runs (not merely whether its pid is in use)."""
    return _process(rec) is not None


def _spawn(name: str, cmd: list[str], log: Path, cwd: Path, metrics_port: int | None = None) -> RingProc:
    env = dict(os.environ)
    # The daemon must import this very varunad even when the package is not installed.
    env["PYTHONPATH"] = str(_PACKAGE_PARENT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd, env=env)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.Error:  # it died at once; the caller's readiness check reports the log
        created = 0.0
    return RingProc(name=name, pid=proc.pid, create_time=created, log=str(log), metrics_port=metrics_port)


def _family(rec: RingProc) -> list[psutil.Process]:
    """The process (first, when alive), its descendants (workers run in sessions of their own, so
    outside its group), and whatever is left in its process group, also after it died."""
    p = _process(rec)
    out = [] if p is None else [p]
    if p is not None:
        with contextlib.suppress(psutil.Error):
            out += p.children(recursive=True)
    for q in psutil.process_iter():
        # a group outlives its leader; members younger than the leader are ours, not a reused pid's
        with contextlib.suppress(psutil.Error, OSError):
            if q not in out and os.getpgid(q.pid) == rec.pid and q.create_time() >= rec.create_time - 0.5 \
                    and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
    return out


def _kill(procs: Sequence[psutil.Process]) -> None:
    """SIGKILL each process, and the whole group of those that lead one (what they left behind);
    returns once they are gone (a signal is delivered asynchronously)."""
    for p in procs:
        try:
            if not p.is_running():  # also refuses a pid reused since the snapshot
                continue
            if _leads_group(p):
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    psutil.wait_procs(procs, timeout=5)


def _leads_group(p: psutil.Process) -> bool:
    try:
        return os.getpgid(p.pid) == p.pid
    except OSError:
        return False


def _log_tail(path: str, lines: int = 5) -> str:
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# --- etcd ---------------------------------------------------------------------------------------------------

def free_port_range(n: int, *, attempts: int = 50) -> int:
    """The first of ``n`` consecutive loopback ports that are free now (for --metrics-port)."""
    for _ in range(attempts):
        base = free_ports(1)[0]
        if base + n <= 65536 and all(_port_free(base + i) for i in range(1, n)):
            return base
    raise LocalRingError(f"found no {n} consecutive free ports on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _etcd_healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=0.5) as resp:
            return b'"true"' in resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _start_etcd(binary: str, state_dir: Path, timeout: float) -> tuple[str, RingProc]:
    log = state_dir / "logs" / "etcd.log"
    for _attempt in range(3):  # a free port can be taken between choosing and binding it
        client, peer = free_ports(2)
        endpoint = f"127.0.0.1:{client}"
        cmd = [binary, "--name", "ring", "--data-dir", str(state_dir / "etcd"),
               "--listen-client-urls", f"http://{endpoint}", "--advertise-client-urls", f"http://{endpoint}",
               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"ring=http://127.0.0.1:{peer}",
               # progress and logs add revisions all the time: keep the last hour's only
               "--auto-compaction-retention", "1"]
        rec = _spawn("etcd", cmd, log, state_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(rec):
            if _etcd_healthy(endpoint):
                return endpoint, rec
            time.sleep(0.1)
        _kill(_family(rec))
        if "address already in use" not in _log_tail(str(log), 20):
            break
        shutil.rmtree(state_dir / "etcd", ignore_errors=True)
    raise LocalRingError(f"etcd did not start within {timeout:g}s: {_log_tail(str(log))} (log {log})")


# --- daemons --------------------------------------------------------------------------------------------------

def _daemon_cmd(ring: Ring, name: str, metrics_port: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "varunad.node.daemon", "--etcd", ring.etcd, "--name", name, "--root", ring.root,
           "--advertise", "127.0.0.1", "--slots", "1", "--threads", "1", "--plaintext", "--ttl", f"{ring.ttl:g}",
           "--store", ring.store, "--state-dir", str(Path(ring.dir) / name)]
    # The ring's daemons report one machine (the kernel's boot id): the leader plans for its cores
    # and calls none of them a straggler (which lags is the scheduler's choice, not a VM's speed).
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    return cmd + list(ring.daemon_args)


def _start_daemon(ring: Ring, index: int) -> RingProc:
    name = f"vm{index}"
    port = ring.metrics_base + index - 1 if ring.metrics_base > 0 else None
    return _spawn(name, _daemon_cmd(ring, name, port), Path(ring.dir) / "logs" / f"{name}.log", Path(ring.dir), port)


def _wait_members(ring: Ring, names: Sequence[str], timeout: float) -> None:
    """Until every named daemon is a member; a daemon that exits fails at once with its log's tail."""
    async def wait() -> None:
        from varunad.store.etcd import EtcdStore
        from varunad.store.keys import Keys

        keys = Keys(ring.root)
        deadline = time.monotonic() + timeout
        async with EtcdStore(ring.etcd, timeout=3.0) as store:
            while True:
                present = {keys.member_name(kv.key) for kv in await store.get_prefix(keys.members)}
                missing = [n for n in names if n not in present]
                if not missing:
                    return
                for d in ring.daemons:
                    if d.name in missing and not alive(d):
                        raise LocalRingError(f"daemon {d.name} exited: {_log_tail(d.log)} (log {d.log})")
                if time.monotonic() > deadline:
                    raise LocalRingError(f"{', '.join(missing)} did not join within {timeout:g}s "
                                         f"(logs in {Path(ring.dir) / 'logs'})")
                await asyncio.sleep(0.2)

    asyncio.run(wait())


# --- up, down, add, kill ---------------------------------------------------------------------------------------

MAX_LOCAL_DAEMONS = 32


def up(n: int, state_dir: Path | str | None = None, *, ttl: float = 5.0, root: str = "/varunad/",
       metrics_port: int = 0, daemon_args: Sequence[str] = (), timeout: float = 60.0,
       say: Callable[[str], None] = lambda line: None) -> Ring:
    """Start etcd and ``n`` daemons (vm1..vmN) and wait until all are members; returns the ring.

    The ring starts empty: an earlier ring's etcd data is removed (its etcd is gone), and what the
    user may want of it (store with checkpoints and reports, logs, report, daemons' state) is moved
    into ``state_dir/earlier/<time>/``; ``say`` gets a line saying where.

    ``metrics_port`` > 0 gives daemon i (from 0) ``--metrics-port metrics_port + i``. Anything
    started is stopped again when a later part fails.
    """
    if n < 1:
        raise LocalRingError(f"a ring needs at least one daemon, got {n}")
    if n > MAX_LOCAL_DAEMONS:
        # each daemon is a Python process of about 70 MB, and a spare worker each: a thousand
        # filled an outside tester's 23 GB host before `up` was done starting them
        raise LocalRingError(f"a local ring of {n} daemons is more than this machine should run (at most "
                             f"{MAX_LOCAL_DAEMONS}); a larger fleet is many VMs, each with its own varunad")
    if not 0 <= metrics_port <= 65535 - n:
        raise LocalRingError(f"--metrics-port {metrics_port} leaves no room for {n} ports below 65536")
    binary = find_etcd_binary()
    state = Path(state_dir or default_dir()).expanduser().resolve()
    _refuse_running(state)
    kept = _clear(state)
    if kept is not None:
        say(f"kept the earlier ring's store, logs and report in {kept}")
    state.mkdir(parents=True, exist_ok=True)
    endpoint, etcd_proc = _start_etcd(binary, state, timeout)
    ring = Ring(dir=str(state), etcd=endpoint, root=root, store=str(state / "store"), ttl=ttl, etcd_proc=etcd_proc,
                daemon_args=tuple(daemon_args), metrics_base=metrics_port)
    try:
        _write_ring(ring)
        for i in range(1, n + 1):
            # recorded as each starts: an `up` killed before the last one (SIGTERM, a closed
            # terminal) leaves daemons that `down` finds
            ring = replace(ring, daemons=(*ring.daemons, _start_daemon(ring, i)))
            _write_ring(ring)
        _wait_members(ring, [d.name for d in ring.daemons], timeout)
    except BaseException:
        down(state)
        raise
    return ring


def _refuse_running(state: Path) -> None:
    ring = read_ring(state)
    if ring is None:
        return
    running = [p.name for p in (ring.etcd_proc, *ring.daemons) if alive(p)]
    if running:
        raise LocalRingError(f"a ring is already up in {state} ({', '.join(running)} running); "
                             f"stop it with `varunactl down` or choose another --dir")
    (state / RING_FILE).unlink(missing_ok=True)  # left by a reboot or a kill -9: nothing of it runs


_EARLIER = "earlier"


def _clear(state: Path) -> Path | None:
    """Make room for a new ring in ``state``. The earlier ring's etcd is gone, so its etcd data goes;
    its checkpoints must not be picked up by a new job of the same name, but they, its reports and
    logs are the user's: moved into ``earlier/<time>/`` (returned; None when there was nothing).
    Only our own entries, in case DIR holds more."""
    shutil.rmtree(state / "etcd", ignore_errors=True)
    entries = [state / e for e in ("logs", "store", "report", "metrics") if (state / e).exists()]
    entries += sorted(state.glob("vm[0-9]*"))
    if not entries:
        return None
    kept = state / _EARLIER / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while kept.exists():   # two rings within a second
        n += 1
        kept = kept.with_name(f"{kept.name.split('.')[0]}.{n}")
    kept.mkdir(parents=True)
    for entry in entries:
        entry.rename(kept / entry.name)
    return kept


def add_daemon(state_dir: Path | str | None = None, *, timeout: float = 60.0) -> RingProc:
    """Start one more daemon (the next vmK) in a running ring, as when a VM boots; returns it."""
    ring = _running(state_dir)
    index = 1 + max((int(d.name[2:]) for d in ring.daemons), default=0)
    rec = _start_daemon(ring, index)
    ring = replace(ring, daemons=(*ring.daemons, rec))
    _write_ring(ring)
    _wait_members(ring, [rec.name], timeout)
    return rec


def kill_daemon(name: str, state_dir: Path | str | None = None, sig: int = signal.SIGKILL) -> RingProc:
    """Send ``sig`` to daemon ``name``: SIGKILL (with its workers) is a VM that vanished, SIGTERM a
    preemption notice. Returns its record."""
    rec = _running(state_dir).daemon(name)
    family = _family(rec)
    if not family:
        raise LocalRingError(f"daemon {name} is not running")
    if sig == signal.SIGKILL:
        _kill(family)
    else:
        family[0].send_signal(sig)
    return rec


def _running(state_dir: Path | str | None) -> Ring:
    ring = read_ring(state_dir)
    if ring is None or not alive(ring.etcd_proc):
        raise LocalRingError(f"no ring is up in {Path(state_dir or default_dir())}; start one with `varunactl up N`")
    return ring


def down(state_dir: Path | str | None = None, *, timeout: float = 30.0,
         say: Callable[[str], None] = lambda line: None) -> list[str]:
    """Stop the ring in ``state_dir``: SIGTERM to each daemon (its workers checkpoint and stop),
    up to ``timeout`` seconds, then SIGKILL to what is left (process groups and descendants), then
    etcd. Idempotent; returns (and passes to ``say``) one line per process it stopped."""
    state = Path(state_dir or default_dir()).expanduser()
    ring = read_ring(state)
    if ring is None:
        return []
    done: list[str] = []

    def report(line: str) -> None:
        done.append(line)
        say(line)

    # Snapshot first: once a daemon exits, its workers are nobody's children any more.
    families = {d.name: _family(d) for d in ring.daemons}
    daemons = [p for d in ring.daemons if (p := _process(d)) is not None]
    for p in daemons:
        _signal(p, signal.SIGTERM)  # a preemption notice: running workers checkpoint
    _gone, stuck = psutil.wait_procs(daemons, timeout=timeout)
    stuck_pids = {p.pid for p in stuck}
    for d in ring.daemons:
        left = families[d.name] + _family(d)
        if not left:
            continue
        _kill(left)
        if any(p.pid == d.pid for p in daemons):
            report(f"killed {d.name} (pid {d.pid}): it did not exit within {timeout:g}s of SIGTERM"
                   if d.pid in stuck_pids else f"stopped {d.name} (pid {d.pid})")
        else:
            report(f"killed what {d.name} (pid {d.pid}, gone already) left behind")
    etcd = _process(ring.etcd_proc)
    if etcd is not None:
        _signal(etcd, signal.SIGTERM)
        psutil.wait_procs([etcd], timeout=10)
        report(f"stopped etcd (pid {ring.etcd_proc.pid})")
    _kill(_family(ring.etcd_proc))
    (state / RING_FILE).unlink(missing_ok=True)
    return done


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass
