"""The chaos suite's scenarios, shared by tests/integration/chaos/ and benchmarks/chaos.py.

Each scenario starts its own etcd (single or 3-member) and a ring of real daemons (``tests/support/ring.py``:
``python -m varunad.node.daemon`` per VM, real workers, loopback), submits a short job of the tiny GPT
that checkpoints every ``EVERY`` steps, injects one fault while it runs, and returns an
:class:`Outcome`: whether the job finished, whether its per-step losses equal the plain PyTorch
loop (``tests/support/reference.py``, 1e-4 relative), how many steps were redone, how long from the fault
to the next new step, and which processes were left running afterwards (none may be).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from support.etcd_server import EtcdServer, free_ports
from support.ring import Ring

TTL = 2.0
STEPS, BATCH, EVERY = 14, 12, 4
SLEEP = ("--step-sleep", "0.25")
RING_FLAGS = ["--calibrate", "uniform", "--stop-grace", "20", "--abort-grace", "2", "--max-restarts", "2", "--progress-interval", "0.3",
              "--debounce", "0.2", "--start-timeout", "120"]

_reference: dict[tuple[int, int], list[float]] = {}


def reference_losses(steps: int = STEPS, batch: int = BATCH) -> list[float]:
    if (steps, batch) not in _reference:
        from support.reference import reference_run

        _reference[(steps, batch)] = reference_run(steps, batch)[0]
    return _reference[(steps, batch)]


@dataclass
class Outcome:
    scenario: str
    finished: bool = False
    equal: bool = False
    redone: int = -1
    recovery_s: float = float("nan")  # fault -> the first step beyond the one reached at the fault
    left_running: list[str] = field(default_factory=list)
    exited: list[str] = field(default_factory=list)  # daemons that exited though the fault spared them
    keep_epoch: bool = False  # the fault must not cost the running epoch (an etcd outage is no VM loss)
    extra: list[str] = field(default_factory=list)  # what the fault's own checks found wrong
    max_redone: int = EVERY  # one checkpoint interval; two when the newest checkpoint is refused
    state: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def problems(self, every: int | None = None) -> list[str]:
        every = self.max_redone if every is None else max(every, self.max_redone)
        out = []
        if not self.finished:
            out.append(f"the job did not finish: {self.state.get('state')} {self.state.get('reason', '')} {self.note}")
        elif not self.equal:
            out.append(f"losses differ from the reference: {self.note}")
        if self.finished and not 0 <= self.redone <= every:
            out.append(f"{self.redone} steps redone (at most {every} allowed)")
        if self.left_running:
            out.append(f"left running: {self.left_running}")
        if self.keep_epoch and self.finished and len(self.state.get("epochs", {})) != 1:
            out.append(f"the epoch did not survive the fault: {self.state.get('morphs')}")
        out += self.extra
        if self.exited:
            out.append(f"daemons exited that the fault did not touch: {self.exited}")
        return out


# --- etcd clusters ------------------------------------------------------------------------------------

class EtcdCluster:
    """Three etcd members on loopback; ``endpoint`` lists all of them (the daemons' --etcd)."""

    def __init__(self, size: int = 3) -> None:
        ports = free_ports(2 * size)
        self.token = f"chaos-{os.getpid()}-{random.randrange(1 << 30):x}"
        names = [f"{self.token}-{i}" for i in range(size)]
        peers = ",".join(f"{n}=http://127.0.0.1:{ports[2 * i + 1]}" for i, n in enumerate(names))
        self.members: list[EtcdServer] = []
        for i, name in enumerate(names):
            m = EtcdServer(name=name, extra_args=())
            m.client_port, m.peer_port = ports[2 * i], ports[2 * i + 1]
            m.cluster = peers  # type: ignore[attr-defined]
            m._command = _cluster_command(m, peers, self.token)  # type: ignore[method-assign]
            self.members.append(m)

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        # members wait for each other before they answer: start all, then wait for each
        procs = []
        for m in self.members:
            with open(m.log_path, "ab") as log:
                m._proc = subprocess.Popen(m._command(), stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
            procs.append(m)
        for m in procs:
            if not m._wait_ready(30.0):
                raise RuntimeError(f"etcd member {m.name} did not become ready:\n{m._log_tail()}")

    def close(self) -> None:
        for m in self.members:
            m.close()


def _cluster_command(m: EtcdServer, peers: str, token: str) -> Callable[[], list[str]]:
    def command() -> list[str]:
        client = f"http://127.0.0.1:{m.client_port}"
        peer = f"http://127.0.0.1:{m.peer_port}"
        return [m.binary, "--name", m.name, "--data-dir", str(m.data_dir), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", peers,
                "--initial-cluster-token", token, "--initial-cluster-state", "new"]
    return command


# --- what a scenario checks -------------------------------------------------------------------------

def redone_steps(status: dict[str, Any]) -> int:
    ranges = sorted((int(e), tuple(r)) for e, r in status["epochs"].items())
    redone = 0
    for (_, (_, last1)), (_, (first2, _)) in zip(ranges, ranges[1:]):
        redone = max(redone, last1 - first2 + 1)
    return redone


def losses_equal(status: dict[str, Any], reference: list[float]) -> tuple[bool, str]:
    history = status.get("loss_history") or []
    steps = [s for s, _ in history]
    if steps != list(range(len(reference))):
        return False, f"steps {steps[:5]}...{steps[-5:]} instead of 0..{len(reference) - 1}"
    for step, loss in history:
        if abs(loss - reference[step]) > 1e-4 * abs(reference[step]):
            return False, f"step {step}: {loss} vs {reference[step]}"
    return True, ""


def left_running(base: Path) -> list[str]:
    """Processes whose command line or working directory lies under ``base`` (daemons, workers)."""
    out = []
    needle = str(base)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            cwd = p.cwd() if needle not in cmd else needle
        except (psutil.Error, OSError):
            continue
        if p.pid != os.getpid() and (needle in cmd or cwd.startswith(needle)):
            out.append(f"{p.pid} {cmd[:120]}")
    return out


def wait_gone(base: Path, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        rest = left_running(base)
        if not rest or time.monotonic() > deadline:
            return rest
        time.sleep(0.1)


# --- running one scenario -------------------------------------------------------------------------------

class Run:
    """One scenario's etcd, ring and job, for the fault to act on."""

    def __init__(self, base: Path, etcd: EtcdServer | EtcdCluster, names: list[str], job: str,
                 flags: tuple[str, ...] = ()) -> None:
        self.base, self.etcd, self.names, self.job = base, etcd, names, job
        self.ring = Ring(base / "ring", etcd.endpoint, root="/chaos/", ttl=TTL, extra=RING_FLAGS + list(flags))
        self.hit: set[str] = set()  # daemons the fault killed or stopped on purpose
        self.checks: list[Callable[[dict[str, Any]], str | None]] = []  # the fault's own checks of the status

    def start(self, *, steps: int = STEPS) -> None:
        for n in self.names:
            self.ring.start(n)
        self.ring.wait_members(self.names, timeout=60)
        self.ring.submit(self.job, steps=steps, batch=BATCH, every=EVERY, script_args=SLEEP)

    def status(self) -> dict[str, Any]:
        return self.ring.status(self.job)

    def leader(self) -> str:
        return self.ring.poll(lambda: self.ring.leader(), timeout=30, what="a leader")

    def plan_members(self) -> list[str]:
        return list(self.status()["plan"]["members"])

    def wait_step(self, step: int, timeout: float = 150.0) -> dict[str, Any]:
        return self.ring.wait_step(self.job, step, timeout=timeout)

    def wait_checkpoint(self, at_least: int) -> int:
        return self.ring.wait_checkpoint(self.job, at_least, timeout=120)

    def put(self, key: str, value: bytes | str) -> None:
        self.ring.call(self.ring.store.put(key, value))


def run_scenario(name: str, fault: Callable[[Run], None], base: Path, *, names: tuple[str, ...] = ("vm1", "vm2", "vm3"),
                 cluster: bool = False, steps: int = STEPS, fault_at: int = 5, timeout: float = 240.0,
                 keep_epoch: bool = False, max_redone: int = EVERY, flags: tuple[str, ...] = (),
                 etcd_args: tuple[str, ...] = ()) -> Outcome:
    """Start etcd and the ring, run the job to ``fault_at`` (after a checkpoint), call ``fault``,
    wait for the job to end, and check it."""
    out = Outcome(name, keep_epoch=keep_epoch, max_redone=max_redone)
    etcd: EtcdServer | EtcdCluster = EtcdCluster() if cluster else EtcdServer(extra_args=etcd_args)
    etcd.start()
    run = None
    try:
        run = Run(base, etcd, list(names), job=name, flags=flags)
        run.start(steps=steps)
        run.wait_checkpoint(EVERY * (fault_at // EVERY) if fault_at >= EVERY else EVERY)
        st = run.wait_step(fault_at)
        at_fault = st["step"]
        faulted = time.monotonic()
        fault(run)
        try:
            run.ring.poll(lambda: run.status()["step"] > at_fault, timeout=timeout, what="a step after the fault",
                          interval=0.1)
            out.recovery_s = time.monotonic() - faulted
        except AssertionError as exc:
            out.note = str(exc)[:2000]
        try:
            st = run.ring.wait_state(name, ("done", "failed", "cancelled"), timeout=timeout)
        except AssertionError as exc:
            st = run.status()
            out.note = str(exc)[-3000:]
        out.state = st
        out.finished = st.get("state") == "done"
        out.exited = [n for n, d in run.ring.daemons.items() if not d.alive and n not in run.hit]
        out.extra = [p for check in run.checks if (p := check(st))]
        if out.finished:
            out.equal, why = losses_equal(st, reference_losses(steps))
            out.note = out.note or why
            out.redone = redone_steps(st)
    finally:
        if run is not None:
            run.ring.close()
        etcd.close()
        out.left_running = wait_gone(base)
        for line in out.left_running:  # never leave them: the next scenario must start clean
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    return out


# --- the faults ----------------------------------------------------------------------------------------

def kill9_member(run: Run) -> None:
    leader = run.leader()
    victim = next(m for m in run.plan_members() if m != leader)
    run.hit.add(victim)
    run.ring.daemons[victim].kill9()


def kill9_leader(run: Run) -> None:
    leader = run.leader()
    run.hit.add(leader)
    run.ring.daemons[leader].kill9()


def kill9_two(run: Run) -> None:
    leader = run.leader()
    others = [m for m in run.plan_members() if m != leader]
    run.hit.update([leader, others[0]])
    for m in [leader, others[0]]:
        os.killpg(run.ring.daemons[m].proc.pid, signal.SIGKILL)
    for m in [leader, others[0]]:
        run.ring.daemons[m].proc.wait()


def sigterm_leader(run: Run) -> None:
    leader = run.leader()
    run.hit.add(leader)
    d = run.ring.daemons[leader]
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)


def etcd_kill_restart(run: Run) -> None:
    run.etcd.kill()
    time.sleep(3 * TTL)  # the fault: etcd away for longer than every lease
    run.etcd.start()


def etcd_stall(run: Run) -> None:
    with run.etcd.paused():
        time.sleep(3 * TTL)  # the fault: etcd frozen for longer than every lease


def etcd_lose_one_member(run: Run) -> None:
    cluster = run.etcd
    assert isinstance(cluster, EtcdCluster)
    cluster.members[0].kill()
    # the job goes on with two of three members (the clients move to another endpoint)
    step = run.ring.poll(lambda: run.status()["step"], timeout=30, what="a status with one etcd member down")
    run.wait_step(step + 2)
    cluster.members[0].start()


def etcd_lose_quorum(run: Run) -> None:
    cluster = run.etcd
    assert isinstance(cluster, EtcdCluster)
    for m in cluster.members[:2]:
        m.kill()
    time.sleep(2 * TTL)  # the fault: no quorum for two TTLs
    procs = []
    for m in cluster.members[:2]:
        with open(m.log_path, "ab") as log:
            m._proc = subprocess.Popen(m._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(m)
    for m in procs:
        m._wait_ready(30.0)


def freeze_daemon(run: Run) -> None:
    leader = run.leader()
    victim = next(m for m in run.plan_members() if m != leader)
    pgid = run.ring.daemons[victim].proc.pid
    os.killpg(pgid, signal.SIGSTOP)
    time.sleep(3 * TTL)  # the fault: the VM frozen for three TTLs
    os.killpg(pgid, signal.SIGCONT)


def freeze_worker(run: Run) -> None:
    """One worker stopped for good (SIGSTOP) while its daemon and its lease live on: no member is
    lost and no worker fails, so only the epoch's missing steps say it is stuck (varunad.control.stall)."""
    victim = next(m for m in run.plan_members() if m != run.leader())
    report = json.loads(run.ring.call(run.ring.store.get(run.ring.keys.workers_of(victim))).value)
    pid = next(w["pid"] for w in report["workers"] if w["pid"])
    os.kill(pid, signal.SIGSTOP)   # never continued: its daemon ends it when the epoch stops

    def said_stuck(st: dict) -> str | None:
        if any("a worker is stuck" in m.get("reason", "") for m in st.get("morphs", [])):
            return None
        return f"no morph names the stuck worker: {[m.get('reason') for m in st.get('morphs', [])]}"
    run.checks.append(said_stuck)


def compact_restart_kill9_leader(run: Run) -> None:
    """etcd's history compacted, etcd restarted, then the leader killed: the next leader must follow
    the plan the dead one wrote, whose revision's history is gone (issue 27: this froze the fleet)."""
    run.etcd.compact()
    run.etcd.kill()
    run.etcd.start()
    run.etcd.compact()
    kill9_leader(run)


def kill_join_notice(run: Run) -> None:
    """Three morphs in a row while etcd compacts its history every second (the scenario's etcd runs
    with periodic auto-compaction): a VM killed, a new VM joining, a preemption notice to another."""
    kill9_member(run)
    at = run.ring.poll(lambda: (s := run.status())["state"] == "running" and len(s["morphs"]) >= 1 and s,
                       timeout=90, what="the morph after the kill")
    run.wait_step(at["step"] + 1)
    run.ring.start("vm4", "--scale-up-threshold", "0")
    at = run.ring.poll(lambda: (s := run.status())["state"] == "running" and "vm4" in s["plan"]["members"] and s,
                       timeout=90, what="a scale-up morph onto vm4")
    run.wait_step(at["step"] + 1)
    victim = next(m for m in run.plan_members() if m != run.leader())
    run.hit.add(victim)
    run.ring.daemons[victim].proc.send_signal(signal.SIGTERM)
    run.ring.daemons[victim].proc.wait(60)
    run.checks.append(lambda st: None if len(st.get("morphs", [])) >= 3 else
                      f"expected three morphs (kill, join, notice), got {len(st.get('morphs', []))}")


def corrupt_newest_checkpoint(run: Run) -> None:
    from trainer.checkpoint.reading import checkpoint_dir
    from trainer.checkpoint.store import latest_complete

    store = run.ring.store_dir / run.job
    newest = latest_complete(str(store), verify_checksums=False)
    assert newest is not None
    victim = max((p for p in Path(checkpoint_dir(str(store), newest)).rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    run.checks.append(lambda st: None if any(f"skipping checkpoint {newest}" in w for w in st.get("warnings", []))
                      else f"status does not say checkpoint {newest} was refused: {st.get('warnings')}")
    # and make the epoch restart from the store: every worker dies at once (an OOM killer's sweep),
    # so no replica survives to save a newer step from memory (a lost VM no longer would do)
    kill9_all_workers(run)


def kill9_all_workers(run: Run) -> None:
    workers = [child for d in run.ring.daemons.values() if d.alive
               for child in psutil.Process(d.proc.pid).children(recursive=True)]
    assert workers, "no worker to kill"
    for w in workers:
        try:
            w.kill()
        except psutil.Error:
            pass


GARBAGE = [b'{"kind":"idle","reason":12345}', b'{"kind":"stop","reason":"x","job":"j","stop_epoch":"abc"}',
           b"\xff\xfe\x00garbage", b"[]", b'{"member":7}', b"null", b"[" * 100_000]


def garbage_in_etcd(run: Run) -> None:
    """Garbage in every key family the daemons read, well-formed plans no leader wrote, a leader key
    on no lease, a member key overwritten."""
    from varunad.control.plans import PlanDoc

    k = run.ring.keys
    job = run.job
    victim = next(m for m in run.plan_members() if m != run.leader())
    for value in GARBAGE:
        run.put(k.plan, value)
    # run plans that parse as JSON but whose parallel plan is no plan: a billion squared workers
    # (a reader that built its rank table first would never return), cuts out of order
    for par in ({"P": 10**9, "D": 10**9}, {"P": 3, "D": 1, "cuts": [5, 1]}):
        run.put(k.plan, json.dumps({"kind": "run", "reason": "junk", "job": job, "plan": par, "slots": [],
                                    "dist_url": "tcp://127.0.0.1:1"}))
    # etcdctl put of a plan that parses: a copy of the one in force (a new epoch of the same plan)
    # and a stop that kills the workers. Neither is the leader's, so the epoch goes on (before,
    # the workers were stopped and the job planned again: the epoch jumped 11 -> 81, 27 s lost).
    epoch = run.status()["epoch"]
    run.put(k.plan, run.ring.call(run.ring.store.get(k.plan, revision=epoch)).value)
    run.put(k.plan, PlanDoc.stop(job, epoch, checkpoint=False, reason="forged", kill=True).encode())
    junk = [k.members + "junk", k.member(victim), k.workers + "junk", k.workers_of(victim), k.state(job),
            k.states + "junk", k.jobs + "junk", k.cancels + "junk/x", k.progress_entry(job, 0),
            k.history_entry(job, 1, "junk", 0), k.calibration_entry("fp", "cpu"), k.config, k.root + "bundles/junk"]
    for key in junk:
        run.put(key, random.choice(GARBAGE))
    # the leader key on no lease (issue 17, item 5): deleted by the members, one of them leads again
    leader = run.leader()
    run.ring.call(run.ring.store.delete(k.leader))
    run.put(k.leader, "ghost")
    run.ring.poll(lambda: run.ring.leader() not in (None, "ghost"), timeout=30,
                  what=f"a real leader after 'ghost' (was {leader})")
    # the state key is the leader's: it writes it again at its next decision; the member key is
    # its owner's: it is back under its lease at once
    run.ring.poll(lambda: run.ring.call(run.ring.store.get(k.member(victim))).lease != 0, timeout=10,
                  what=f"{victim}'s member key back on its lease")
    # an etcdctl del of a live member's key: its lease lives, so the leader waits for it to come back
    run.ring.call(run.ring.store.delete(k.member(victim)))
    run.ring.poll(lambda: (kv := run.ring.call(run.ring.store.get(k.member(victim)))) is not None and kv.lease != 0,
                  timeout=10, what=f"{victim}'s deleted member key back on its lease")


def garbage_everywhere(run: Run) -> None:
    """Both garbage faults in one run, one after the other: the etcd keys, then the sockets."""
    garbage_in_etcd(run)
    garbage_on_sockets(run)


def garbage_on_sockets(run: Run) -> None:
    """Random bytes on every daemon's peer port and rendezvous port, forged reports on no socket
    a stranger can reach (the control socket is a Unix socket in a 0700 directory)."""
    import zmq

    from protocol.messages import WorkerProgress, encode

    for name in run.plan_members():
        member = json.loads(run.ring.call(run.ring.store.get(run.ring.keys.member(name))).value)
        host, port = member["endpoint"].rsplit("//", 1)[1].rsplit(":", 1)
        for p in [int(port), member["rendezvous_port"], *member["worker_ports"]]:
            try:
                with socket.create_connection((host, p), timeout=2) as s:
                    s.sendall(os.urandom(700))
            except OSError:
                pass
        # a ZeroMQ peer sending well-formed but forged progress to the peer port (plaintext ring)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(member["endpoint"])
        forged = encode(WorkerProgress(job=run.job, epoch=run.status()["epoch"], rank=0, step=10000, loss=123.456,
                                       samples_per_s=1.0, busy_fraction=0.5))
        for data in (forged, os.urandom(64), b""):
            sock.send(data)
        sock.close(0)
        ctx.term()
    # the control sockets: not reachable over TCP at all, and private directories
    for name in run.plan_members():
        log = run.ring.daemons[name].log_text()
        assert "worker control socket at ipc://" in log, f"{name}'s control socket is not a Unix socket"


SCENARIOS: dict[str, dict[str, Any]] = {
    # (tests/integration/chaos/ runs these two as tests/integration/test_daemon_ring.py's kill -9 tests, marked chaos)
    "kill9-vm": dict(fault=kill9_member),
    "kill9-leader": dict(fault=kill9_leader),
    "kill9-two-vms": dict(fault=kill9_two, names=("vm1", "vm2", "vm3", "vm4")),
    "sigterm-leader": dict(fault=sigterm_leader),
    # etcd away for 3 TTLs: the job must still be running afterwards (workers do not need etcd)
    # (TTL 3 s: a daemon whose lease ran out keeps its workers only while they report steps within
    # the TTL, and steps on a loaded 2-core machine take seconds)
    "etcd-kill-restart": dict(fault=etcd_kill_restart, steps=40, keep_epoch=True, flags=("--ttl", "3")),
    "etcd-stall": dict(fault=etcd_stall, steps=40, keep_epoch=True, flags=("--ttl", "3")),
    "etcd-lose-member": dict(fault=etcd_lose_one_member, cluster=True),
    "etcd-lose-quorum": dict(fault=etcd_lose_quorum, cluster=True),
    # the thawed VM finds a newer plan and stops its worker; it is not taken back in (no scale-up
    # morph: that is kill9-vm's job), which keeps the scenario short
    "frozen-daemon": dict(fault=freeze_daemon, flags=("--scale-up-threshold", "1000")),
    # a worker stopped for good, its daemon alive: the epoch is restarted once 6 s pass without a step
    "frozen-worker": dict(fault=freeze_worker, flags=("--stall-timeout", "6")),
    # checkpoints at 4 and 8, the one at 8 corrupted: the resume loads 4, so up to two intervals are redone
    "corrupt-checkpoint": dict(fault=corrupt_newest_checkpoint, steps=18, fault_at=9, max_redone=2 * EVERY),
    # garbage in every etcd key family and forged plans, then on every socket: one job for both;
    # no fault here costs the running epoch
    "garbage-etcd-sockets": dict(fault=garbage_everywhere, keep_epoch=True),
    # etcd's history compacted and etcd restarted, then the leader killed: the plan in force was
    # written at a revision whose history is gone (issue 27)
    "compact-restart-kill-leader": dict(fault=compact_restart_kill9_leader),
    # etcd compacting every second (periodic mode; etcd 3.4's revision mode compacts only every
    # 5 minutes, so it would never act within a test) through a kill, a join and a notice
    "auto-compaction-morphs": dict(fault=kill_join_notice, steps=40,
                                   etcd_args=("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1s")),
}

# Scenarios tests/integration/chaos/ leaves to another test that injects the same fault (one run per fault in CI).
ELSEWHERE = {"kill9-vm": "tests/integration/test_daemon_ring.py::test_kill9_of_a_non_leader_morphs_and_the_job_finishes",
             "kill9-leader": "tests/integration/test_daemon_ring.py::test_kill9_of_the_leader_elects_another_within_a_ttl_and_the_job_finishes",
             "store-full": "tests/integration/test_store_outage_job.py::test_a_store_that_fills_up_mid_run_pauses_checkpoints_and_the_job_finishes",
             "store-read-only": "tests/integration/test_store_outage_job.py::"
                                "test_a_worker_that_dies_of_a_store_outage_restarts_without_using_up_a_restart"}


from support.store_faults import STORE_SCENARIOS  # noqa: E402  (the checkpoint store's faults: full, read-only)

SCENARIOS.update(STORE_SCENARIOS)


def run_named(name: str, base: Path, **overrides: Any) -> Outcome:
    spec = dict(SCENARIOS[name])
    spec.update(overrides)
    fault = spec.pop("fault")
    store = spec.pop("store", None)   # the ring's shared store made by this context (a small tmpfs)
    with store(base / "ring" / "store") if store is not None else contextlib.nullcontext():
        return run_scenario(name, fault, base, **spec)
