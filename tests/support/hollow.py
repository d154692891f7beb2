"""Hollow VMs: the real daemon with stand-in workers, many to a process. A TEST HARNESS.

The control plane's scale (benchmarks/fleet_scale.py) is shown the way Kubernetes' kubemark shows
its own: real node agents over a hollow runtime. A hollow VM is ``varunad.node.daemon.Daemon``
itself (membership, election, the leader, the plan follower, the supervisor, its control line and
reporter, against a real etcd) with two parts replaced:

* its workers (``HollowWorker``): an asyncio task in the daemon's process, not a trainer
  process. It connects to the daemon's control socket as a worker does (its token, its rank),
  resumes at the newest complete checkpoint of the job's store, and reports a step every
  ``step_s`` (the plan's estimate, clamped to [STEP_MIN, ``--step-max``]: the benchmark's epochs
  must show progress soon and finish in time), on ticks of the wall clock so that an epoch's
  ranks step together, with a loss that is a function of the step alone.
  Rank 0 writes a checkpoint manifest every ``checkpoint_every`` steps and at a checkpointed
  stop; at a rescue each survivor marks its save and the last of them commits the manifest
  (``meta.source = "replicas"``) once every stage has one, so the next epoch of every hollow VM
  resumes at the same step and the leader's resume records read what real workers would leave. A stop
  with a checkpoint ends it with the trainer's STOPPED_EXIT_CODE; the rescue signal too, after
  saying WorkerRescuing; a kill cancels it (exit -9). A calibration run writes
  ``hollow_calibration`` and exits 0. It starts at once: no import, no rendezvous, no loading,
  so the benchmark's settle time is the control plane's, not torch's.
* its link probes (``HollowProber``): a fixed measurement after ``PROBE_S``, instead of two
  processes with torch.

Each hollow VM advertises an address of its own in 127.0.0.0/8, so the leader sees distinct hosts
(and surveys their links) as it would on a fleet. ``main`` runs several hollow VMs in one
process (no VM owns the process's signals): ``python tests/support/hollow.py --etcd ... --names
h001,h002``; SIGKILL of that process is a sudden loss of all of them, SIGTERM their preemption
notice. Nothing in varunad imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.errors import ProtocolError  # noqa: E402
from protocol.messages import (  # noqa: E402
    CheckpointNow,
    StopWorkers,
    WorkerCheckpointed,
    WorkerProgress,
    WorkerRescuing,
    decode,
    encode,
)
from trainer.engine.control import RESCUE_SIGNAL, STOPPED_EXIT_CODE, TOKEN_ENV, control_identity  # noqa: E402
from trainer.planning.calibration import Calibration, LinkCost  # noqa: E402
from trainer.worker_env import WorkerAssignment  # noqa: E402
from varunad.control.links import LinkProber, ProbeRequest  # noqa: E402
from varunad.control.plans import PlanDoc  # noqa: E402
from varunad.control.resume import resume_source  # noqa: E402
from varunad.node.config import build_parser, load_config  # noqa: E402
from varunad.node.daemon import Daemon  # noqa: E402
from varunad.node.supervisor import Supervisor  # noqa: E402

__all__ = ["HollowDaemon", "HollowWorker", "hollow_calibration", "hollow_loss", "main"]

log = logging.getLogger("hollow")

STEP_MIN, STEP_MAX = 0.2, 2.0   # seconds a hollow step takes, whatever the plan estimates
PROBE_S = 0.2                   # a hollow link probe's duration
HOLLOW_LINK = {"latency_s": 100e-6, "bandwidth_Bps": 1.25e9, "allreduce_latency_s": 200e-6, "allreduce_Bps": 1e9}
_KILLED = -signal.SIGKILL


def hollow_calibration(device_kind: str) -> Calibration:
    """The hollow model: 32 equal layers of 64 MB of weights (2 GiB, 8 GiB with Adam's state and
    gradients), so that a VM of a few GiB holds a few stages and the plan is a pipeline."""
    return Calibration.uniform(
        model="hollow", device_kind=device_kind, segments=32, micro_batch_sizes=(1, 2, 4, 8),
        forward_s=20e-3, backward_s=40e-3, activation_bytes=4 << 20, peak_activation_bytes=8 << 20,
        param_bytes=64 << 20, optimizer_bytes=128 << 20, step_s=1e-3, input_bytes=64 << 10,
        links={"intra": LinkCost(20e-6, 10e9), "inter": LinkCost(HOLLOW_LINK["latency_s"],
                                                                HOLLOW_LINK["bandwidth_Bps"])},
    )


_MARK = "rescued-rank-"   # a survivor's rescue mark: rescued-rank-<rank>


def hollow_loss(step: int) -> float:
    """The loss a hollow job reports at `step`: the same on every rank, in every epoch."""
    return 2.0 + 8.0 / math.sqrt(1.0 + step)


def _write_manifest(store: str, step: int, source: str) -> None:
    """A committed checkpoint as the control plane reads one (varunad.control.resume): the
    manifest alone, listing no file, written last and atomically, as the trainer's commit does."""
    directory = Path(store) / f"varuna_ckpt_{step}"
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"manifest.json.{uuid.uuid4().hex}.tmp"   # several survivors may commit at once
    tmp.write_text(json.dumps({"complete": True, "iteration": step, "files": [], "meta": {"source": source}}))
    os.replace(tmp, directory / "manifest.json")


def _rescue_save(store: str, step: int, rank: int, plan) -> None:
    """A survivor's save of `step` from memory: nothing once the step is committed (as the
    trainer's rescue checks first), else its mark, then the manifest once a rank of every stage
    has saved (the last of them sees every mark: each writes its own before it looks), so a
    stage that lost all its replicas leaves no rescue, as with real workers. One listing of the
    directory, as the trainer reads its writers' records: 300 survivors sharing a host's two
    cores queued for seconds behind a glob of Path objects."""
    directory = Path(store) / f"varuna_ckpt_{step}"
    if (directory / "manifest.json").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{_MARK}{rank}").touch()
    saved = {plan.position(int(name[len(_MARK):]))[0] for name in os.listdir(directory) if name.startswith(_MARK)}
    if len(saved) == plan.P:
        _write_manifest(store, step, "replicas")


class HollowWorker:
    """One stand-in worker: a task in the daemon's loop behind the supervisor's WorkerProcess seam."""

    pid = 0   # no process: nothing is ever signalled by pid

    def __init__(self, ctx: zmq.asyncio.Context, env: dict[str, str], *, step_s: float,
                 profile: str | None, device_kind: str) -> None:
        self.a = WorkerAssignment.from_env(env)
        self.token = env.get(TOKEN_ENV, "")
        self.step_s = step_s
        self.profile, self.device_kind = profile, device_kind
        self.ctx = ctx
        self.step = 0
        self._rescue = asyncio.Event()
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"hollow-rank-{self.a.rank}")

    # -- the WorkerProcess seam ----------------------------------------------------------------------

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def signal(self, sig: int) -> None:
        if sig == RESCUE_SIGNAL:
            self._rescue.set()

    def kill_group(self) -> None:
        if not self._exit.done():
            self.task.cancel()
            self._exit.set_result(_KILLED)

    # -- the stand-in ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        code = 1
        try:
            code = await self._work()
        except asyncio.CancelledError:
            code = _KILLED
            raise
        except Exception:   # a harness bug: the supervisor sees a failed worker, as it would
            log.exception("hollow rank %d failed", self.a.rank)
        finally:
            if not self._exit.done():
                self._exit.set_result(code)

    async def _work(self) -> int:
        if self.profile:
            hollow_calibration(self.device_kind).save(self.profile)
            return 0
        a = self.a
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, control_identity(a.rank, self.token))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(a.control or "")
        try:
            src = resume_source(a.store or "", None, ()) if a.resume == "latest" else None
            self.step = (src.step or 0) if src is not None else 0
            steps = a.steps or 1 << 62
            while self.step < steps:
                request = await self._pause(sock)
                if request is not None:
                    return await self._stop(sock, request)
                # `step` is the number of steps done, the index of the next (as model.iteration)
                await sock.send(encode(WorkerProgress(
                    job=a.job, epoch=a.epoch, rank=a.rank, step=self.step, loss=hollow_loss(self.step),
                    samples_per_s=(a.batch_size or 1) / self.step_s, busy_fraction=0.9,
                    compute_s=self.step_s / 2)))
                self.step += 1
                if a.checkpoint_every and self.step % a.checkpoint_every == 0:
                    await self._checkpoint(sock, "checkpoint")
            await self._teardown()
            return 0
        finally:
            sock.close()

    async def _pause(self, sock: zmq.asyncio.Socket) -> str | None:
        """Until the next tick of the wall clock (every step_s: the ranks of an epoch step
        together, as the collectives make real ones); what ends the epoch if it came
        meanwhile: "stop", "abort", "rescue"."""
        now = time.time()
        deadline = asyncio.get_running_loop().time() + (math.floor(now / self.step_s) + 1) * self.step_s - now
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            if self._rescue.is_set():
                return "rescue"
            # the signal acts at once, as it interrupts a real worker's step
            rescue = asyncio.ensure_future(self._rescue.wait())
            message = asyncio.ensure_future(sock.poll(timeout=1000 * left))
            try:
                await asyncio.wait({rescue, message}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                rescue.cancel()
                message.cancel()
            if not message.done() or message.cancelled() or not message.result():
                continue
            try:
                msg = decode(await sock.recv())
            except ProtocolError as exc:
                log.warning("hollow rank %d dropped a malformed control message: %s", self.a.rank, exc)
                continue
            if getattr(msg, "epoch", None) != self.a.epoch or getattr(msg, "job", None) != self.a.job:
                continue
            if isinstance(msg, StopWorkers):
                # a broken epoch's stop comes with the rescue signal (sent as the stop is queued)
                return "stop" if msg.checkpoint else "rescue" if self._rescue.is_set() else "abort"
            if isinstance(msg, CheckpointNow):
                await self._checkpoint(sock, "checkpoint")
        return "rescue" if self._rescue.is_set() else None

    async def _checkpoint(self, sock: zmq.asyncio.Socket, source: str) -> None:
        a = self.a
        if a.rank == 0 and a.store:
            await asyncio.to_thread(_write_manifest, a.store, self.step, source)
        await sock.send(encode(WorkerCheckpointed(job=a.job, epoch=a.epoch, rank=a.rank, step=self.step,
                                                  path=f"{a.store}/varuna_ckpt_{self.step}", stalled_s=0.0)))

    async def _stop(self, sock: zmq.asyncio.Socket, why: str) -> int:
        """The trainer's ends of an epoch: the agreed stop saves a checkpoint; an abort saves
        nothing; a rescue saves the step it holds, saying so first."""
        a = self.a
        if why == "stop":
            await self._checkpoint(sock, "checkpoint")
        elif why == "rescue" and self.step > 0:
            await sock.send(encode(WorkerRescuing(job=a.job, epoch=a.epoch, rank=a.rank, step=self.step)))
            if a.store:
                await asyncio.to_thread(_rescue_save, a.store, self.step, a.rank, a.plan)
        await self._teardown()
        return STOPPED_EXIT_CODE

    @staticmethod
    async def _teardown() -> None:
        # A worker's process exits a while after its last message (its teardown, a socket that
        # lingers until it is sent): the daemon reads that message before it sees the exit. A
        # stand-in that ended at once closed its socket (no linger) on a message not yet sent,
        # or had it dropped as a dead worker's: a hollow job ended with its last step missing.
        await asyncio.sleep(0.25)


class HollowSupervisor(Supervisor):
    """The real supervisor, its workers hollow (no spares: nothing to import)."""

    step_max = STEP_MAX

    def __init__(self, *, ctx: zmq.asyncio.Context, **kwargs) -> None:
        super().__init__(ctx=ctx, **kwargs)
        self._ctx = ctx
        self._step_s = 1.0

    async def start_epoch(self, doc: PlanDoc, epoch: int, spec, script: Path) -> None:
        self._step_s = min(self.step_max, max(STEP_MIN, doc.estimated_s or 1.0))
        await super().start_epoch(doc, epoch, spec, script)

    async def _launch(self, w, script: Path, args: list[str], env: dict[str, str], out: BinaryIO) -> HollowWorker:
        return HollowWorker(self._ctx, env, step_s=self._step_s, profile=w.profile_path,
                            device_kind=self.membership.member.device_kind)

    def warm_spares(self) -> None:
        return None


class HollowProber(LinkProber):
    """The real prober (requests, staleness, withdrawal, the result's write), the probe itself fixed."""

    async def _probe(self, req: ProbeRequest) -> bytes | None:
        await asyncio.sleep(PROBE_S)
        return json.dumps(HOLLOW_LINK).encode() + b"\n"


class HollowDaemon(Daemon):
    supervisor_class = HollowSupervisor
    prober_class = HollowProber
    owns_signals = False

    def notice(self) -> None:
        """A preemption notice (SIGTERM to a real daemon)."""
        self._notice.set()


async def _run_all(configs: list, stop: asyncio.Event) -> int:
    daemons = [HollowDaemon(c) for c in configs]
    tasks = [asyncio.get_running_loop().create_task(d.run(), name=f"daemon-{d.name}") for d in daemons]
    await stop.wait()
    for d in daemons:
        d.notice()
    codes = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [(d.name, c) for d, c in zip(daemons, codes) if c != 0]
    for name, c in failed:
        log.error("hollow %s ended with %r", name, c)
    return 1 if failed else 0


class _ProfileWindow:
    """A cProfile of the stretch between two signals (a morph, not the whole run)."""

    def __init__(self, path: str) -> None:
        import cProfile

        self.path, self.profiler, self.on = path, cProfile.Profile(), False

    def toggle(self) -> None:
        if self.on:
            self.profiler.disable()
            self.profiler.dump_stats(self.path)
        else:
            self.profiler.enable()
        self.on = not self.on


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run hollow VMs (a test harness: real daemons, stand-in workers).")
    p.add_argument("--names", required=True, help="comma-separated member names")
    p.add_argument("--hosts", required=True, help="comma-separated advertised addresses, one per name")
    p.add_argument("--state-base", required=True, help="each VM's state dir is STATE_BASE/<name>")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--step-max", type=float, default=STEP_MAX,
                   help=f"longest hollow step, seconds (default {STEP_MAX}; at least {STEP_MIN})")
    p.add_argument("--profile", metavar="FILE", help="write a cProfile of this process to FILE when it ends")
    p.add_argument("--profile-window", metavar="FILE",
                   help="cProfile this process between two SIGUSR2s, written to FILE at the second")
    ns, daemon_args = p.parse_known_args(argv)
    HollowSupervisor.step_max = max(STEP_MIN, ns.step_max)
    names, hosts = ns.names.split(","), ns.hosts.split(",")
    if len(names) != len(hosts):
        p.error("--names and --hosts must be as long as each other")
    logging.basicConfig(level=ns.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    # each plays a VM of its own (a machine id apiece): hollow workers compute nothing, and on
    # one host's boot id the planner would crowd hundreds of them onto its two cores
    configs = [load_config([*daemon_args, "--name", n, "--advertise", h, "--state-dir",
                            str(Path(ns.state_base) / n), "--log-level", ns.log_level, "--no-spare-workers",
                            "--machine-id", f"hollow-{n}"],
                           parser=parser) for n, h in zip(names, hosts)]

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ns.profile_window:
            loop.add_signal_handler(signal.SIGUSR2, _ProfileWindow(ns.profile_window).toggle)
        return await _run_all(configs, stop)

    if not ns.profile:
        return asyncio.run(run())
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(asyncio.run, run())
    finally:
        profiler.dump_stats(ns.profile)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
