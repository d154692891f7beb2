"""varunad: the daemon on every VM (``main`` is the ``varunad`` console script).

One asyncio loop, no threads of its own. Tasks:

* membership keepalive (``varunad.cluster.membership``) and election (``varunad.cluster.election``);
* the control server (``varunad.node.peers``): plan-changed notices and stop requests from the leader, pings;
* the plan follower (``varunad.node.follower``): watches ``plan`` and applies each new epoch
  (start, stop or clear workers); a pushed PlanChanged only makes it read the plan at once: etcd
  holds the truth;
* the supervisor (``varunad.node.supervisor``): workers and their control socket; its reporter (``varunad.node.reporter``)
  writes what they did to etcd;
* the leader (``varunad.node.leader``), only while this daemon leads.
* with ``--metrics-port``, the Prometheus endpoint (``varunad.node.metrics``), served from this loop;
* the registration guard: the member key written again if someone overwrites or deletes it.

Each task is restarted with back-off if it fails (``_keep_running``; counted in
``varunad_task_restarts``): a bug in one must not end the daemon and with it the fleet's job.
Values read from etcd are checked by type where they are parsed (``varunad.store.schemas``).

SIGTERM or SIGINT is a preemption notice: the daemon marks itself leaving, stops leading, asks
its workers to checkpoint and stop (the stop is agreed by every worker of the job, so the whole
job checkpoints at one step), waits for them (bounded), then revokes its lease so that the fleet
re-plans at once instead of after the TTL. A second signal kills the workers and exits.
SIGHUP re-reads the CURVE allow-list.

This module is the one place that starts these tasks, wires them to each other and owns the order
of shutdown; each task's logic lives in its own module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import zmq
import zmq.asyncio

from protocol.errors import SecurityError
from protocol.messages import CheckpointNow, PlanChanged, StopWorkers
from protocol.security import Security, SecurityConfig
from trainer.worker_env import available_cores
from varunad.cluster.election import Election, ElectionState
from varunad.cluster.facts import (
    DaemonMember,
    PortReservation,
    detect_device_kind,
    detect_memory,
    detect_slots,
    gpu_count,
    is_local_address,
    machine_id,
    version,
    worker_threads,
)
from varunad.cluster.membership import Membership, NameInUse, read_members
from varunad.control.jobs import JobSpec
from varunad.control.links import LinkProber
from varunad.control.plans import PlanDoc
from varunad.node.config import DaemonConfig, DaemonConfigError, build_parser, load_config
from varunad.node.follower import PlanFollowing
from varunad.node.leader import Leader
from varunad.node.metrics import DaemonMetrics
from varunad.node.metrics import serve as serve_metrics
from varunad.node.peers import PeerClients, PeerServer
from varunad.node.signing import AllowList
from varunad.node.supervisor import Supervisor
from varunad.store import schemas
from varunad.store.contract import StoreError, StoreUnavailable
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

__all__ = ["Daemon", "main"]

log = logging.getLogger("varunad")

_RESTART_MIN, _RESTART_MAX, _RESTART_RESET = 0.5, 30.0, 60.0  # a failed task's back-off, seconds


class Daemon(PlanFollowing):
    # The parts a test harness replaces (tests/support/hollow.py: many hollow VMs in one process,
    # each with stand-in workers and probes, none of them owning the process's signals).
    supervisor_class = Supervisor
    prober_class = LinkProber
    owns_signals = True

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.name = config.name
        self.keys = Keys(config.root)
        self.store = EtcdStore(config.etcd, timeout=config.retry_timeout, ca_file=config.etcd_ca,
                               cert_file=config.etcd_cert, key_file=config.etcd_key, user=config.etcd_user,
                               password=config.etcd_password, probe_key=config.root)
        self.security = Security(SecurityConfig(
            mode=config.security_mode,  # type: ignore[arg-type]
            secret_key_file=config.secret_key_file, allowed_keys_dir=config.curve_keys,
            trusted_network=config.trusted_network))
        # the submitters whose jobs may run here; None: any job in etcd (see README, Security)
        self.allowed_submitters = AllowList(config.submit_keys) if config.submit_keys else None
        self.ctx = zmq.asyncio.Context()
        self.applied_epoch = 0
        self.plan_read_at = 0   # the plan's revision the follower read last
        self._plan_reading = asyncio.Lock()
        self.draining = False
        self.leader_task: asyncio.Task[None] | None = None
        self._notice = asyncio.Event()
        self._signals = 0
        self._apply_lock = asyncio.Lock()
        self._jobs: dict[str, tuple[JobSpec, Path]] = {}
        self._tasks: list[asyncio.Task] = []
        self.failures: dict[str, int] = {}  # task name -> restarts after a failure (the daemon's health)
        self._background: set[asyncio.Task] = set()  # held so they are not garbage-collected mid-run
        self.metrics = DaemonMetrics()
        self.metrics.before_scrape = self._refresh_metrics
        schemas.on_reject(lambda kind: self.metrics.bad_documents.labels(kind=kind).inc())
        self._metrics_server: asyncio.Server | None = None

    # -- start -------------------------------------------------------------------------------------------

    async def _connect(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.store.connect()
                return
            except StoreUnavailable as exc:
                log.warning("%s: etcd is not reachable yet (%s); retrying in %.0fs", self.name, exc, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    def _facts(self) -> DaemonMember:
        c = self.config
        gpus = gpu_count()
        slots = c.slots or detect_slots(gpus)
        # one stream port per slot, the rendezvous, then the link probe's stream and rendezvous ports
        n = slots + 3
        self.ports = PortReservation(c.advertise, ports=list(range(c.worker_port_base, c.worker_port_base + n))
                                     if c.worker_port_base else None, count=0 if c.worker_port_base else n)
        ports = self.ports.ports
        return DaemonMember(
            name=self.name, host=c.advertise, endpoint=f"tcp://{c.advertise}:{self.server.port}", slots=slots,
            device_kind=c.device_kind or detect_device_kind(slots, gpus=gpus),
            memory_bytes=c.memory or detect_memory(slots, gpus),
            version=version(), started_at=time.time(), worker_ports=tuple(ports[:slots]),
            rendezvous_port=ports[slots], probe_ports=tuple(ports[slots + 1:slots + 3]), lease_ttl=c.ttl,
            machine=c.machine_id or machine_id(), cores=available_cores(),
            threads=0 if gpus else worker_threads(c.threads, slots), warming=c.spare_workers,
        )

    def _bind_host(self) -> str:
        return self.config.advertise if self.config.advertise.startswith("127.") else "*"

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.owns_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_notice, sig)
            loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        Path(self.config.state_dir).mkdir(parents=True, exist_ok=True)
        if self.config.metrics_port:  # first: a taken port is a startup error (MetricsError), before joining
            self._metrics_server = await serve_metrics(self.metrics, self._bind_host(), self.config.metrics_port)
            log.info("%s: serving Prometheus metrics on %s:%d/metrics", self.name, self._bind_host(),
                     self.config.metrics_port)
        self.server = PeerServer(self.ctx, self.security, name=self.name, bind_host=self._bind_host(),
                                 port=self.config.port)
        member = self._facts()
        self.membership = Membership(self.store, self.keys, member, ttl=self.config.ttl)
        self.membership.on_expire(self._fence)

        async def connect_and_join() -> None:
            await self._connect()
            await self.membership.join()

        join = loop.create_task(connect_and_join())
        notice = loop.create_task(self._notice.wait())
        await asyncio.wait({join, notice}, return_when=asyncio.FIRST_COMPLETED)
        if not join.done():
            join.cancel()
            log.info("%s: stopped before joining the fleet", self.name)
            return 0
        notice.cancel()
        join.result()  # NameInUse, StoreError: reported by main()
        log.info("%s: joined the fleet at %s with %d slot(s) of %s (worker ports %s, rendezvous %d)", self.name,
                 member.endpoint, member.slots, member.device_kind, list(member.worker_ports), member.rendezvous_port)
        self.election = Election(self.store, self.keys, self.membership, loop_wait=self.config.loop_wait,
                                 on_change=self._on_election)
        self.clients = PeerClients(self.ctx, self.security, name=self.name)
        self.supervisor = self.supervisor_class(
            config=self.config, store=self.store, keys=self.keys, membership=self.membership, ports=self.ports,
            ctx=self.ctx, security_env=self._worker_security_env(), peer_keys=self._peer_keys, metrics=self.metrics)
        self.supervisor.on_exit(self._after_worker)
        self.prober = prober = self.prober_class(
            store=self.store, keys=self.keys, name=self.name, member=lambda: self.membership.member, ports=self.ports,
            is_busy=lambda: bool(self.supervisor.alive()), timeout=self.config.retry_timeout,
            env={k: v for k, v in os.environ.items() if not k.startswith(("VARUNA_", "VARUNAD_"))})
        self._tasks = [loop.create_task(self._keep_running(name, run), name=name) for name, run in (
            ("election", self.election.run), ("control-server", self._serve),
            ("plan-follower", self._follow_plan), ("worker-socket", self.supervisor.serve),
            ("reports", self.supervisor.reporter.loop), ("link-prober", prober.run),
            ("registration", self.membership.guard_key),
        )]
        notice = loop.create_task(self._notice.wait())
        done, _ = await asyncio.wait({notice, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for task in done:
            if task is not notice and not task.cancelled() and task.exception() is not None:
                log.error("%s: task %s failed: %r", self.name, task.get_name(), task.exception(),
                          exc_info=task.exception())
                code = 1
        await self._shutdown()
        return code

    async def _keep_running(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run one of the daemon's tasks for as long as the daemon runs: a task that fails (a bug;
        bad data is rejected where it is parsed) is logged, counted in varunad_task_restarts and
        started again after a back-off, instead of ending the daemon and with it the fleet's job."""
        loop = asyncio.get_running_loop()
        delay = _RESTART_MIN
        while True:
            started = loop.time()
            try:
                await run()
                why = "it returned"
            except (asyncio.CancelledError, Exception) as exc:
                cancelled = isinstance(exc, asyncio.CancelledError)
                if cancelled and asyncio.current_task().cancelling():
                    raise   # the daemon is stopping it
                # A CancelledError nobody asked for (a library cancelling a call of its own) is a
                # failure like any other: ended as cancelled, the task would take the daemon with it.
                why = "an unrequested cancellation" if cancelled else repr(exc)
                log.error("%s: task %s failed: %s; restarting it in %.1fs", self.name, name, why, delay,
                          exc_info=exc)
            self.failures[name] = self.failures.get(name, 0) + 1
            self.metrics.task_restarts.labels(task=name).inc()
            if loop.time() - started > _RESTART_RESET:
                delay = _RESTART_MIN  # it ran well for a while: this is a new failure, not the same one
            await asyncio.sleep(delay)
            delay = min(_RESTART_MAX, delay * 2)

    # -- leadership -------------------------------------------------------------------------------------------

    def _on_election(self, state: ElectionState) -> None:
        if state.is_leader and self.leader_task is None and not self.draining:
            self.leader_task = asyncio.get_running_loop().create_task(self._lead(), name="leader")
        elif not state.is_leader and self.leader_task is not None:
            self.leader_task.cancel()
            self.leader_task = None

    async def _lead(self) -> None:
        try:
            while self.election.is_leader() and not self.draining:
                leader = Leader(config=self.config, store=self.store, keys=self.keys, election=self.election,
                                clients=self.clients, metrics=self.metrics)
                try:
                    await leader.run()
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception:
                    log.exception("%s: the leader loop failed; restarting it", self.name)
                    await asyncio.sleep(1.0)
        finally:
            if asyncio.current_task() is self.leader_task:
                self.leader_task = None

    async def _fence(self) -> None:
        """The lease ran out unrenewed: stop every worker (the membership registers anew, as a new
        incarnation, as soon as etcd answers; the leader then plans with it again).

        Unless the workers still make progress: then their peers are reachable and training goes
        on, so etcd, not this VM, is what failed (a stall or restart longer than the TTL takes
        every lease at once). An outage is no VM loss (varunad.control.outage): the workers are kept while
        they progress; once the daemon is registered again, a newer plan (if the leader made
        one) stops them, an unchanged one keeps them. A VM cut off from the network fences at
        once: its workers block on their peers and report nothing."""
        sup = getattr(self, "supervisor", None)
        if sup is None:
            return
        why = f"{self.name} lost etcd for longer than its lease ({self.config.ttl:g}s)"
        while True:
            # a cut-off VM fences within its TTL (its workers' last step is before the cut)
            if not sup.progressing(self.config.ttl):
                sup.fence(why)
                return
            if self.membership.lease_valid():
                log.warning("%s: etcd was away longer than the lease but the workers kept training: kept them",
                            self.name)
                return
            await asyncio.sleep(0.1)

    async def _refresh_metrics(self) -> None:
        """Before a scrape: the values read on demand (members from etcd, bounded by retry_timeout)."""
        m = self.metrics
        m.leader.set(1 if hasattr(self, "election") and self.election.is_leader() else 0)
        m.plan_epoch.set(self.applied_epoch)
        sup = getattr(self, "supervisor", None)
        m.workers.set(len(sup.alive()) if sup is not None else 0)
        if hasattr(self, "membership"):
            m.members.set(len(await read_members(self.store, self.keys, timeout=self.config.retry_timeout)))

    # -- the control server ----------------------------------------------------------------------------------

    async def _serve(self) -> None:
        async for _identity, msg in self.server.messages():
            # (a leader of an older release pushed an "assignment": dropped as an unknown type by
            # the server; this daemon reads that plan at the next watch event all the same)
            if isinstance(msg, PlanChanged):
                if msg.epoch > self.applied_epoch:
                    # a task: starting workers must not keep this socket from answering pings
                    task = asyncio.get_running_loop().create_task(self._read_plan(f"pushed epoch {msg.epoch}",
                                                                                  seen=msg.epoch))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
            elif isinstance(msg, StopWorkers):
                self.supervisor.stop(msg.job, msg.epoch, checkpoint=msg.checkpoint, reason=msg.reason)
            elif isinstance(msg, CheckpointNow):
                self.supervisor.checkpoint_now(msg.job, msg.epoch, msg.reason)
            else:
                log.warning("%s: ignored an unexpected %s on the control socket", self.name, type(msg).__name__)

    # -- security for workers ---------------------------------------------------------------------------------

    def _worker_security_env(self) -> dict[str, str]:
        return self.security.config.to_env()

    def _peer_keys(self, doc: PlanDoc) -> dict[str, str]:
        keys = {}
        for s in doc.slots:
            try:
                keys[s.endpoint] = self.security.member_public_key(s.member).decode("ascii")
            except SecurityError as exc:
                log.warning("%s: no public key for %s (%s); its stream will be refused", self.name, s.member, exc)
        return keys

    # -- signals and leaving ---------------------------------------------------------------------------------

    def _on_notice(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            # systemd's stop, `varunactl down` and a spot VM's preemption notice all arrive as SIGTERM
            log.warning("%s: %s: shutting down: the workers checkpoint, then this daemon leaves the fleet",
                        self.name, signal.Signals(sig).name)
            self._notice.set()
        else:
            log.warning("%s: second %s: killing the workers now", self.name, signal.Signals(sig).name)
            sup = getattr(self, "supervisor", None)
            if sup is not None:
                sup.kill_now()

    def _on_hup(self) -> None:
        try:
            self.security.reload_allowed_keys()
            log.info("%s: reloaded the CURVE allow-list", self.name)
        except SecurityError as exc:
            log.error("%s: could not reload the allow-list: %s", self.name, exc)

    async def _shutdown(self) -> None:
        self.draining = True
        t = self.config.retry_timeout
        sup = getattr(self, "supervisor", None)
        planned = self.applied_epoch if sup is not None and sup.alive() else None   # a plan runs workers here
        if hasattr(self, "membership") and self.membership.lease is not None:
            with contextlib.suppress(StoreError, RuntimeError):
                await self.membership.update(dataclasses.replace(self.membership.member, draining=True))
        if self.leader_task is not None:
            await self._end(self.leader_task, 2 * t)
        for task in self._tasks:
            if task.get_name() in ("election", "plan-follower"):
                task.cancel()
        if hasattr(self, "election"):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.election.resign(), t)
        if sup is not None and sup.alive():
            sup.stop(None, None, checkpoint=True, reason=f"{self.name} is shutting down")
            if not await sup.wait_all_exited(self.config.notice_timeout):
                await sup.kill_all("they did not stop within the notice timeout")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sup.reporter.flush(), 2 * t)
        if planned is not None and hasattr(self, "membership"):
            # the workers stopped at a step boundary on their own; a key gone before the leader
            # read it draining reads as a VM lost (a probe's notice, 0.5 s from SIGTERM to gone)
            await plan_after(self.store, self.keys, planned, within=_NOTICED_WITHIN_S + self.config.loop_wait)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(self._end(task, 2 * t) for task in self._tasks))   # one deadline for all
        if hasattr(self, "membership"):
            await self.membership.leave()
        if sup is not None:
            await sup.kill_all("the daemon is exiting")
            sup.close()
        if hasattr(self, "clients"):
            self.clients.close()
        if hasattr(self, "server"):
            self.server.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if hasattr(self, "ports"):
            self.ports.close()
        self.security.close()
        with contextlib.suppress(Exception):
            await self.store.close()
        # destroy, not term: term waits for every socket to be closed, and one opened by a task
        # that outlived its cancellation would keep a stopping daemon alive for ever
        self.ctx.destroy(linger=0)
        log.info("%s: left the fleet", self.name)

    async def _end(self, task: asyncio.Task, timeout: float) -> None:
        """Cancel ``task`` and wait for it to end; cancel it once more halfway through ``timeout``
        if it runs on: a cancellation can be lost (Python 3.11's ``wait_for`` drops one that lands
        as its inner call completes), and a daemon told to stop must stop (`varunactl down` kills
        it after 20 s). Only once: a task busy in a cleanup of its own must not be cut off again
        and again. Past ``timeout`` it logs where the task is stuck and goes on leaving the fleet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        task.cancel()
        await asyncio.wait({task}, timeout=timeout / 2)
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        if not task.done():
            where = io.StringIO()
            task.print_stack(limit=8, file=where)
            log.error("%s: task %s did not stop within %.1fs of being cancelled; leaving without it:\n%s",
                      self.name, task.get_name(), timeout, where.getvalue())
        elif not task.cancelled() and task.exception() is not None:
            log.debug("%s: task %s ended with %r while stopping", self.name, task.get_name(), task.exception())


_NOTICED_WITHIN_S = 2.0   # the leader's next cycle, at most, after the draining member record


async def plan_after(store, keys: Keys, epoch: int, *, within: float) -> bool:
    """Wait until the plan key holds a plan newer than ``epoch`` (the leader saw this daemon
    leaving and stopped its epoch), at most ``within`` seconds; whether it did."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreError):
            kv = await store.get(keys.plan, timeout=max(0.1, deadline - time.monotonic()))
            if kv is not None and kv.mod_revision > epoch:
                return True
        await asyncio.sleep(0.1)
    return False


def _setup_child_watcher() -> None:
    """Reap workers with pidfds (no helper thread per child, as Python 3.11's default has)."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            watcher = asyncio.PidfdChildWatcher()
            asyncio.set_child_watcher(watcher)
        except (OSError, NotImplementedError, RuntimeError):  # kernel without pidfd_open
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:
        print(f"varunad {version()}")
        return 0
    try:
        config = load_config(args, parser=parser)
    except DaemonConfigError as exc:
        print(f"varunad: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_local_address(config.advertise):
        log.warning("--advertise %s is no address of this host: peers reach it only if it is forwarded here "
                    "(a VM image must not carry one VM's address; leave it unset to use the route to etcd)",
                    config.advertise)
    if "--check" in args:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            print(f"{f.name}={'(set)' if f.name == 'etcd_password' and value else value}")
        return 0
    log.info("varunad %s starting as %s (etcd %s, ttl %.1fs, loop_wait %.2fs, retry_timeout %.2fs)", version(),
             config.name, config.etcd, config.ttl, config.loop_wait, config.retry_timeout)
    try:
        daemon = Daemon(config)
    except (SecurityError, StoreError, ValueError) as exc:  # SigningError: a bad --submit-keys
        print(f"varunad: {exc}", file=sys.stderr)
        return 2
    _setup_child_watcher()
    try:
        return asyncio.run(daemon.run())
    except NameInUse as exc:
        print(f"varunad: {exc}", file=sys.stderr)
        return 1
    except (StoreError, OSError) as exc:
        print(f"varunad: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
