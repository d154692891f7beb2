"""Write what this daemon's workers did to etcd: the worker report, progress, loss history, logs.

* the worker report (``varunad.control.records.WorkerReport``, on this daemon's lease) as soon as it
  changes: a worker started, exited, or took its first step;
* each rank's latest progress (fenced by epoch) and the job's loss history, every
  ``progress_interval`` (longer for a big job: ``varunad.control.records.progress_interval``), the
  history also at once after a checkpoint (the next epoch resumes there);
* the workers' log output, through ``varunad.node.log_shipper``, at the same interval, and before
  a changed report: a worker that exited is reported with its last lines already shipped.

A write etcd refuses or does not answer stays pending for the next round. The supervisor tells
the reporter what happened (`mark`, `record_progress`, `begin_epoch`); the reporter never
starts or stops a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from varunad.cluster.fencing import put_for_epoch
from varunad.cluster.membership import Membership
from varunad.control.records import Progress, WorkerReport, encode_history
from varunad.node.config import DaemonConfig
from varunad.node.log_shipper import LogShipper, ShippedLog
from varunad.store.contract import Store, StoreError
from varunad.store.keys import Keys

__all__ = ["Reporter"]

log = logging.getLogger(__name__)

_HISTORY_CAP = 20000
# Steps per history key: each progress write rewrites only the chunk its new steps are in. One
# key per epoch was rewritten whole every interval, up to 20,000 steps (0.5 MB) a second from
# each of two daemons, revisions that etcd keeps until it compacts (hourly, as README advises):
# a long epoch would near etcd's default 2 GB quota within the hour.
HISTORY_CHUNK = 500


class Reporter:
    """The etcd side of one daemon's workers: what is pending, and the loop that writes it."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        store: Store,
        keys: Keys,
        membership: Membership,
        report: Callable[[], WorkerReport],
        workers: Callable[[], Iterable[ShippedLog]],
    ) -> None:
        self.config = config
        self.store = store
        self.keys = keys
        self.membership = membership
        self.name = config.name
        self._report = report
        self._workers = workers
        self.logs = LogShipper(name=config.name, store=store, keys=keys)
        self.progress: dict[int, Progress] = {}  # rank -> its latest report, this epoch
        self._progress_written: dict[int, Progress] = {}
        self._progress_revision: dict[str, int] = {}   # progress key -> revision of this daemon's last write
        # (job, epoch) -> chunk -> {step: loss}; dirty: (job, epoch, chunk) not yet written
        self._history: dict[tuple[str, int], dict[int, dict[int, float]]] = {}
        self._history_steps: dict[tuple[str, int], int] = {}
        self._history_span: dict[tuple[str, int], tuple[float, float]] = {}
        self._history_dirty: set[tuple[str, int, int]] = set()
        self._report_dirty = True
        self._report_lease: int | None = None
        self._wake = asyncio.Event()
        # progress_interval, longer for a big job (records.progress_interval; set by the supervisor)
        self.interval = config.progress_interval

    # -- what the supervisor tells it ------------------------------------------------------------------

    def begin_epoch(self) -> None:
        """A new epoch's workers: forget the old one's progress; the report changes."""
        self.progress.clear()
        self._report_dirty = True

    def mark(self) -> None:
        """The worker report changed: write it now."""
        self._report_dirty = True
        self._wake.set()

    def flush_soon(self) -> None:
        """Write the pending history now rather than at the next interval."""
        self._wake.set()

    def record_progress(self, p: Progress, *, keeps_history: bool) -> None:
        """A worker's step; ``keeps_history``: its loss goes into the job's history (one rank per
        daemon, and only on the daemons the supervisor says keep it)."""
        self.progress[p.rank] = p
        if keeps_history:
            key = (p.job, p.epoch)
            chunk = self._history.setdefault(key, {}).setdefault(p.step // HISTORY_CHUNK, {})
            if p.step in chunk or self._history_steps.get(key, 0) < _HISTORY_CAP:
                self._history_steps[key] = self._history_steps.get(key, 0) + (p.step not in chunk)
                chunk[p.step] = p.loss
            self._history_span[key] = (self._history_span.get(key, (p.at, p.at))[0], p.at)
            self._history_dirty.add((p.job, p.epoch, p.step // HISTORY_CHUNK))

    def history(self, job: str, epoch: int) -> dict[int, float]:
        """step -> loss of ``job``'s ``epoch`` as this daemon keeps it."""
        return {s: v for chunk in self._history.get((job, epoch), {}).values() for s, v in chunk.items()}

    def forget_progress(self) -> None:
        """Drop progress not yet written: it belongs to an epoch that may be over (a fenced daemon)."""
        self.progress.clear()
        self._progress_written.clear()
        self._progress_revision.clear()

    # -- writing to etcd ---------------------------------------------------------------------------------

    async def loop(self) -> None:
        """Write what changed: the report at once, the rest every ``interval``."""
        last_periodic = 0.0
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.flush(periodic=loop.time() - last_periodic >= self.interval)
            if loop.time() - last_periodic >= self.interval:
                last_periodic = loop.time()

    async def flush(self, *, periodic: bool = True) -> bool:
        """Write pending records; False if etcd refused or did not answer (they stay pending)."""
        ok = True
        t = self.config.retry_timeout
        lease = self.membership.lease
        try:
            # the history first: a report that says "done" ends the job, and status read then must
            # find its last steps (a hollow fleet's job once ended one step short for a moment)
            for dirty in sorted(self._history_dirty):
                job, epoch, chunk = dirty
                self._history_dirty.discard(dirty)
                try:
                    await self.store.put(self.keys.history_entry(job, epoch, self.name, chunk),
                                         encode_history(self._history[(job, epoch)][chunk].items(),
                                                        self._history_span.get((job, epoch))),
                                         timeout=t)
                except BaseException:
                    self._history_dirty.add(dirty)
                    raise
            if periodic or self._report_dirty:
                # a worker's end goes out with its last lines: `varunactl logs` read the moment a
                # job has failed must find what the script printed before it exited
                await self.logs.ship(self._workers(), t)
            if lease is not None and (self._report_dirty or lease.id != self._report_lease):
                self._report_dirty = False
                try:
                    await self.store.put(self.keys.workers_of(self.name), self._report().encode(), lease=lease,
                                         timeout=t)
                    self._report_lease = lease.id
                except BaseException:
                    self._report_dirty = True
                    raise
            if periodic:
                for rank, p in list(self.progress.items()):
                    if self._progress_written.get(rank) != p:
                        key = self.keys.progress_entry(p.job, rank)
                        written = await put_for_epoch(self.store, key, p.encode(), epoch=p.epoch, timeout=t,
                                                      mine=self._progress_revision.get(key))
                        if written is None:
                            self._progress_revision.pop(key, None)
                        else:
                            self._progress_revision[key] = written
                        self._progress_written[rank] = p
        except StoreError as exc:
            ok = False
            log.debug("%s: could not write reports to etcd yet: %s", self.name, exc)
        return ok
