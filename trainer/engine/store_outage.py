"""What a worker does while the checkpoint store refuses writes (full, over quota, read-only, I/O
errors): it pauses the writes, never the job.

* A periodic checkpoint that meets an outage is given up for this interval: training goes on (the
  state lives in every stage's replicas), nothing is committed, and the next interval tries again.
* A write the job cannot go on without (the new epoch's fence, the final checkpoint, one asked
  for by a notice or a morph) is retried with back-off, the state held in memory, until the store
  takes it or the daemon ends the worker (a cancel, a broken epoch, a stop's grace running out).

Either way the worker logs the outage once a minute and tells its daemon ("checkpoints failing
since step N: <reason>"), and says so again when a write goes through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from trainer.errors import StoreOutage

__all__ = ["Backoff", "StoreHealth"]

log = logging.getLogger("varuna.checkpoint")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between retries: `first`, doubling, at most `cap` seconds. The cap keeps a store
    that comes back within seconds of it in use again within seconds."""

    first: float = 0.5
    cap: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"a back-off needs 0 < first <= cap, got first={self.first}, cap={self.cap}")

    def delays(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay
            delay = min(self.cap, delay * 2)


class StoreHealth:
    """One worker's view of the store: failing since which checkpoint and why, logged and reported.

    `report(since, error)` and `recovered(since)` tell the daemon (ControlClient.store_outage and
    store_recovered); they are called when the outage begins, when its reason changes, and when it ends."""

    def __init__(self, *, rank: int, report: Callable[[int, str], None], recovered: Callable[[int], None],
                 log_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self._report, self._recovered = report, recovered
        self.log_every_s, self._clock = log_every_s, clock
        self.failing_since: int | None = None
        self.reason = ""
        self.failures = 0
        self._logged_at = float("-inf")

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def failed(self, exc: StoreOutage, step: int, what: str) -> None:
        """`what` (e.g. "checkpoint 12") could not be written because of `exc`; the outage began at
        the step `exc` names, else at `step`."""
        reason = f"{exc.detail} ({exc.path})"
        first = self.failing_since is None
        if first:
            self.failing_since = exc.step if exc.step is not None else step
        self.failures += 1
        now = self._clock()
        if first or now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            log.warning("rank %d: the checkpoint store refuses writes since step %d (%d failed write(s) so far; "
                        "%s not written): %s; free space on the store or remount it writable",
                        self.rank, self.failing_since, self.failures, what, reason)
        if first or reason != self.reason:
            self.reason = reason
            self._report(self.failing_since, reason)

    def wrote(self) -> None:
        """A write went through: an outage, if there was one, is over."""
        if self.failing_since is None:
            return
        log.warning("rank %d: the checkpoint store takes writes again (failing since step %d, %d failed write(s))",
                    self.rank, self.failing_since, self.failures)
        since = self.failing_since
        self.failing_since, self.reason, self.failures = None, "", 0
        self._recovered(since)

    def until_written(self, write: Callable[[], T], step: int, what: str, *, backoff: Backoff = Backoff(),
                      sleep: Callable[[float], None] = time.sleep,
                      give_up: Callable[[], bool] | None = None) -> T:
        """`write()` again and again through store outages until it returns; its result.

        Any other error is raised at once. `give_up()`, asked after each failed try, ends the
        wait by raising the outage (it must say the same on every worker when `write` is
        collective). A worker in here holds its state in memory; the daemon's rescue signal or
        SIGKILL ends the wait from outside."""
        delays = backoff.delays()
        while True:
            try:
                result = write()
            except StoreOutage as exc:
                self.failed(exc, step, what)
                if give_up is not None and give_up():
                    raise
                sleep(next(delays))
                continue
            self.wrote()
            return result
