"""Prometheus metrics of one daemon, and the small HTTP endpoint that serves them.

``varunad --metrics-port PORT`` (or ``VARUNAD_METRICS_PORT``; 0, the default, turns it off)
serves ``GET /metrics`` in Prometheus' text format on the host the daemon binds its control
socket to (the advertised address when it is a loopback one, else every interface). Every
daemon serves its own; scrape all of them. Names and meaning:

==================================  =======  ==================  ===============================================
name                                type     labels              meaning
==================================  =======  ==================  ===============================================
``varunad_members``                 gauge                        live members (registered under a lease) this
                                                                 daemon sees in etcd, read at each scrape
``varunad_leader``                  gauge                        1 while this daemon is the leader, else 0
``varunad_plan_epoch``              gauge                        epoch of the newest plan this daemon applied
``varunad_workers``                 gauge                        trainer workers of this daemon now running
``varunad_job_step``                gauge    job                 last step a local worker of the job finished
                                                                 (0-based, as in ``varunactl status``)
``varunad_job_loss``                gauge    job                 loss of that step (the global mini-batch's)
``varunad_samples_per_second``      gauge    job                 global batch / step time, as the worker timed it
``varunad_stage_busy_fraction``     gauge    job, stage, rank    share of the last step a local worker spent
                                                                 computing rather than waiting on peers, [0, 1]
``varunad_morphs_total``            counter                      morphs (re-plans of a running job onto a new
                                                                 P x D) this daemon made while it led
``varunad_checkpoint_seconds``      histo-   job                 seconds a local worker's training stood still for
                                    gram                         its share of a checkpoint (``_bucket``, ``_sum``,
                                                                 ``_count``)
``varunad_checkpoints_failing_``    gauge    job, rank, reason   while the checkpoint store refuses a local
``since_step``                                                   worker's writes (full, read-only, failing): the
                                                                 step since which it does; the series goes when
                                                                 a write succeeds again
``varunad_slot_slowdown``            gauge    slot, straggler     served by the leader: how many times slower than
                                                                 the fastest slot of its device kind each slot of
                                                                 the running job computes (1 = as fast); straggler
                                                                 is "1" for the slots plans now work around
==================================  =======  ==================  ===============================================

Job series keep their last value after the job ends (a finished job's final loss stays visible);
the busy fractions are cleared when a new epoch starts, because ranks move between stages.

Checkpoint seconds are what the worker reports in ``WorkerCheckpointed.stalled_s``: how long its
training stood still for its share (for a checkpoint staged locally and copied in the
background, the local write alone).

The endpoint is served from the daemon's asyncio loop (``serve``), not from prometheus_client's
threaded HTTP server: the control plane is one loop with no threads, and a scrape first refreshes
the values that are cheapest to read on demand (members, leader, epoch) through an async hook.
Each ``DaemonMetrics`` has its own registry (not the process-wide default), so tests can run
several daemons' metrics side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CHECKPOINT_BUCKETS", "METRIC_NAMES", "DaemonMetrics", "MetricsError", "serve"]

log = logging.getLogger(__name__)

CHECKPOINT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

METRIC_NAMES = (
    "varunad_members", "varunad_leader", "varunad_plan_epoch", "varunad_workers", "varunad_job_step",
    "varunad_job_loss", "varunad_samples_per_second", "varunad_stage_busy_fraction", "varunad_morphs_total",
    "varunad_checkpoint_seconds", "varunad_bad_documents_total", "varunad_task_restarts_total",
    "varunad_dropped_messages_total", "varunad_checkpoints_failing_since_step", "varunad_slot_slowdown",
    "varunad_leader_cycles_total",
)
"""Every documented name, as it appears in the exposition (for tests and docs)."""

_REQUEST_TIMEOUT = 5.0
_MAX_REQUEST_HEAD = 16 * 1024


class MetricsError(OSError):
    """The metrics endpoint cannot be served (its port is taken, the address is not local)."""


class DaemonMetrics:
    """One daemon's metrics in a registry of their own. The daemon, its supervisor and its leader
    set them; ``before_scrape`` (optional) refreshes the on-demand ones before each scrape."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.members = Gauge("varunad_members", "Live members this daemon sees in etcd", registry=r)
        self.leader = Gauge("varunad_leader", "1 while this daemon is the leader, else 0", registry=r)
        self.plan_epoch = Gauge("varunad_plan_epoch", "Epoch of the newest plan this daemon applied", registry=r)
        self.workers = Gauge("varunad_workers", "Trainer workers of this daemon now running", registry=r)
        self.job_step = Gauge("varunad_job_step", "Last step a local worker of the job finished", ["job"], registry=r)
        self.job_loss = Gauge("varunad_job_loss", "Loss of the job's last finished step", ["job"], registry=r)
        self.samples_per_second = Gauge("varunad_samples_per_second", "Global batch divided by the last step's time",
                                        ["job"], registry=r)
        self.stage_busy_fraction = Gauge(
            "varunad_stage_busy_fraction", "Share of the last step a local worker computed rather than waited",
            ["job", "stage", "rank"], registry=r)
        self.morphs = Counter("varunad_morphs", "Morphs of a running job this daemon made while it led", registry=r)
        self.leader_cycles = Counter(
            "varunad_leader_cycles", "Leader cycles (a fleet snapshot read and one decision) this daemon ran while it "
            "led", registry=r)
        self.checkpoint_seconds = Histogram(
            "varunad_checkpoint_seconds", "Seconds a local worker's training stood still for its share of a checkpoint",
            ["job"],
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.bad_documents = Counter(
            "varunad_bad_documents", "Values read from etcd that did not parse as their kind and were ignored",
            ["kind"], registry=r)
        self.task_restarts = Counter(
            "varunad_task_restarts", "Times one of the daemon's tasks failed and was restarted (0 when healthy)",
            ["task"], registry=r)
        self.dropped_messages = Counter(
            "varunad_dropped_messages", "Messages on the worker control socket dropped as malformed or not from "
            "the current epoch's worker of that rank", registry=r)
        self.checkpoints_failing_since_step = Gauge(
            "varunad_checkpoints_failing_since_step", "While the checkpoint store refuses a local worker's writes: "
            "the step since which it does", ["job", "rank", "reason"], registry=r)
        self.slot_slowdown = Gauge(
            "varunad_slot_slowdown", "Leader: how many times slower than the fastest slot of its kind each slot "
            "of the running job computes", ["slot", "straggler"], registry=r)
        self._failing: dict[tuple[str, int], str] = {}   # (job, rank) -> the reason of its failing series
        self.before_scrape: Callable[[], Awaitable[None]] | None = None
        self._stage_of: dict[int, int] = {}
        self._jobs: set[str] = set()   # jobs whose step, loss and rate are served

    # -- what the supervisor hears from workers ------------------------------------------------------

    def begin_epoch(self, stage_of: Mapping[int, int], job: str | None = None) -> None:
        """A new epoch (of ``job``): ``stage_of`` maps each local rank to its pipeline stage.
        A job's last step, loss and rate stay served after it ends here, until another job's
        epoch starts here: then they go (else every job this VM ever ran would stay listed)."""
        self._stage_of = dict(stage_of)
        self.stage_busy_fraction.clear()
        self.checkpoints_failing_since_step.clear()   # the new epoch's workers say it again if it lasts
        self._failing.clear()
        if job is not None:
            for other in self._jobs - {job}:
                self.forget_job(other)

    def forget_job(self, job: str) -> None:
        """Stop serving the job's step, loss and rate."""
        if job in self._jobs:
            self._jobs.discard(job)
            for gauge in (self.job_step, self.job_loss, self.samples_per_second):
                gauge.remove(job)

    def worker_progress(self, *, job: str, rank: int, step: int, loss: float, samples_per_s: float,
                        busy_fraction: float, reports_job: bool) -> None:
        """One ``WorkerProgress``; ``reports_job``: this rank speaks for the job (step, loss, samples/s)."""
        stage = self._stage_of.get(rank)
        self.stage_busy_fraction.labels(job=job, stage="" if stage is None else str(stage),
                                        rank=str(rank)).set(busy_fraction)
        if reports_job:
            self._jobs.add(job)
            self.job_step.labels(job=job).set(step)
            self.job_loss.labels(job=job).set(loss)
            self.samples_per_second.labels(job=job).set(samples_per_s)

    def worker_checkpointed(self, *, job: str, stalled_s: float) -> None:
        """One ``WorkerCheckpointed``: observe how long the worker's training stood still for it."""
        self.checkpoint_seconds.labels(job=job).observe(stalled_s)

    def store_failing(self, *, job: str, rank: int, since: int, error: str) -> None:
        """A ``WorkerStoreOutage`` (``since`` -1: the store takes the worker's writes again)."""
        old = self._failing.pop((job, rank), None)
        if old is not None:
            self.checkpoints_failing_since_step.remove(job, str(rank), old)
        if since >= 0:
            # the error's words without the path (one series per cause, not per file)
            reason = error.split(" (", 1)[0][:120]
            self._failing[(job, rank)] = reason
            self.checkpoints_failing_since_step.labels(job=job, rank=str(rank), reason=reason).set(since)

    def slot_paces(self, paces: Mapping[str, float], stragglers: Mapping[str, float]) -> None:
        """The leader's measured slowdown of each slot of the running job (the series of slots no
        longer measured go)."""
        self.slot_slowdown.clear()
        for slot, pace in paces.items():
            self.slot_slowdown.labels(slot=slot, straggler="1" if slot in stragglers else "0").set(pace)
        for slot, pace in stragglers.items():
            if slot not in paces:   # planned around, so idle: its last measurement
                self.slot_slowdown.labels(slot=slot, straggler="1").set(pace)

    # -- exposition ---------------------------------------------------------------------------------

    async def exposition(self) -> bytes:
        """The text exposition, after ``before_scrape`` (whose failure only leaves older values)."""
        if self.before_scrape is not None:
            try:
                await self.before_scrape()
            except Exception as exc:  # a scrape must still answer while etcd is away
                log.debug("metrics: refreshing before a scrape failed: %s", exc)
        return generate_latest(self.registry)


async def serve(metrics: DaemonMetrics, host: str | None, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` on ``host:port`` (host None or ``*``: every interface) from this loop.
    Raises MetricsError, with what to do, when the port cannot be bound."""
    bind = None if host in (None, "*") else host

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _answer(metrics, reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client that went away or never finished its request
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    try:
        return await asyncio.start_server(handle, bind, port, limit=_MAX_REQUEST_HEAD)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)  # asyncio's own text repeats the address
        raise MetricsError(f"cannot serve metrics on {host or '*'}:{port}: {why}; choose another "
                           f"--metrics-port (VARUNAD_METRICS_PORT), or 0 to turn the endpoint off") from None


async def _answer(metrics: DaemonMetrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    async with asyncio.timeout(_REQUEST_TIMEOUT):
        head = await reader.readuntil(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    method = parts[0] if parts else ""
    path = parts[1].split("?", 1)[0] if len(parts) > 1 else ""
    content_type = "text/plain; charset=utf-8"
    if method not in ("GET", "HEAD"):
        status, body = "405 Method Not Allowed", b"only GET /metrics\n"
    elif path not in ("/metrics", "/"):
        status, body = "404 Not Found", b"metrics are at /metrics\n"
    else:
        status, body, content_type = "200 OK", await metrics.exposition(), CONTENT_TYPE_LATEST
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode("latin-1"))
    if method != "HEAD":
        writer.write(body)
    await writer.drain()
