"""The store contract (``varunad.store.contract``) on etcd v3 through aetcd: ``EtcdStore``.

This module owns the contract's requests (reads, writes, leases, guarded writes, watches), each a
short request through ``_call``, and the conversion of aetcd's replies into the contract's plain
immutable values, so nothing above depends on aetcd types. The connection they go through
(endpoints, TLS and auth, rotation over the endpoints after an unavailable error, ``_call``'s
timeout and error translation) is ``EtcdConnection`` in ``etcd_connection``, ``EtcdStore``'s base;
``parse_endpoints`` lives there too and is imported from here. With ``etcd_connection`` and
``etcd_client`` (aetcd's client with TLS, and its failures as ``StoreError``) the only modules that
import the etcd client.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from typing import Any

import aetcd
import aetcd.rpc
import aetcd.transactions as _tx
import aetcd.utils

from varunad.store.contract import (
    DELETE,
    PUT,
    Key,
    KeyValue,
    Lease,
    LeaseExpired,
    Listing,
    Store,
    StoreUnavailable,
    Value,
    Watch,
    WatchEvent,
)

# etcd_client first: it sets gRPC's fork handling before aetcd (under it) loads grpc
from varunad.store.etcd_client import HINT_UNAVAILABLE, Client, rpc_code, translate
from varunad.store.etcd_connection import EtcdConnection, _encode, parse_endpoints

__all__ = ["EtcdStore", "parse_endpoints"]


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


class EtcdStore(EtcdConnection, Store):
    """:class:`Store` on etcd v3 through aetcd.

    ``endpoints`` is ``"host:port[,host:port]"``. Requests go to one endpoint at a time; after an
    unavailable error the next request goes to the next endpoint (with a single endpoint the
    gRPC channel reconnects by itself). TLS: ``ca_file`` alone for server verification, plus
    ``cert_file``/``key_file`` for client certificates. ``user``/``password`` for etcd auth.
    ``probe_key``: what the connection check reads; the key root, for a user limited to it.
    """

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
        self, key: Key, value: Value, *, lease: Lease | int | None = None, timeout: float | None = None,
        also: Sequence[tuple[Key, Value | None]] = (),
    ) -> bool:
        k = _encode(key)
        rest = [_tx.Delete(_encode(ak)) if av is None else _tx.Put(_encode(ak), _encode(av)) for ak, av in also]
        rev = await self._txn(
            f"create {key!r}",
            [_tx.Create(k) == 0],
            [*rest, _tx.Put(k, _encode(value), lease=_lease_id(lease))],
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
