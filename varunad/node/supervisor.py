"""Worker supervision: start this daemon's trainer workers, hear from them, stop them.

One worker per assigned slot: ``python script.py args`` in the job's unpacked bundle, with the
``trainer.worker_env.WorkerAssignment`` of its rank in the environment (the local launcher's entry point).
Each worker

* runs in its own session (so its process group can be signalled as one) and dies with the
  daemon (``PR_SET_PDEATHSIG`` = SIGKILL): a daemon killed with -9 takes its workers along, as
  when the VM vanishes;
* writes stdout and stderr to ``STATE_DIR/logs/<job>/e<epoch>-r<rank>.log``;
* talks to the daemon over its private control socket (``varunad.node.control_channel``: a Unix
  socket in a 0700 directory, identity ``rank-<r>-<secret>``): progress after each step, a note
  after each checkpoint; the daemon sends it ``StopWorkers`` / ``CheckpointNow`` (a stop is
  repeated until the worker exits, a send that failed is retried with its next message).

How workers are stopped (a grace period, the rescue signal of a broken epoch, SIGKILL) is
``varunad.node.stopping``. What the workers did goes to etcd through ``varunad.node.reporter``
(the report at once, progress and loss history throttled, logs in chunks).

Starting, stopping and hearing from the workers act on the one table of live workers; the line
to them is ``varunad.node.control_channel.WorkerLine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import zmq
import zmq.asyncio

from protocol.messages import (
    WorkerProgress,
    WorkerRescuing,
    WorkerStoreOutage,
)
from trainer.engine.control import STOPPED_EXIT_CODE
from trainer.launch import worker_environment as launch_environment
from trainer.net.netaddr import numeric_address
from trainer.planning.parallel import ParallelPlan
from trainer.worker_env import WorkerAssignment
from varunad.cluster.facts import DaemonMember, PortReservation, gpu_count, worker_threads
from varunad.cluster.membership import Membership
from varunad.control.jobs import JobSpec, job_store, job_trace_dir
from varunad.control.plans import PlanDoc
from varunad.control.records import Progress, WorkerRecord, WorkerReport, progress_interval
from varunad.node.config import DaemonConfig
from varunad.node.control_channel import TOKEN_ENV, WorkerLine, control_identity, new_token
from varunad.node.housekeeping import CAPTURES, LOGS, STAGING, job_dir
from varunad.node.metrics import DaemonMetrics
from varunad.node.oom import OOM_WORDS, kernel_oom_kills
from varunad.node.reporter import Reporter
from varunad.node.spares import SparePool
from varunad.node.stopping import WorkerStopping
from varunad.store.contract import Store, StoreError
from varunad.store.keys import Keys

__all__ = ["Supervisor", "STOPPED_EXIT_CODE", "WorkerProcess", "worker_environment"]

log = logging.getLogger(__name__)

_TAIL_BYTES = 4096
# Steps each worker traces (trainer.engine.varuna stops recording after them): enough for a warm-up
# step plus a few steady ones for the end-of-job timeline, small enough to cost nothing.
_TRACE_STEPS = 5
_SPARES_WAIT_S = 20.0   # the most an epoch's spares wait for its traced steps after its first step
_WARM_TIMEOUT = 60.0   # the most a joined VM's spares are waited for before it says it is ready anyway

# A worker or spare gets SIGKILL when its daemon dies. Not a preexec_fn calling prctl: that forces a
# plain fork() of the daemon, a process with gRPC threads (etcd's client), and gRPC's fork handlers
# crashed such children (SIGSEGV in cygrpc, a few milliseconds after the fork) in an outside test.
# Without a preexec_fn the child is spawned with vfork and exec at once. This prefix, a bare
# interpreter, sets the parent-death signal (kept across exec), gives up if the daemon is already
# gone, and execs the real command in the same process.
_DIE_WITH = (
    "import ctypes, os, sys\n"
    "prctl = getattr(ctypes.CDLL(None), 'prctl', None)\n"
    "if prctl is not None:\n"
    "    prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def dying_with(parent: int, command: Sequence[str]) -> list[str]:
    """`command` (its first word an executable's path) run so that it dies with process `parent`."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH, str(parent), *command]


def worker_environment(assignment: WorkerAssignment, *, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's worker environment, without any of the daemon's own settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VARUNA_", "VARUNAD_"))}
    return launch_environment(assignment, extra, base=base)


def _tail(path: Path, size: int = _TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = text.splitlines()
    return "\n".join(lines[1:] if len(text) >= size and len(lines) > 1 else lines)


def _clip(error: str, size: int = _TAIL_BYTES) -> str:
    """`error` in `size` characters: its first line (who ended how) and the end of the output after
    it, from a line's start. Its last `size` characters alone lost that line once the output ran
    past them, and the job's reason became a fragment ("st output:") that repeated word for word."""
    if len(error) <= size:
        return error
    head, _, rest = error.partition("\n")
    rest = rest[-max(0, size - len(head) - 1):]
    if "\n" in rest:
        rest = rest.split("\n", 1)[1]   # no partial first line
    return f"{head[:size]}\n{rest}"


class WorkerProcess:
    """A worker's process as the supervisor acts on it: wait for it, signal it, kill its group.

    The one seam between supervision and the operating system: the scale benchmark's hollow
    VMs (tests/support/hollow.py) put a stand-in behind it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def wait(self) -> int:
        return await self._proc.wait()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._proc.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL its process group (it runs in a session of its own: whatever it started, too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)


@dataclass(eq=False)
class _SupervisedWorker:
    """One worker process this daemon started for a job's epoch, and what it reported."""

    job: str
    epoch: int
    rank: int
    slot: int
    log_path: Path
    proc: WorkerProcess | None = None
    outcome: str = "starting"
    exit_code: int | None = None
    error: str = ""
    step: int = -1
    started_at: float = 0.0
    killed_by_daemon: bool = False
    connected: bool = False
    pending: list[bytes] = field(default_factory=list)
    kill_task: asyncio.Task[None] | None = None
    wait_task: asyncio.Task[None] | None = None
    profile_path: str | None = None
    oom_kills: int | None = None   # the kernel's OOM-kill count when it started (varunad.node.oom)
    ports: tuple[int, ...] = ()
    log_offset: int = 0
    log_end: int | None = None   # the log's size once its epoch ended here: its shipping stops there
    token: str = ""  # the secret this worker names itself by on the control socket
    stop_request: bytes | None = None  # resent until the worker exits (a stop may be lost)
    rescuing: int | None = None  # the step it is saving from memory (WorkerRescuing)
    store_failing_since: int = -1  # the checkpoint store refuses its writes since this step (WorkerStoreOutage)
    store_error: str = ""

    @property
    def identity(self) -> bytes:
        return control_identity(self.rank, self.token)

    @property
    def alive(self) -> bool:
        return self.outcome in ("starting", "running")

    def record(self) -> WorkerRecord:
        return WorkerRecord(rank=self.rank, slot=self.slot, pid=self.proc.pid if self.proc else 0,
                            outcome=self.outcome, exit_code=self.exit_code, error=_clip(self.error),
                            step=self.step, started_at=self.started_at,
                            store_failing_since=self.store_failing_since, store_error=self.store_error[-_TAIL_BYTES:])


class Supervisor(WorkerStopping):
    """This daemon's workers of one epoch at a time; `reporter` writes what they did to etcd."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        store: Store,
        keys: Keys,
        membership: Membership,
        ports: PortReservation,
        ctx: zmq.asyncio.Context,
        security_env: Mapping[str, str],
        peer_keys: Callable[[PlanDoc], dict[str, str]],
        metrics: DaemonMetrics | None = None,
    ) -> None:
        self.config = config
        self.membership = membership
        self.ports = ports
        self.security_env = dict(security_env)
        self.peer_keys = peer_keys
        self.metrics = metrics if metrics is not None else DaemonMetrics()
        self.name = config.name
        # the address every worker's collectives bind: the advertised one (trainer.net.netaddr)
        self.bind_address = numeric_address(config.advertise)
        self._gpus = gpu_count()   # CUDA workers or CPU ones: what the host has, not what its kind is called
        self.line = WorkerLine(ctx, config.state_dir, name=self.name, metrics=self.metrics)
        self.channel = self.line.channel
        self.control_endpoint = self.line.endpoint
        log.info("%s: worker control socket at %s", self.name, self.control_endpoint)
        self.workers: dict[int, _SupervisedWorker] = {}
        self.job: str | None = None
        self.epoch = 0
        self.epoch_started_at = 0.0
        self.first_step_at = 0.0
        self._spares_after: int | None = None   # the step after which this epoch's spares start importing
        # an earlier epoch's workers whose logs are not all in etcd yet: a retry began at once and
        # the first attempt's last lines, its traceback among them, were never shipped (a probe)
        self._log_tails: list[_SupervisedWorker] = []
        self.reporter = Reporter(config=config, store=store, keys=keys, membership=membership, report=self.report,
                                 workers=lambda: [*self._unshipped(), *self.workers.values()])
        self._exited = asyncio.Event()
        self._exited.set()
        self._on_exit: list[Callable[[_SupervisedWorker], Any]] = []
        self._step_interval: dict[int, float] = {}  # rank -> seconds between its last two reports
        self._history_ranks: set[int] = {0}   # the ranks whose daemons keep the job's loss history
        # a spare worker process per slot, torch imported (varunad.node.spares)
        self.spares = SparePool(name=self.name, state_dir=config.state_dir, enabled=config.spare_workers,
                                wrap=lambda command: dying_with(os.getpid(), command))
        self._spare_task: asyncio.Task[None] | None = None
        self._spare_for: tuple[str, Path] | None = None   # (job, script) of the last epoch started here

    # -- the epoch's workers -------------------------------------------------------------------------

    def alive(self) -> list[_SupervisedWorker]:
        return [w for w in self.workers.values() if w.alive]

    def report(self) -> WorkerReport:
        return WorkerReport(member=self.name, job=self.job, epoch=self.epoch,
                            workers=tuple(w.record() for w in sorted(self.workers.values(), key=lambda w: w.rank)),
                            first_step_at=self.first_step_at, started_at=self.epoch_started_at)

    async def wait_all_exited(self, timeout: float | None = None) -> bool:
        if not self.alive():
            return True
        try:
            async with asyncio.timeout(timeout):
                while self.alive():
                    self._exited.clear()
                    await self._exited.wait()
            return True
        except TimeoutError:
            return False

    async def start_epoch(self, doc: PlanDoc, epoch: int, spec: JobSpec, script: Path) -> None:
        """Start a worker for each slot ``doc`` gives this member (after ending any older ones):
        ``script`` (the job's unpacked entry point) with ``spec``'s arguments and settings."""
        self._spare_for = (doc.job or "", script)   # the spares import what it imports (trainer.spare)
        self.checkpoint_every = spec.checkpoint_every   # the steps after which a worker stands still to write
        await self._rescues_done()
        await self.kill_all("a newer plan replaces them")
        member = self.membership.member
        store_dir = job_store(spec, self.config.store)
        mine = doc.slots_on(self.name)
        self._begin(doc.job or "", epoch)
        self._history_ranks = {0, doc.plan.world_size - 1}
        self.reporter.interval = progress_interval(self.config.progress_interval, doc.plan.world_size)
        self.metrics.begin_epoch({s.rank: doc.plan.position(s.rank)[0] for s in mine}, doc.job or "")
        threads = self._threads(member)
        extra = dict(self.security_env)
        curve = (self.security_env.get("VARUNA_SECURITY") == "curve"
                 and self.security_env.get("VARUNA_TRUSTED_NETWORK") != "1")
        peer_keys = self.peer_keys(doc) if curve else None
        for s in mine:
            assignment = WorkerAssignment(
                rank=s.rank, plan=doc.plan, endpoints=doc.endpoints(), dist_url=doc.dist_url,
                job=doc.job or "", epoch=epoch, threads=threads,
                store=store_dir, device=self._device(member, s.slot), control=self.control_endpoint,
                checkpoint_every=spec.checkpoint_every, keep_checkpoints=spec.keep_checkpoints, resume="latest",
                batch_size=spec.batch_size, steps=spec.steps,
                trace_dir=job_trace_dir(store_dir, epoch),
                checkpoint_tmpdir=str(self._staging_dir(doc.job or "")) if self.config.stage_checkpoints else None,
                bind_address=self.bind_address, peer_keys=peer_keys, trace_steps=_TRACE_STEPS,
                capture_cache=self._capture_dir(doc.job or "", spec),
            )
            ports = [member.worker_ports[s.slot]] + ([member.rendezvous_port] if s.rank == 0 else [])
            token = new_token()
            await self._spawn(_SupervisedWorker(job=doc.job or "", epoch=epoch, rank=s.rank, slot=s.slot, token=token,
                                      log_path=self._log_path(doc.job or "", epoch, s.rank), ports=tuple(ports)),
                              script, list(spec.args), worker_environment(assignment, extra={**extra, TOKEN_ENV: token}))
        log.info("%s: started %d worker(s) of %s epoch %d (%s, ranks %s)", self.name, len(mine), doc.job, epoch,
                 doc.shape, [s.rank for s in mine])

    def _capture_dir(self, job: str, spec: JobSpec) -> str:
        """Where this VM keeps the job's exported model (trainer.graph.capture_cache): one per bundle,
        so a job submitted again with other files never loads the old capture."""
        return str(job_dir(self.config.state_dir, CAPTURES, job) / spec.bundle_digest[:16])

    async def start_profile(self, doc: PlanDoc, epoch: int, spec: JobSpec, script: Path, out_path: str) -> None:
        """Run the script once on slot 0 with VARUNA_PROFILE: it writes the calibration and exits 0.

        It measures what a training worker of this host will see: as many torch threads, and on a
        CPU host whose slots share the cores, all of them busy at once (the profiler forks one
        process per slot; that needs one thread each, else the lone slot is measured); where other
        daemons share this machine, the plan's ``profile_slots`` busy at once are then timed too
        (`Calibration.busy_slowdown`)."""
        await self._rescues_done()
        await self.kill_all("a newer plan replaces them")
        member = self.membership.member
        self._begin(doc.job or "", epoch)
        self.metrics.begin_epoch({0: 0}, doc.job or "")
        threads = self._threads(member)
        shared_cores = not self._gpus and member.slots > 1
        busy_slots = member.slots if shared_cores and threads == 1 else None
        # other daemons share this machine: the leader asks for a probe with that many slots busy
        machine_slots = doc.profile_slots if not self._gpus and threads == 1 and doc.profile_slots > 1 else None
        if shared_cores and busy_slots is None:
            log.warning("%s: calibrating one of %d CPU slots alone (%d threads each; profiling them at once needs "
                        "one): the plan's step-time estimate will be optimistic", self.name, member.slots, threads)
        assignment = WorkerAssignment(
            rank=0, plan=ParallelPlan(P=1, D=1, micro_batch_size=spec.chunk_size),
            endpoints=[member.stream_endpoint(0)], dist_url=member.rendezvous_url(),
            job=doc.job or "", epoch=epoch, threads=threads,
            device=self._device(member, 0), control=self.control_endpoint, batch_size=spec.batch_size, steps=spec.steps,
            profile=out_path, profile_slots=busy_slots, profile_machine_slots=machine_slots,
            bind_address=self.bind_address, capture_cache=self._capture_dir(doc.job or "", spec),
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out_path)
        token = new_token()
        worker = _SupervisedWorker(job=doc.job or "", epoch=epoch, rank=0, slot=0, profile_path=out_path, token=token,
                         log_path=self._log_path(doc.job or "", epoch, 0),
                         ports=(member.worker_ports[0], member.rendezvous_port))
        await self._spawn(worker, script, list(spec.args), worker_environment(assignment, extra={**self.security_env,
                                                                                    TOKEN_ENV: token}))

    def fail_epoch(self, job: str, epoch: int, ranks: list[int], error: str) -> None:
        """Report ``ranks`` of an epoch this daemon could not even start as failed, with ``error``."""
        self._begin(job, epoch)
        for rank in ranks:
            self.workers[rank] = _SupervisedWorker(job=job, epoch=epoch, rank=rank, slot=0, outcome="failed", error=error,
                                         log_path=self._log_path(job, epoch, rank))
        self.reporter.mark()

    def on_exit(self, callback: Callable[[_SupervisedWorker], Any]) -> None:
        """Call ``callback(worker)`` (may be async) when a worker has exited, before reporting it."""
        self._on_exit.append(callback)

    def _device(self, member: DaemonMember, slot: int) -> str:
        return str(slot) if self._gpus else "cpu"

    def _threads(self, member: DaemonMember) -> int:
        """torch threads per worker: the host's cores shared out among its slots."""
        return worker_threads(self.config.threads, member.slots)

    def _staging_dir(self, job: str) -> Path:
        return job_dir(self.config.state_dir, STAGING, job)

    def _log_path(self, job: str, epoch: int, rank: int) -> Path:
        return job_dir(self.config.state_dir, LOGS, job) / f"e{epoch}-r{rank}.log"

    def _unshipped(self) -> list[_SupervisedWorker]:
        """The earlier epochs' workers whose logs hold lines not shipped yet."""
        self._log_tails = [w for w in self._log_tails if w.log_end is not None and w.log_offset < w.log_end]
        return self._log_tails

    def _begin(self, job: str, epoch: int) -> None:
        for w in self.workers.values():
            try:   # what it wrote ends here: a later worker of the same log file ships its own lines
                w.log_end = w.log_path.stat().st_size
            except OSError:
                continue   # its directory was removed (the job's files pruned): nothing to ship
            self._log_tails.append(w)
        self.workers = {}
        self.job, self.epoch = job, epoch
        self.epoch_started_at = time.time()
        self.first_step_at = 0.0
        self._spares_after = None
        self.reporter.begin_epoch()

    async def _spawn(self, w: _SupervisedWorker, script: Path, args: list[str], env: dict[str, str]) -> None:
        w.log_path.parent.mkdir(parents=True, exist_ok=True)
        for port in w.ports:
            self.ports.release(port)
        self.workers[w.rank] = w
        self._exited.clear()
        w.started_at = time.time()
        w.oom_kills = kernel_oom_kills()
        with open(w.log_path, "ab") as out:
            w.log_offset = out.tell()
            try:
                w.proc = await self._launch(w, script, args, env, out)
            except (OSError, ValueError) as exc:   # ValueError: an argument no process can take (a NUL)
                w.outcome, w.error = "failed", f"could not start {script}: {exc}"
                self._after_exit(w)
                return
        w.outcome = "running"
        self.reporter.mark()
        w.wait_task = asyncio.get_running_loop().create_task(self._wait(w), name=f"worker-{w.job}-e{w.epoch}-r{w.rank}")

    async def _launch(self, w: _SupervisedWorker, script: Path, args: list[str], env: dict[str, str],
                      out: BinaryIO) -> WorkerProcess:
        """The worker's process: in this slot's spare if it fits, else a new one (OSError: none)."""
        what = f"rank {w.rank} of {w.job} epoch {w.epoch}"
        proc = await self.spares.run(w.slot, script, args, env, w.log_path, what) if w.profile_path is None else None
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                *dying_with(os.getpid(), [sys.executable, str(script), *args]), cwd=str(script.parent), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        return WorkerProcess(proc)

    def warm_spares(self, job: str | None = None) -> None:
        """Start the missing spares in the background: once an epoch's traced steps are done here,
        or while this member waits outside the plan of ``job`` (the next morph may take it in)."""
        if job is not None and self._spare_for is not None and self._spare_for[0] != job:
            self._spare_for = None   # another job's script: its imports would not serve this one
        if self._spare_task is not None and not self._spare_task.done():
            return
        task = asyncio.get_running_loop().create_task(self._fill_spares(), name="spare-workers")
        self._spare_task = task   # kept: a task without a reference may be collected mid-way

    async def _fill_spares(self) -> None:
        """A spare per slot of this member (once an epoch trains here: its import then competes
        with training, not with a start-up), in the environment the slot's workers start with."""
        member = self.membership.member
        # what a worker's environment is before its assignment (read after start-up) goes over it
        base = worker_environment(WorkerAssignment(rank=0, plan=ParallelPlan(P=1, D=1), endpoints=[""], dist_url="",
                                                   threads=self._threads(member)), extra=self.security_env)
        await self.spares.fill(range(member.usable_slots), base,
                               script=self._spare_for[1] if self._spare_for is not None else None)
        if member.warming:   # a VM that just joined: the leader waits for this before taking it in
            began = time.monotonic()
            if not await self.spares.wait_ready(_WARM_TIMEOUT):
                # the wait ends early when the spares failed (their directory gone): say which
                waited = time.monotonic() - began
                log.warning("%s: spare workers not ready after %.0fs (%s); telling the leader not to wait for them",
                            self.name, waited, "timed out" if waited >= _WARM_TIMEOUT else "they failed to start")
            try:
                await self.membership.update(dataclasses.replace(self.membership.member, warming=False))
            except StoreError as exc:   # the leader's own bound on the wait covers this
                log.warning("%s: could not say the spare workers are ready: %s", self.name, exc)

    async def _wait(self, w: _SupervisedWorker) -> None:
        assert w.proc is not None
        code = await w.proc.wait()
        w.exit_code = code
        if w.kill_task is not None:
            w.kill_task.cancel()
        w.proc.kill_group()  # anything the worker left behind in its group
        if code == 0:
            w.outcome = "done"
        elif code == STOPPED_EXIT_CODE:
            w.outcome = "stopped"
        elif w.killed_by_daemon:
            w.outcome = "killed"
        else:
            w.outcome = "failed"
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            if code == -signal.SIGKILL and w.oom_kills is not None and (kernel_oom_kills() or 0) > w.oom_kills:
                how = OOM_WORDS
            w.error = f"rank {w.rank} on {self.name} {how}; last output:\n{_tail(w.log_path)}"
        for callback in self._on_exit:
            try:
                result = callback(w)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # a callback must not stop the report
                log.exception("%s: exit callback failed", self.name)
        self._after_exit(w)

    def _after_exit(self, w: _SupervisedWorker) -> None:
        for port in w.ports:
            self.ports.reacquire(port)
        level = logging.WARNING if w.outcome == "failed" else logging.INFO
        log.log(level, "%s: worker rank %d of %s epoch %d: %s (exit code %s)%s", self.name, w.rank, w.job, w.epoch,
                w.outcome, w.exit_code, ("\n" + w.error) if w.outcome == "failed" else "")
        self.reporter.mark()
        if not self.alive():
            self._exited.set()

    # -- the control socket ------------------------------------------------------------------------------

    async def serve(self) -> None:
        await self.line.serve(lambda rank: self.workers.get(rank), self._heard)

    def _heard(self, w: _SupervisedWorker, msg: Any) -> None:
        """A message from the current epoch's worker of its rank (``WorkerLine`` checked who sent it)."""
        if isinstance(msg, WorkerProgress):
            self._on_progress(w, msg)
        elif isinstance(msg, WorkerRescuing):
            self._on_rescuing(w, msg)
        elif isinstance(msg, WorkerStoreOutage):
            self._on_store_outage(w, msg.step if msg.failing else -1, msg.error)
        else:
            self._on_store_outage(w, -1, "")   # a checkpoint went through: the store takes writes
            self.metrics.worker_checkpointed(job=msg.job, stalled_s=msg.stalled_s)
            log.info("%s: rank %d checkpointed step %d of %s (training stood still %.2fs for it)", self.name,
                     msg.rank, msg.step, msg.job, msg.stalled_s)
            self.reporter.flush_soon()  # the history now: the next epoch resumes from here

    def _on_store_outage(self, w: _SupervisedWorker, since: int, error: str) -> None:
        """The checkpoint store refuses `w`'s writes since step `since` (-1: it takes them again):
        in the worker report at once, where `varunactl status` and the leader read it."""
        if (w.store_failing_since, w.store_error) == (since, error):
            return
        if since >= 0 and since != w.store_failing_since:   # once an outage: each failed write names another file
            log.warning("%s: rank %d of %s epoch %d: checkpoints failing since step %d: %s", self.name, w.rank,
                        w.job, w.epoch, since, error)
        elif w.store_failing_since >= 0:
            log.warning("%s: rank %d of %s epoch %d: the checkpoint store takes writes again", self.name, w.rank,
                        w.job, w.epoch)
        w.store_failing_since, w.store_error = since, error
        self.metrics.store_failing(job=w.job, rank=w.rank, since=since, error=error)
        self.reporter.mark()

    def _on_progress(self, w: _SupervisedWorker, msg: WorkerProgress) -> None:
        now = time.time()
        reports_job = w.rank == min(self.workers)   # the lowest local rank speaks for the job
        # Every rank reports the step's loss, but the job's history is kept by the daemons of the
        # plan's first and last ranks only (two VMs, so one lost keeps it): written by every
        # daemon it was 300 rewrites of the same growing record per interval at 300 VMs.
        keeps_history = reports_job and bool(self._history_ranks & self.workers.keys())
        if w.step < 0 and not self.first_step_at:
            self.first_step_at = now
            self.reporter.mark()
            self._spares_after = msg.step + _TRACE_STEPS - 1
        # The spares import once the epoch's traced steps are done (or a while after its first
        # step, when steps are long): importing beside them made a local ring's traced steps 1.7-2.2x
        # slower than the steps after, and the report compares its prediction with those.
        if self._spares_after is not None and (msg.step >= self._spares_after
                                               or now - self.first_step_at >= _SPARES_WAIT_S):
            self._spares_after = None
            log.info("%s: starting spare workers after step %d of %s epoch %d", self.name, msg.step, w.job, w.epoch)
            self.warm_spares()
        w.step = max(w.step, msg.step)
        last = self.reporter.progress.get(w.rank)
        if last is not None and last.epoch == msg.epoch:
            self._step_interval[w.rank] = now - last.at
        self.reporter.record_progress(Progress(job=msg.job, epoch=msg.epoch, rank=msg.rank, step=msg.step,
                                               loss=msg.loss, samples_per_s=msg.samples_per_s,
                                               busy_fraction=msg.busy_fraction, member=self.name, at=now,
                                               peak_bytes=msg.peak_bytes, compute_s=msg.compute_s),
                                      keeps_history=keeps_history)
        if w.exit_code is not None:
            self.reporter.flush_soon()   # read after its exit was reported: the job may be ending on it
        self.metrics.worker_progress(job=msg.job, rank=msg.rank, step=msg.step, loss=msg.loss,
                                     samples_per_s=msg.samples_per_s, busy_fraction=msg.busy_fraction,
                                     reports_job=reports_job)

    def close(self) -> None:
        self.spares.close()
        self.line.close()
