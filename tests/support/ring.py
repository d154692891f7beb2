"""A ring of real varunad processes on loopback for the daemon tests and the morph benchmark.

Each daemon is ``python -m varunad.node.daemon`` in its own session (so ``kill -9`` of its process
group is what a vanished VM looks like), with its own state directory and free ports; all share
one checkpoint store and one etcd. ``Ring.call`` runs a coroutine against etcd on the ring's own
event loop, so tests poll etcd with bounded waits instead of sleeping.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from support import REPO, TESTS
from support.etcd_server import die_with_parent
from support.waiting import until
from varunad.ctl import commands as ctl
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

JOB_SCRIPT = TESTS / "daemon_job" / "train_job.py"
T = TypeVar("T")


@dataclass
class DaemonProc:
    name: str
    proc: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL the daemon's process group, as when its VM vanishes (its workers die with it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


class Ring:
    def __init__(self, base: Path, etcd_endpoint: str, *, root: str = "/varunad/", ttl: float = 4.0,
                 curve_keys: Path | None = None, extra: list[str] | None = None, own_machines: bool = False) -> None:
        self.base = base
        # Daemons of one host report its machine (the kernel's boot id) and are planned as sharing
        # its cores; `own_machines` has each play a VM of its own (`--machine-id`), for jobs that
        # sleep rather than compute, or daemons each held to a CPU share of their own by a cgroup.
        self.own_machines = own_machines
        base.mkdir(parents=True, exist_ok=True)
        self.etcd = etcd_endpoint
        self.root = root
        self.ttl = ttl
        self.curve_keys = curve_keys
        self.extra = list(extra or [])
        self.store_dir = base / "store"
        self.keys = Keys(root)
        self.daemons: dict[str, DaemonProc] = {}
        self._incarnation: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self.store = EtcdStore(etcd_endpoint, timeout=3.0)
        self.call(self.store.connect())

    # -- etcd --------------------------------------------------------------------------------------

    def call(self, aw: Awaitable[T]) -> T:
        return self.loop.run_until_complete(aw)

    def poll(self, check: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1) -> Any:
        """waiting.until, with etcd briefly unavailable (a paused etcd) counted as "not yet" and the
        daemons' log tails in the failure."""
        return until(check, what, timeout, interval, retry_on=(Exception,), on_timeout=self.tails)

    def status(self, job: str) -> dict[str, Any]:
        return self.call(ctl.job_status(self.store, self.keys, job))

    def leader(self) -> str | None:
        kv = self.call(self.store.get(self.keys.leader))
        return None if kv is None else kv.value.decode()

    def members(self) -> list[str]:
        return sorted(self.keys.member_name(kv.key) for kv in self.call(self.store.get_prefix(self.keys.members)))

    def member_present(self, name: str) -> bool:
        return self.call(self.store.get(self.keys.member(name))) is not None

    # -- daemons -----------------------------------------------------------------------------------

    def start(self, name: str, *extra: str) -> DaemonProc:
        n = self._incarnation.get(name, 0) + 1
        self._incarnation[name] = n
        log = self.base / f"{name}.{n}.log"
        # a killed pytest takes its daemons along (they were left running, re-parented to PID 1)
        cmd = [*die_with_parent(), sys.executable, "-m", "varunad.node.daemon", "--etcd", self.etcd, "--name", name, "--advertise", "127.0.0.1",
               "--slots", "1", "--store", str(self.store_dir), "--state-dir", str(self.base / name), "--root", self.root,
               "--ttl", str(self.ttl), "--threads", "1", "--log-level", "INFO",
               # daemons sharing this host's cores are not VMs of unequal speed: under a loaded
               # run one lagged 2-4x for seconds and was planned around; the tests of stragglers
               # (which give each daemon a cgroup of its own) turn it on
               "--straggler-threshold", "0"]
        cmd += ["--curve-keys", str(self.curve_keys)] if self.curve_keys else ["--plaintext"]
        cmd += ["--machine-id", f"vm-{name}"] if self.own_machines else []
        cmd += self.extra + list(extra)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(REPO), env=env)
        d = DaemonProc(name, proc, log)
        self.daemons[name] = d
        return d

    def wait_members(self, names: list[str], timeout: float = 30.0) -> None:
        self.poll(lambda: set(names) <= set(self.members()), timeout=timeout, what=f"members {names}")

    def alive(self) -> list[str]:
        return sorted(n for n, d in self.daemons.items() if d.alive)

    def close(self) -> None:
        for d in self.daemons.values():
            if d.alive:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for d in self.daemons.values():
            try:
                d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.kill9()
        self.call(self.store.close())
        self.loop.close()

    def tails(self, lines: int = 25) -> str:
        out = []
        for name, d in sorted(self.daemons.items()):
            text = d.log_text().splitlines()[-lines:]
            out.append(f"--- {name} ({'alive' if d.alive else 'exited'}) {d.log}\n" + "\n".join(text))
        return "\n".join(out)

    # -- jobs --------------------------------------------------------------------------------------

    def varunactl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--etcd", self.etcd, "--root", self.root, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=env)

    def submit(self, job: str, *, steps: int, batch: int = 12, every: int = 3, script_args: tuple[str, ...] = (),
               chunk: str = "auto") -> None:
        r = self.varunactl("submit", "--name", job, "--batch-size", str(batch), "--chunk-size", chunk, "--steps",
                           str(steps), "--checkpoint-every", str(every), str(JOB_SCRIPT), "--", *script_args)
        assert r.returncode == 0, r.stderr

    def wait_step(self, job: str, step: int, timeout: float = 120.0) -> dict[str, Any]:
        return self.poll(lambda: (s := self.status(job))["step"] >= step and s, timeout=timeout,
                         what=f"{job} at step {step}")

    def wait_state(self, job: str, states: tuple[str, ...], timeout: float = 180.0) -> dict[str, Any]:
        return self.poll(lambda: (s := self.status(job))["state"] in states and s, timeout=timeout,
                         what=f"{job} in {states}")

    def wait_checkpoint(self, job: str, at_least: int, timeout: float = 120.0) -> int:
        from trainer.checkpoint.store import latest_complete

        store = str(self.store_dir / job)
        return self.poll(lambda: (c := latest_complete(store, verify_checksums=False)) is not None and c >= at_least
                         and c, timeout=timeout, what=f"a checkpoint of {job} at step >= {at_least}")
