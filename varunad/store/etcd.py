"""The control plane's only door to etcd: one small async contract and its etcd implementation.

This is the only module in the tree that imports the etcd client (``aetcd``). Everything it
returns is a plain immutable value defined here, so nothing above it depends on aetcd types.

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
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union

# Before grpc (under aetcd) is imported: its fork handlers crash children forked while another
# thread is inside gRPC (about 1 in 8 in a stress test), and the daemon forks every worker. The
# children exec at once and never use gRPC, so they need no such handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.client
import aetcd.exceptions
import aetcd.rpc
import aetcd.transactions as _tx
import aetcd.utils
import aetcd.watcher
import grpc

__all__ = [
    "StoreError",
    "StoreConfigError",
    "StoreUnavailable",
    "StoreAuthError",
    "LeaseExpired",
    "WatchCompacted",
    "KeyValue",
    "Listing",
    "WatchEvent",
    "PUT",
    "DELETE",
    "Lease",
    "Watch",
    "Store",
    "EtcdStore",
    "parse_endpoints",
    "DEFAULT_TIMEOUT",
    "Key",
    "Value",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
PUT = "put"
DELETE = "delete"

Key = Union[str, bytes]
Value = Union[str, bytes]
T = TypeVar("T")

_HINT_UNAVAILABLE = (
    "check that etcd runs and answers at the endpoints given (etcdctl --endpoints=... endpoint "
    "health), that this host can reach them, and that the TLS settings match the server"
)
_HINT_AUTH = (
    "check the etcd user and password (or client certificate) and that the user's role may "
    "read and write the varunad key root"
)


# --------------------------------------------------------------------------- errors


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


class WatchCompacted(StoreError):
    """A watch asked for history that etcd has compacted away."""

    def __init__(self, message: str, *, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(
            message,
            hint="read the prefix again and watch from the revision of that read plus one",
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

    async def _bounded(aw: Awaitable[T], timeout: float | None) -> T:
        """``await aw`` for at most ``timeout`` seconds (TimeoutError after).

        Not asyncio.wait_for: before 3.12 it swallows a cancellation that arrives just as the
        awaited call completes, so cancelling the election loop could silently fail.
        """
        async with asyncio.timeout(timeout):
            return await aw

else:  # pragma: no cover - 3.10 has no asyncio.timeout; accept wait_for's rare race there
    _bounded = asyncio.wait_for


def _encode(data: Key) -> bytes:
    # surrogateescape lets a key that is not UTF-8 (written by another tool) round-trip.
    return data if isinstance(data, bytes) else data.encode("utf-8", "surrogateescape")


def _decode_key(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        key=_decode_key(raw.key),
        value=bytes(raw.value),
        create_revision=raw.create_revision,
        mod_revision=raw.mod_revision,
        version=raw.version,
        lease=raw.lease,
    )


def _lease_id(lease: Lease | int | None) -> int:
    if lease is None:
        return 0
    return lease.id if isinstance(lease, Lease) else int(lease)


# --------------------------------------------------------------------------- the contract


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
        """The key now, or as it was at ``revision`` (its previous values, until etcd compacts them)."""

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
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None
    ) -> bool: ...

    # Guarded writes.
    @abc.abstractmethod
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
    ) -> int | None: ...

    @abc.abstractmethod
    async def put_all_if(
        self,
        items: Sequence[tuple[Key, Value]],
        *,
        guard_key: Key,
        guard_value: Value,
        guard_create_revision: int | None = None,
        guard_mod_revision: int | None = None,
        timeout: float | None = None,
    ) -> int | None:
        """Put every (key, value) in one transaction, only while ``guard_key`` holds ``guard_value``
        (and, if given, was created / last modified at those revisions); the write's revision, or
        None when the guard did not hold and nothing was written."""

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


# --------------------------------------------------------------------------- watches

_END = object()  # the underlying stream ended without an error


class Watch:
    """Events for a key or a prefix, in revision order.

    Use ``async with store.watch_prefix(p) as w: async for event in w: ...``. Leaving the block
    (or :meth:`cancel`, from any task) cancels the watch on the server and ends the iteration.
    A broken stream (etcd restarted, unreachable) raises :class:`StoreUnavailable`; resume with a
    new watch from ``last_revision + 1``. An etcd that is frozen (not dead) may leave the stream
    silent rather than broken, so loops that must act on time use :meth:`next` with a timeout.
    """

    def __init__(
        self,
        starter: Callable[[float | None], Awaitable[Any]],
        *,
        what: str,
        start_revision: int | None,
    ) -> None:
        self._starter = starter
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
            item = await _bounded(self._queue.get(), timeout)
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
            self._error = _translate(item, self._what, None)
            raise self._error
        event = WatchEvent(
            kind=PUT if item.kind == "PUT" else DELETE,
            key=_decode_key(item.kv.key),
            value=bytes(item.kv.value),
            revision=item.kv.mod_revision,
        )
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
                await _bounded(self._inner.cancel(), DEFAULT_TIMEOUT)
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


def parse_endpoints(spec: str | Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``"host:port[,host:port]"`` (an ``http://``/``https://`` prefix is allowed) -> ((host, port), ...)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        text = item.strip()
        for scheme in ("http://", "https://"):
            if text.startswith(scheme):
                text = text[len(scheme):]
        text = text.rstrip("/")
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreConfigError(
                f"etcd endpoint {item!r} is not host:port",
                hint="write endpoints like 10.0.0.5:2379,10.0.0.6:2379",
            )
        out.append((host, int(port)))
    if not out:
        raise StoreConfigError("no etcd endpoint given", hint="write endpoints like 10.0.0.5:2379")
    return tuple(out)


# gRPC's reconnect backoff grows to two minutes by default; after an etcd restart a node must
# see etcd again well within one lease TTL. Calibration prefixes can exceed the 4 MiB default.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # A connection whose packets vanish (a partition, no reset) is found dead by a ping, not by
    # TCP's retransmission back-off (minutes). 10 s: etcd's --grpc-keepalive-min-time is 5 s and
    # a client pinging more often is sent away. Faster detection is EtcdStore.reconnect's job.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.max_receive_message_length": 256 * 2**20,
}


class _Client(aetcd.Client):
    """aetcd.Client that can also open a TLS channel (aetcd 1.0 only opens insecure ones).

    The TLS branch repeats aetcd's ``connect`` with ``secure_channel``; keep it in step when
    aetcd is upgraded (the store tests run a TLS etcd to catch a mismatch).
    """

    def __init__(self, *, credentials: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @aetcd.client._handle_errors
    @aetcd.client._ensure_connected
    async def get_at(self, key: bytes, revision: int) -> Any:
        """aetcd's ``get`` at an older revision (aetcd 1.0 has no such argument)."""
        request = aetcd.rpc.RangeRequest(key=key, revision=revision)
        response = await self.kvstub.Range(request, timeout=self._timeout, metadata=self.metadata)
        return response.kvs[0] if response.count >= 1 else None

    async def connect(self) -> None:
        if self._credentials is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = aetcd.rpc.secure_channel(
                target, self._credentials, options=list(self._options.items())
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def _rpc_code(exc: BaseException) -> Any:
    cause = exc if isinstance(exc, aetcd.rpc.AioRpcError) else exc.__cause__
    return cause.code() if isinstance(cause, aetcd.rpc.AioRpcError) else None


_AUTH_MESSAGES = (
    "user name is empty",
    "authentication failed",
    "permission denied",
    "invalid auth token",
)


def _translate(exc: BaseException, what: str, endpoint: str | None) -> StoreError:
    """One StoreError for any client, gRPC or timeout failure, saying what to check."""
    where = f"etcd at {endpoint}" if endpoint else "etcd"
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, aetcd.RevisionCompactedError):
        return WatchCompacted(
            f"{what}: {where} has compacted history below revision {exc.compacted_revision}",
            compact_revision=exc.compacted_revision,
        )
    code = _rpc_code(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return StoreUnavailable(f"{where} did not answer {what} in time", hint=_HINT_UNAVAILABLE)
    if isinstance(exc, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError)) or code in (
        aetcd.rpc.StatusCode.UNAVAILABLE,
        aetcd.rpc.StatusCode.DEADLINE_EXCEEDED,
        aetcd.rpc.StatusCode.CANCELLED,
    ):
        return StoreUnavailable(f"{where} is unreachable for {what}: {exc}", hint=_HINT_UNAVAILABLE)
    # etcd reports some auth failures as INVALID_ARGUMENT, so the message decides too.
    if (
        isinstance(exc, aetcd.exceptions.UnauthenticatedError)
        or code in (aetcd.rpc.StatusCode.UNAUTHENTICATED, aetcd.rpc.StatusCode.PERMISSION_DENIED)
        or any(m in str(exc) for m in _AUTH_MESSAGES)
    ):
        return StoreAuthError(f"{where} refused {what}: {exc}", hint=_HINT_AUTH)
    return StoreError(f"{where} failed {what}: {exc}", hint="see the etcd server log for details")


class EtcdStore(Store):
    """:class:`Store` on etcd v3 through aetcd.

    ``endpoints`` is ``"host:port[,host:port]"``. Requests go to one endpoint at a time; after an
    unavailable error the next request goes to the next endpoint (with a single endpoint the
    gRPC channel reconnects by itself). TLS: ``ca_file`` alone for server verification, plus
    ``cert_file``/``key_file`` for client certificates. ``user``/``password`` for etcd auth.
    ``probe_key``: what the connection check reads; the key root, for a user limited to it.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        user: str | None = None,
        password: str | None = None,
        probe_key: Key = b"\0",
    ) -> None:
        if timeout <= 0:
            raise StoreConfigError(f"etcd timeout must be positive, got {timeout}")
        if (cert_file is None) != (key_file is None):
            raise StoreConfigError(
                "an etcd client certificate needs both cert_file and key_file",
                hint="give both, or neither",
            )
        if (user is None) != (password is None):
            raise StoreConfigError("etcd auth needs both user and password", hint="give both, or neither")
        self._endpoints = parse_endpoints(endpoints)
        self._timeout = float(timeout)
        self._tls_files = (ca_file, cert_file, key_file)
        self._tls = any(f is not None for f in self._tls_files)
        self._user = user
        self._password = password
        # The key the connection check and revision() read. A user whose role may only touch the
        # fleet's prefix is refused any other key (even a missing one), so pass the key root.
        self._probe = _encode(probe_key)
        self._client: _Client | None = None
        self._index = 0
        self._rotate = False
        self._closed = False
        self._lock = asyncio.Lock()
        self._closing: dict[asyncio.Task[None], _Client] = {}   # old channels closed after a reconnect

    @property
    def endpoint(self) -> str:
        """The endpoint requests currently go to."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    @property
    def timeout(self) -> float:
        return self._timeout

    def __repr__(self) -> str:
        eps = ",".join(f"{h}:{p}" for h, p in self._endpoints)
        return f"EtcdStore({eps!r}, timeout={self._timeout}, tls={self._tls})"

    # -- connection management

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self._tls:
            return None
        ca, cert, key = (self._read_tls_file(p) for p in self._tls_files)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    @staticmethod
    def _read_tls_file(path: str | Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise StoreConfigError(f"cannot read etcd TLS file {path}: {exc}", hint="fix the path or its permissions") from exc

    def _new_client(self, index: int) -> _Client:
        host, port = self._endpoints[index]
        return _Client(
            credentials=self._credentials(),
            host=host,
            port=port,
            username=self._user,
            password=self._password,
            timeout=self._timeout,
            options=dict(_CHANNEL_OPTIONS),
        )

    async def connect(self) -> None:
        """Connect to the first endpoint that answers; StoreUnavailable if none does in time."""
        self._closed = False
        try:
            await _bounded(self._ensure_client(), self._timeout * len(self._endpoints))
        except asyncio.TimeoutError:
            # e.g. authenticating (etcd checks the password with bcrypt) took longer than the
            # bound; a bare TimeoutError would escape the callers' retry loops as an empty error
            raise StoreUnavailable(f"etcd at {self.endpoint} did not answer a first read in time",
                                   hint=_HINT_UNAVAILABLE) from None

    async def _ensure_client(self) -> _Client:
        if self._closed:
            raise StoreError("the store is closed", hint="open a new store; close() is final")
        if self._client is not None and not self._rotate:
            return self._client
        async with self._lock:
            if self._client is not None and self._rotate:
                old, self._client = self._client, None
                self._index = (self._index + 1) % len(self._endpoints)
                await self._close_client(old)
            self._rotate = False
            if self._client is not None:
                return self._client
            failures = []
            # Each endpoint gets a share of the time, so one frozen etcd cannot use it all.
            per_endpoint = self._timeout / len(self._endpoints)
            for step in range(len(self._endpoints)):
                index = (self._index + step) % len(self._endpoints)
                client = self._new_client(index)
                try:
                    await _bounded(client.get(self._probe), per_endpoint)
                except (Exception, asyncio.TimeoutError) as exc:
                    await self._close_client(client)
                    err = _translate(exc, "a first read", "%s:%d" % self._endpoints[index])
                    if not isinstance(err, StoreUnavailable):
                        raise err from exc  # wrong credentials will not improve elsewhere
                    failures.append(err.reason)   # the hint once, after all of them
                    continue
                self._index, self._client = index, client
                return client
            raise StoreUnavailable(
                "no etcd endpoint answered: " + "; ".join(failures), hint=_HINT_UNAVAILABLE
            )

    @staticmethod
    async def _close_client(client: _Client) -> None:
        try:
            await _bounded(client.close(), 1.0)
        except (Exception, asyncio.TimeoutError) as exc:  # a dying channel cannot be helped
            log.debug("closing etcd client: %r", exc)

    async def reconnect(self) -> None:
        """Drop the channel: the next call opens a fresh connection. After a call timed out on a
        link that went away and came back, the old TCP connection sits in retransmission
        back-off (seconds to minutes between tries); a new one is answered at once."""
        async with self._lock:
            client, self._client = self._client, None
        if client is not None:
            # calls in flight on the old channel keep it until their own deadlines
            task = asyncio.get_running_loop().create_task(self._close_later(client, self._timeout))
            self._closing[task] = client
            task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def _close_later(self, client: _Client, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._close_client(client)

    async def close(self) -> None:
        self._closed = True
        for task, old in list(self._closing.items()):
            task.cancel()
            await self._close_client(old)
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)

    async def _call(
        self, what: str, op: Callable[[_Client], Awaitable[T]], timeout: float | None
    ) -> T:
        limit = self._timeout if timeout is None else timeout
        if limit <= 0:
            raise StoreUnavailable(f"no time left to {what}", hint="the caller's deadline has passed")
        retried_auth = False

        async def attempt() -> T:
            nonlocal retried_auth
            while True:
                client = await self._ensure_client()
                try:
                    return await op(client)
                except (Exception, asyncio.TimeoutError) as exc:
                    err = _translate(exc, what, self.endpoint)
                    # Simple auth tokens expire (5 min by default): re-authenticate once. The
                    # request was refused, not applied, so repeating it is safe.
                    if isinstance(err, StoreAuthError) and self._user and not retried_auth:
                        log.info("etcd refused %s (%s); authenticating again", what, exc)
                        retried_auth = True
                        self._client = None
                        await self._close_client(client)
                        continue
                    raise err from exc

        try:
            return await _bounded(attempt(), limit)
        except asyncio.TimeoutError as exc:
            self._rotate = len(self._endpoints) > 1
            raise StoreUnavailable(
                f"etcd at {self.endpoint} did not answer {what} within {limit:.1f}s",
                hint=_HINT_UNAVAILABLE,
            ) from exc
        except StoreUnavailable:
            self._rotate = len(self._endpoints) > 1
            raise

    # -- plain reads and writes

    async def get(self, key: Key, *, timeout: float | None = None, revision: int | None = None) -> KeyValue | None:
        if revision is not None:
            raw = await self._call(f"get {key!r} at revision {revision}", lambda c: c.get_at(_encode(key), revision),
                                   timeout)
        else:
            raw = await self._call(f"get {key!r}", lambda c: c.get(_encode(key)), timeout)
        return None if raw is None else _kv(raw)

    async def get_prefix(self, prefix: Key, *, timeout: float | None = None) -> Listing:
        raw = await self._call(
            f"read prefix {prefix!r}",
            lambda c: c.get_prefix(_encode(prefix), sort_order="ascend", sort_target="key"),
            timeout,
        )
        return Listing(revision=raw.header.revision, items=tuple(_kv(kv) for kv in raw.kvs))

    async def put(
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None
    ) -> int:
        raw = await self._call(
            f"put {key!r}", lambda c: c.put(_encode(key), _encode(value), lease=_lease_id(lease)), timeout
        )
        return raw.header.revision

    async def delete(self, key: Key, *, timeout: float | None = None) -> bool:
        raw = await self._call(f"delete {key!r}", lambda c: c.delete(_encode(key)), timeout)
        return raw is not None

    async def delete_prefix(self, prefix: Key, *, timeout: float | None = None) -> int:
        raw = await self._call(
            f"delete prefix {prefix!r}", lambda c: c.delete_prefix(_encode(prefix)), timeout
        )
        return raw.deleted

    async def revision(self, *, timeout: float | None = None) -> int:
        # A range over the one probe key (the key root: never a value) returns just the header.
        raw = await self._call("read the revision", lambda c: c.get_range(self._probe, self._probe + b"\0"), timeout)
        return raw.header.revision

    # -- leases

    async def grant(self, ttl: float, *, timeout: float | None = None) -> Lease:
        if not ttl > 0:
            raise ValueError(f"lease TTL must be positive, got {ttl}")
        # etcd counts whole seconds and may raise a small TTL to its minimum; keep what it granted.
        raw = await self._call(f"grant a {ttl}s lease", lambda c: c.lease(math.ceil(ttl)), timeout)
        return Lease(id=raw.id, ttl=raw.ttl, _store=self)

    async def refresh(self, lease: Lease | int, *, timeout: float | None = None) -> int:
        lease_id = _lease_id(lease)
        reply = await self._call(f"refresh lease {lease_id:x}", lambda c: c.refresh_lease(lease_id), timeout)
        if reply is None:
            raise StoreUnavailable(
                f"etcd at {self.endpoint} closed the keepalive stream of lease {lease_id:x}",
                hint=_HINT_UNAVAILABLE,
            )
        if reply.TTL <= 0:
            raise LeaseExpired(
                f"lease {lease_id:x} has expired or was revoked",
                hint="grant a new lease and register the keys again",
            )
        return reply.TTL

    async def revoke(self, lease: Lease | int, *, timeout: float | None = None) -> None:
        lease_id = _lease_id(lease)

        async def op(c: _Client) -> None:
            try:
                await c.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                # Revoking a lease that is already gone is what the caller wanted anyway.
                if _rpc_code(exc) != aetcd.rpc.StatusCode.NOT_FOUND and "not found" not in str(exc):
                    raise

        await self._call(f"revoke lease {lease_id:x}", op, timeout)

    async def time_to_live(self, lease: Lease | int, *, timeout: float | None = None) -> int | None:
        lease_id = _lease_id(lease)
        info = await self._call(
            f"query lease {lease_id:x}", lambda c: c.get_lease_info(lease_id, keys=False), timeout
        )
        return None if info.TTL < 0 else info.TTL

    # -- compare-and-create and guarded writes

    async def _txn(self, what: str, compare: list[Any], success: list[Any], timeout: float | None) -> int | None:
        async def op(c: _Client) -> int | None:
            ok, responses = await c.transaction(compare=compare, success=success, failure=[])
            if not ok:
                return None
            first = responses[0]
            return getattr(first, first.WhichOneof("response")).header.revision

        return await self._call(what, op, timeout)

    async def create_if_absent(
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None
    ) -> bool:
        k = _encode(key)
        rev = await self._txn(
            f"create {key!r}",
            [_tx.Create(k) == 0],
            [_tx.Put(k, _encode(value), lease=_lease_id(lease))],
            timeout,
        )
        return rev is not None

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
        g = _encode(guard_key)
        compare = [_tx.Value(g) == _encode(guard_value)]
        if guard_create_revision is not None:
            compare.append(_tx.Create(g) == guard_create_revision)
        return await self._txn(
            f"put {key!r} guarded by {guard_key!r}",
            compare,
            [_tx.Put(_encode(key), _encode(value), lease=_lease_id(lease))],
            timeout,
        )

    async def put_all_if(
        self,
        items: Sequence[tuple[Key, Value]],
        *,
        guard_key: Key,
        guard_value: Value,
        guard_create_revision: int | None = None,
        guard_mod_revision: int | None = None,
        timeout: float | None = None,
    ) -> int | None:
        if not items:
            raise ValueError("put_all_if needs at least one key to write")
        g = _encode(guard_key)
        compare = [_tx.Value(g) == _encode(guard_value)]
        if guard_create_revision is not None:
            compare.append(_tx.Create(g) == guard_create_revision)
        if guard_mod_revision is not None:
            compare.append(_tx.Mod(g) == guard_mod_revision)
        return await self._txn(
            f"put {', '.join(repr(k) for k, _ in items)} guarded by {guard_key!r}",
            compare,
            [_tx.Put(_encode(k), _encode(v)) for k, v in items],
            timeout,
        )

    async def compare_and_swap(
        self,
        key: Key,
        value: Value,
        *,
        mod_revision: int,
        lease: Lease | int | None = None,
        timeout: float | None = None,
    ) -> int | None:
        k = _encode(key)
        # An absent key compares as mod revision 0, so mod_revision=0 means "create".
        return await self._txn(
            f"swap {key!r} at revision {mod_revision}",
            [_tx.Mod(k) == mod_revision],
            [_tx.Put(k, _encode(value), lease=_lease_id(lease))],
            timeout,
        )

    async def delete_if(self, key: Key, *, value: Value, timeout: float | None = None) -> bool:
        k = _encode(key)
        rev = await self._txn(
            f"delete {key!r} if unchanged", [_tx.Value(k) == _encode(value)], [_tx.Delete(k)], timeout
        )
        return rev is not None

    # -- watches

    def watch(self, key: Key, *, start_revision: int | None = None) -> Watch:
        k = _encode(key)
        return self._watch(f"watch of {key!r}", k, None, start_revision)

    def watch_prefix(self, prefix: Key, *, start_revision: int | None = None) -> Watch:
        p = _encode(prefix)
        return self._watch(f"watch of prefix {prefix!r}", p, aetcd.utils.prefix_range_end(p), start_revision)

    def _watch(self, what: str, key: bytes, range_end: bytes | None, start_revision: int | None) -> Watch:
        def starter(timeout: float | None) -> Awaitable[Any]:
            return self._call(
                f"start the {what}",
                lambda c: c.watch(key, range_end=range_end, start_revision=start_revision),
                timeout,
            )

        return Watch(starter, what=what, start_revision=start_revision)
