"""The store contract (``varunad.store.contract``) on etcd v3 through aetcd: ``EtcdStore``.

With ``etcd_client`` (aetcd's client with TLS, and its failures as ``StoreError``) the only modules
that import the etcd client. Everything they return is a plain immutable value of the contract, so
nothing above depends on aetcd types. Requests rotate over the endpoints after an unavailable error.
One module over 500 lines because it is one class, ``EtcdStore``, whose every method is a short
request through the same ``_call`` (timeout, endpoint rotation, error translation).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import aetcd.transactions as _tx
import aetcd.utils
import grpc

from varunad.store.contract import (
    DEFAULT_TIMEOUT,
    DELETE,
    PUT,
    Key,
    KeyValue,
    Lease,
    LeaseExpired,
    Listing,
    Store,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    Value,
    Watch,
    WatchEvent,
    bounded,
)

# etcd_client first: it sets gRPC's fork handling before aetcd (under it) loads grpc
from varunad.store.etcd_client import CHANNEL_OPTIONS, HINT_UNAVAILABLE, Client, rpc_code, translate

__all__ = ["EtcdStore", "parse_endpoints"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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


def _event(raw: Any) -> WatchEvent:
    return WatchEvent(
        kind=PUT if raw.kind == "PUT" else DELETE,
        key=_decode_key(raw.kv.key),
        value=bytes(raw.kv.value),
        revision=raw.kv.mod_revision,
    )


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
        self._client: Client | None = None
        self._index = 0
        self._rotate = False
        self._closed = False
        self._lock = asyncio.Lock()
        self._closing: dict[asyncio.Task[None], Client] = {}   # old channels closed after a reconnect

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

    def _new_client(self, index: int) -> Client:
        host, port = self._endpoints[index]
        return Client(
            credentials=self._credentials(),
            host=host,
            port=port,
            username=self._user,
            password=self._password,
            timeout=self._timeout,
            options=dict(CHANNEL_OPTIONS),
        )

    async def connect(self) -> None:
        """Connect to the first endpoint that answers; StoreUnavailable if none does in time."""
        self._closed = False
        try:
            await bounded(self._ensure_client(), self._timeout * len(self._endpoints))
        except asyncio.TimeoutError:
            # e.g. authenticating (etcd checks the password with bcrypt) took longer than the
            # bound; a bare TimeoutError would escape the callers' retry loops as an empty error
            raise StoreUnavailable(f"etcd at {self.endpoint} did not answer a first read in time",
                                   hint=HINT_UNAVAILABLE) from None

    async def _ensure_client(self) -> Client:
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
                    await bounded(client.get(self._probe), per_endpoint)
                except (Exception, asyncio.TimeoutError) as exc:
                    await self._close_client(client)
                    err = translate(exc, "a first read", "%s:%d" % self._endpoints[index])
                    if not isinstance(err, StoreUnavailable):
                        raise err from exc  # wrong credentials will not improve elsewhere
                    failures.append(err.reason)   # the hint once, after all of them
                    continue
                self._index, self._client = index, client
                return client
            raise StoreUnavailable(
                "no etcd endpoint answered: " + "; ".join(failures), hint=HINT_UNAVAILABLE
            )

    @staticmethod
    async def _close_client(client: Client) -> None:
        try:
            await bounded(client.close(), 1.0)
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

    async def _close_later(self, client: Client, delay: float) -> None:
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
        self, what: str, op: Callable[[Client], Awaitable[T]], timeout: float | None
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
                    err = translate(exc, what, self.endpoint)
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
            return await bounded(attempt(), limit)
        except asyncio.TimeoutError as exc:
            self._rotate = len(self._endpoints) > 1
            raise StoreUnavailable(
                f"etcd at {self.endpoint} did not answer {what} within {limit:.1f}s",
                hint=HINT_UNAVAILABLE,
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
                hint=HINT_UNAVAILABLE,
            )
        if reply.TTL <= 0:
            raise LeaseExpired(
                f"lease {lease_id:x} has expired or was revoked",
                hint="grant a new lease and register the keys again",
            )
        return reply.TTL

    async def revoke(self, lease: Lease | int, *, timeout: float | None = None) -> None:
        lease_id = _lease_id(lease)

        async def op(c: Client) -> None:
            try:
                await c.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                # Revoking a lease that is already gone is what the caller wanted anyway.
                if rpc_code(exc) != aetcd.rpc.StatusCode.NOT_FOUND and "not found" not in str(exc):
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
        async def op(c: Client) -> int | None:
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
            [_tx.Put(_encode(k), _encode(v), lease=_lease_id(lease)) for k, v in items],
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

        return Watch(starter, what=what, start_revision=start_revision, event=_event,
                     translate=lambda exc, what: translate(exc, what, None))
