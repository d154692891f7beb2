"""The store contract: what the control plane needs from a consistent key-value store, and the
plain values and errors it speaks in. ``varunad.store.etcd`` implements it on etcd (the only
module that imports the etcd client); everything above depends on this module, never on aetcd.

The contract (:class:`Store`), by group, in the manner of Patroni's ``AbstractDCS``:

* Every call finishes within its ``timeout`` (the store's default when not given) or raises
  :class:`StoreUnavailable`; nothing waits forever on an etcd that is down or frozen.
  Watches are the exception by nature: waiting for the next event may take forever, so
  :meth:`Watch.next` takes its own timeout.
* Plain reads and writes: :meth:`~Store.get`, :meth:`~Store.get_prefix`, :meth:`~Store.put`,
  :meth:`~Store.delete`, :meth:`~Store.delete_prefix`, :meth:`~Store.revision`. Keys are ``str``
  (UTF-8) or ``bytes``; values are ``bytes`` (``str`` is UTF-8 encoded). Writes return the
  revision at which they took effect.
* Leases: :meth:`~Store.grant`, :meth:`~Store.refresh`, :meth:`~Store.revoke`,
  :meth:`~Store.time_to_live`. A key put with a lease disappears when the lease expires.
  :meth:`~Store.refresh` raises :class:`LeaseExpired` once etcd no longer knows the lease.
* Compare-and-create: :meth:`~Store.create_if_absent` (true for exactly one of any number of
  concurrent callers).
* Guarded writes: :meth:`~Store.put_if` (only while another key holds an expected value: the
  leader fence), :meth:`~Store.compare_and_swap` (on mod revision), :meth:`~Store.delete_if`.
  They return the revision of the write, or ``None`` when the guard did not hold.
* Watches: :meth:`~Store.watch` and :meth:`~Store.watch_prefix` return a :class:`Watch`, an async
  iterator of :class:`WatchEvent` in revision order, used as ``async with ... as w``.
* History is not kept: etcd compacts old revisions on its own schedule (every few minutes, or
  every second, as its operator chose). A :meth:`~Store.get` at an old ``revision`` and a watch
  from an old ``start_revision`` raise :class:`HistoryCompacted` once that revision is gone, and
  every caller must then decide from the current value (or re-list and watch from that
  listing's revision plus one). Nothing may depend on history being there.
"""


from __future__ import annotations

import abc
import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

__all__ = [
    "StoreError",
    "StoreConfigError",
    "StoreUnavailable",
    "StoreAuthError",
    "LeaseExpired",
    "HistoryCompacted",
    "KeyValue",
    "Listing",
    "WatchEvent",
    "PUT",
    "DELETE",
    "Lease",
    "Watch",
    "Store",
    "DEFAULT_TIMEOUT",
    "Key",
    "Value",
    "bounded",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
PUT = "put"
DELETE = "delete"

Key = Union[str, bytes]
Value = Union[str, bytes]
T = TypeVar("T")




# Not rooted at trainer.errors.VarunaError on purpose: importing `trainer` imports torch, and the
# daemon must start light. Same convention though: a message plus a hint saying what to do.
class StoreError(Exception):
    """etcd refused or failed a request, or this module was configured wrongly."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.reason, self.hint = message, hint
        super().__init__(f"{message} ({hint})" if hint else message)


class StoreConfigError(StoreError, ValueError):
    """Endpoints, TLS files or credentials that cannot be used as given."""


class StoreUnavailable(StoreError):
    """etcd did not answer in time or could not be reached; the request may or may not have applied."""


class StoreAuthError(StoreError):
    """etcd rejected this client's credentials or permissions."""


class LeaseExpired(StoreError):
    """etcd no longer knows the lease (it expired or was revoked); keys attached to it are gone."""


class HistoryCompacted(StoreError):
    """A read at an old revision, or a watch from one, asked for history that etcd has compacted away.

    etcd compacts on its own (``--auto-compaction-*``), so this is routine, never a fault: the
    caller decides from the current value instead (see the module docstring).
    """

    def __init__(self, message: str, *, compact_revision: int | None = None) -> None:
        self.compact_revision = compact_revision  # None when etcd did not say (a read's error)
        super().__init__(
            message,
            hint="read the key or prefix again now, and watch from the revision of that read plus one",
        )


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int  # 0 when no lease is attached


@dataclass(frozen=True, slots=True)
class Listing:
    """Keys under a prefix, read atomically at ``revision`` (watch from ``revision + 1`` to follow)."""

    revision: int
    items: tuple[KeyValue, ...]

    def __iter__(self) -> Iterator[KeyValue]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: str) -> KeyValue | None:
        for kv in self.items:
            if kv.key == key:
                return kv
        return None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A put or a delete of one key; ``value`` is empty for deletes."""

    kind: str  # PUT or DELETE
    key: str
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: ``id`` as etcd knows it and the ``ttl`` in seconds etcd actually granted."""

    id: int
    ttl: int
    _store: Store = field(repr=False, compare=False)

    async def refresh(self, *, timeout: float | None = None) -> int:
        return await self._store.refresh(self, timeout=timeout)

    async def revoke(self, *, timeout: float | None = None) -> None:
        await self._store.revoke(self, timeout=timeout)

    async def time_to_live(self, *, timeout: float | None = None) -> int | None:
        return await self._store.time_to_live(self, timeout=timeout)


if sys.version_info >= (3, 11):

    async def bounded(aw: Awaitable[T], timeout: float | None) -> T:
        """``await aw`` for at most ``timeout`` seconds (TimeoutError after).

        Not asyncio.wait_for: before 3.12 it swallows a cancellation that arrives just as the
        awaited call completes, so cancelling the election loop could silently fail.
        """
        async with asyncio.timeout(timeout):
            return await aw

else:  # pragma: no cover - 3.10 has no asyncio.timeout; accept wait_for's rare race there
    bounded = asyncio.wait_for


class Store(abc.ABC):
    """What the control plane needs from a consistent key-value store (see the module docstring)."""

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def reconnect(self) -> None:
        """Open a fresh connection for the next call (after calls timed out); default: nothing."""

    # Plain reads and writes.
    @abc.abstractmethod
    async def get(self, key: Key, *, timeout: float | None = None, revision: int | None = None) -> KeyValue | None:
        """The key now, or as it was at ``revision``; :class:`HistoryCompacted` once etcd compacted that."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: Key, *, timeout: float | None = None) -> Listing: ...

    @abc.abstractmethod
    async def put(
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None
    ) -> int: ...

    @abc.abstractmethod
    async def delete(self, key: Key, *, timeout: float | None = None) -> bool: ...

    @abc.abstractmethod
    async def delete_prefix(self, prefix: Key, *, timeout: float | None = None) -> int: ...

    @abc.abstractmethod
    async def revision(self, *, timeout: float | None = None) -> int: ...

    # Leases.
    @abc.abstractmethod
    async def grant(self, ttl: float, *, timeout: float | None = None) -> Lease: ...

    @abc.abstractmethod
    async def refresh(self, lease: Lease | int, *, timeout: float | None = None) -> int: ...

    @abc.abstractmethod
    async def revoke(self, lease: Lease | int, *, timeout: float | None = None) -> None: ...

    @abc.abstractmethod
    async def time_to_live(self, lease: Lease | int, *, timeout: float | None = None) -> int | None: ...

    # Compare-and-create.
    @abc.abstractmethod
    async def create_if_absent(
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None,
        also: Sequence[tuple[Key, Value | None]] = (),
    ) -> bool:
        """Create `key` only if it does not exist; in the same transaction, put each (key, value)
        of `also` (not under `lease`), or delete its key where the value is None. Whether it did."""

    # Guarded writes.
    async def put_if(
        self,
        key: Key,
        value: Value,
        *,
        guard_key: Key,
        guard_value: Value,
        guard_create_revision: int | None = None,
        lease: Lease | int | None = None,
        timeout: float | None = None,
    ) -> int | None:
        """:meth:`put_all_if` of one key."""
        return await self.put_all_if([(key, value)], guard_key=guard_key, guard_value=guard_value,
                                     guard_create_revision=guard_create_revision, lease=lease, timeout=timeout)

    @abc.abstractmethod
    async def put_all_if(
        self,
        items: Sequence[tuple[Key, Value]],
        *,
        guard_key: Key,
        guard_value: Value,
        guard_create_revision: int | None = None,
        guard_mod_revision: int | None = None,
        lease: Lease | int | None = None,
        timeout: float | None = None,
    ) -> int | None:
        """Put every (key, value) in one transaction (under ``lease``, if given), only while
        ``guard_key`` holds ``guard_value`` (and, if given, was created / last modified at those
        revisions); the write's revision, or None when the guard did not hold and nothing was
        written."""

    @abc.abstractmethod
    async def compare_and_swap(
        self,
        key: Key,
        value: Value,
        *,
        mod_revision: int,
        lease: Lease | int | None = None,
        timeout: float | None = None,
    ) -> int | None: ...

    @abc.abstractmethod
    async def delete_if(self, key: Key, *, value: Value, timeout: float | None = None) -> bool: ...

    # Watches.
    @abc.abstractmethod
    def watch(self, key: Key, *, start_revision: int | None = None) -> Watch: ...

    @abc.abstractmethod
    def watch_prefix(self, prefix: Key, *, start_revision: int | None = None) -> Watch: ...




_END = object()  # the underlying stream ended without an error


class Watch:
    """Events for a key or a prefix, in revision order.

    Use ``async with store.watch_prefix(p) as w: async for event in w: ...``. Leaving the block
    (or :meth:`cancel`, from any task) cancels the watch on the server and ends the iteration.
    A broken stream (etcd restarted, unreachable) raises :class:`StoreUnavailable`; resume with a
    new watch from ``last_revision + 1``, or, when that raises :class:`HistoryCompacted`, read the
    keys again and watch from that read's revision plus one (the daemon's watches only wake a
    loop that re-reads etcd, so they simply start a new watch from now). An etcd that is frozen (not dead) may leave the stream
    silent rather than broken, so loops that must act on time use :meth:`next` with a timeout.
    """

    def __init__(
        self,
        starter: Callable[[float | None], Awaitable[Any]],
        *,
        what: str,
        start_revision: int | None,
        event: Callable[[Any], WatchEvent],
        translate: Callable[[BaseException, str], StoreError],
    ) -> None:
        self._starter = starter
        self._event = event  # the client's raw event -> WatchEvent
        self._translate = translate  # the client's failure -> StoreError
        self._what = what
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._inner: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self.last_revision = (start_revision - 1) if start_revision else 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    async def start(self, *, timeout: float | None = None) -> Watch:
        """Create the watch on the server; events after this returns are not missed."""
        if self._inner is None and not self._cancelled:
            self._inner = await self._starter(timeout)
            # A pump task feeds our own queue so that a timed-out next() never closes
            # the client's async generator (cancelling it mid-await would end it for good).
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        return self

    async def _run_pump(self) -> None:
        try:
            async for event in self._inner:
                self._queue.put_nowait(event)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, translated, in next()
            self._queue.put_nowait(exc)

    async def next(self, timeout: float | None = None) -> WatchEvent | None:
        """The next event; ``None`` when ``timeout`` passes first or the watch was cancelled."""
        if self._error is not None:
            raise self._error
        if self._cancelled:
            return None
        if self._inner is None:
            await self.start()
        try:
            item = await bounded(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if item is _END:
            if self._cancelled:
                return None
            # aetcd ends a watch silently when its client is closed (e.g. on reconnect).
            self._error = StoreUnavailable(
                f"the {self._what} ended because the etcd connection was closed",
                hint=f"watch again from revision {self.last_revision + 1}",
            )
            raise self._error
        if isinstance(item, BaseException):
            self._error = self._translate(item, self._what)
            raise self._error
        event = self._event(item)
        self.last_revision = event.revision
        return event

    async def cancel(self) -> None:
        """Stop the watch on the server and end the iteration; safe to call more than once."""
        if self._cancelled:
            return
        self._cancelled = True
        self._queue.put_nowait(_END)  # wakes a consumer blocked in next()
        if self._inner is not None:
            try:
                # Best effort: when the stream is already broken there is nothing to cancel.
                await bounded(self._inner.cancel(), DEFAULT_TIMEOUT)
            except (Exception, asyncio.TimeoutError) as exc:
                log.debug("cancelling %s: %r", self._what, exc)
        if self._pump is not None:
            self._pump.cancel()
            # asyncio.wait, not `await pump`: a CancelledError from the pump must not be
            # confused with (and swallow) a cancellation of the caller.
            await asyncio.wait({self._pump})

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        event = await self.next()
        if event is None:
            raise StopAsyncIteration
        return event

    async def __aenter__(self) -> Watch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel()


# --------------------------------------------------------------------------- etcd
