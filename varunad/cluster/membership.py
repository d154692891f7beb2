"""Membership: every daemon registers ``members/<name>`` under its own lease and keeps it alive.

A member's key lives exactly as long as its lease: a VM that vanishes stops renewing, etcd
expires the lease within one TTL and deletes the key, and the leader re-plans. ``leave()``
revokes the lease at once (graceful shutdown on SIGTERM).

The node tracks ``lease_deadline`` on ``time.monotonic()`` (never the wall clock): the earliest
moment etcd may expire the lease, i.e. the send time of the last successful renewal plus the
TTL etcd granted. Until then the lease (and whatever hangs on it, such as the leader key) is
certainly alive; after it the node must assume it is gone. The election builds on this.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields

from varunad.store import schemas
from varunad.store.contract import Lease, LeaseExpired, Store, StoreError
from varunad.store.keys import Keys, check_component

__all__ = [
    "DEFAULT_TTL",
    "Member",
    "MembersSnapshot",
    "Membership",
    "NameInUse",
    "read_members",
]

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0
_NAME_POLL = 0.2  # while waiting for a previous incarnation's key to expire


class NameInUse(StoreError):
    """etcd holds this member name for another live daemon."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """What a daemon tells the fleet about itself (the value of ``members/<name>``)."""

    name: str
    host: str
    endpoint: str  # ZeroMQ endpoint the leader and peers reach this daemon at
    slots: int  # device slots, one trainer worker each
    device_kind: str  # e.g. "NVIDIA H200" or "cpu"; calibration is per device kind
    memory_bytes: int  # memory per device slot
    version: str  # varunad version, so a leader can refuse to mix incompatible daemons
    started_at: float  # wall-clock seconds, for display only; never used for deadlines

    def __post_init__(self) -> None:
        check_component("member name", self.name)
        for name in ("slots", "memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"member {self.name}: {name} must be a non-negative int, got {value!r}")
        for name in ("host", "endpoint", "device_kind", "version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"member {self.name}: {name} must be a string")

    def encode(self) -> bytes:
        # JSON so that `etcdctl get --prefix /varunad/members/` is readable by a person.
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Member:
        """Parse a stored value; fields added by newer daemons are ignored (rolling upgrades)."""
        try:
            raw = schemas.load_json(data)
        except ValueError as exc:
            raise ValueError(f"member value is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("member value is not a JSON object")
        known = {f.name for f in fields(cls)}
        # fields with a default are ones a release added: an older daemon's record lacks them
        missing = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING} - raw.keys()
        if missing:
            raise ValueError(f"member value lacks {sorted(missing)}")
        try:
            schemas.check(cls, raw, "member value")
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise ValueError(f"member value is malformed: {exc}") from exc


@dataclass(frozen=True, slots=True)
class MembersSnapshot:
    """All registered members at one etcd ``revision``, sorted by name."""

    revision: int
    members: tuple[Member, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def get(self, name: str) -> Member | None:
        return next((m for m in self.members if m.name == name), None)

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self.members)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)


async def read_members(store: Store, keys: Keys, *, timeout: float | None = None) -> MembersSnapshot:
    """One consistent read of ``members/``; entries that cannot be parsed are logged and skipped."""
    listing = await store.get_prefix(keys.members, timeout=timeout)
    members = []
    for kv in listing:
        try:
            name = keys.member_name(kv.key)
            member = Member.decode(kv.value)
        except ValueError as exc:
            # A bad entry (another version, a hand edit) must not stop the leader from planning.
            schemas.reject("member", kv.key, exc)
            continue
        if member.name != name:
            schemas.reject("member", kv.key, f"it describes {member.name!r}")
            continue
        members.append(member)
    return MembersSnapshot(listing.revision, tuple(sorted(members, key=lambda m: m.name)))


class Membership:
    """This daemon's registration: join, keep the lease alive from a task, leave.

    ``clock`` is ``time.monotonic`` except in tests that need a node whose sense of time is
    wrong (a paused VM).
    """

    def __init__(
        self,
        store: Store,
        keys: Keys,
        member: Member,
        *,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl < 2:
            raise ValueError(f"member lease TTL must be at least 2 s (etcd's minimum), got {ttl}")
        self.store = store
        self.keys = keys
        self.clock = clock
        self.ttl = float(ttl)
        self._member = member
        self._lease: Lease | None = None
        self._deadline = 0.0
        self._task: asyncio.Task[None] | None = None
        self._fence_task: asyncio.Task[None] | None = None
        self._on_expire: list[Callable[[], object]] = []
        # clock() when a renewal last failed or the lease lapsed (0.0: never): etcd had trouble,
        # so other members' keys may be missing for a while (varunad.control.outage)
        self.trouble_at = 0.0
        self._updating = 0

    @property
    def name(self) -> str:
        return self._member.name

    @property
    def member(self) -> Member:
        return self._member

    @property
    def key(self) -> str:
        return self.keys.member(self.name)

    @property
    def lease(self) -> Lease | None:
        """The current lease; it changes when the node registers again after losing one."""
        return self._lease

    @property
    def lease_deadline(self) -> float:
        """``clock()`` time before which etcd cannot have expired the lease (0.0 before join)."""
        return self._deadline

    def lease_valid(self) -> bool:
        return self._lease is not None and self._deadline > self.clock()

    @property
    def renew_interval(self) -> float:
        return self.ttl / 3

    # -- joining

    async def join(self, *, name_wait: float | None = None) -> None:
        """Register and start the keepalive task.

        A key left under this name by a previous incarnation (a crash, a quick restart) expires
        within its TTL; wait for that, at most ``name_wait`` seconds (default: what is left of
        its lease, plus one second and half a TTL for etcd to end it). Raises NameInUse if the
        name is still held after that.
        """
        if self._task is not None:
            raise RuntimeError(f"member {self.name} has already joined")
        await self._wait_for_name(name_wait)
        await self._register()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._keepalive(), name=f"varunad-keepalive-{self.name}")
        self._fence_task = loop.create_task(self._watch_deadline(), name=f"varunad-fence-{self.name}")

    def on_expire(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` (may be async) once per lease, as soon as its deadline passes unrenewed:
        etcd may have expired it, so the fleet may already have planned without this node."""
        self._on_expire.append(callback)

    async def _watch_deadline(self) -> None:
        fenced: int | None = None   # the lease whose expiry was reported
        while True:
            lease, left = self._lease, self._deadline - self.clock()
            if lease is None or left > 0 or fenced == lease.id:
                await asyncio.sleep(min(max(left, 0.02), 0.1) if lease is not None and fenced != lease.id else 0.1)
                continue
            fenced = lease.id
            log.warning("%s: lease %x not renewed within its %gs: fencing (etcd may have expired it)",
                        self.name, lease.id, self.ttl)
            for callback in self._on_expire:
                try:
                    result = callback()
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:
                    log.exception("%s: a fencing callback failed", self.name)

    async def _wait_for_name(self, name_wait: float | None) -> None:
        limit: float | None = None if name_wait is None else self.clock() + name_wait
        while True:
            held = await self.store.get(self.key)
            if held is None:
                return
            if held.lease == 0:
                raise NameInUse(
                    f"{self.key} exists without a lease, so it would never expire",
                    hint=f"delete it (etcdctl del {self.key}) or give this node another name",
                )
            if limit is None:
                remaining = await self.store.time_to_live(held.lease)
                # etcd ends a lease some time after its TTL runs out (its lessor checks every
                # 500 ms, then revokes through raft): on a loaded host more than a second after
                limit = self.clock() + (remaining if remaining is not None else 0) + 1.0 + self.ttl / 2
                log.info("%s: waiting up to %.1fs for the key of an earlier incarnation to expire",
                         self.name, limit - self.clock())
            if self.clock() >= limit:
                raise NameInUse(
                    f"another daemon is registered as {self.name!r} (lease {held.lease:x} is alive)",
                    hint="give every node a unique name (e.g. its hostname)",
                )
            await asyncio.sleep(_NAME_POLL)

    async def _register(self) -> None:
        sent = self.clock()
        lease = await self.store.grant(self.ttl)
        try:
            created = await self.store.create_if_absent(self.key, self._member.encode(), lease=lease)
        except BaseException:
            await self._revoke_quietly(lease)
            raise
        if not created:
            await self._revoke_quietly(lease)
            raise NameInUse(
                f"another daemon registered as {self.name!r} at the same moment",
                hint="give every node a unique name (e.g. its hostname)",
            )
        self._lease, self._deadline = lease, sent + lease.ttl
        log.info("%s: registered with lease %x (ttl %ds)", self.name, lease.id, lease.ttl)

    async def update(self, member: Member) -> int:
        """Publish changed facts (e.g. a slot lost to a failed device) under the same lease."""
        if member.name != self.name:
            raise ValueError(f"cannot rename member {self.name!r} to {member.name!r}; leave and join again")
        if self._lease is None:
            raise RuntimeError(f"member {self.name} is not registered")
        self._member = member
        self._updating += 1  # the guard must not take this write for someone else's
        try:
            return await self.store.put(self.key, member.encode(), lease=self._lease)
        finally:
            self._updating -= 1

    # -- keeping the lease alive

    async def renew(self) -> float:
        """Renew the lease once; returns the new deadline. Raises LeaseExpired or StoreError."""
        lease = self._lease
        if lease is None:
            raise LeaseExpired(f"member {self.name} holds no lease", hint="join first")
        sent = self.clock()
        ttl = await self.store.refresh(lease, timeout=self.renew_interval)
        # Measured from the send time, so a slow reply cannot stretch the deadline past etcd's.
        if self._lease is lease:
            self._deadline = max(self._deadline, sent + ttl)
        return self._deadline

    async def _keepalive(self) -> None:
        delay = self.renew_interval
        while True:
            await asyncio.sleep(delay)
            delay = self.renew_interval
            try:
                await self.renew()
            except LeaseExpired:
                log.warning("%s: lease expired (etcd or this node stalled); registering again", self.name)
                self.trouble_at = self.clock()
                self._lease = None
                try:
                    await self._register()
                except (StoreError, NameInUse) as exc:
                    log.warning("%s: could not register again: %s", self.name, exc)
                    if not isinstance(exc, NameInUse):
                        await self.store.reconnect()
                    delay = min(0.5, self.renew_interval / 2)
            except StoreError as exc:
                self.trouble_at = self.clock()
                left = self._deadline - self.clock()
                log.warning("%s: lease renewal failed (%s); the lease is certain for %.1fs more",
                            self.name, exc, max(left, 0.0))
                # a fresh connection for the next try: the old one may sit in TCP back-off long
                # after the link is back (measured: ~20 s to rejoin instead of ~1 s)
                await self.store.reconnect()
                delay = min(0.5, self.renew_interval / 2)
            except Exception:
                # A bug here must not end the heartbeat silently: log it and keep renewing.
                log.exception("%s: unexpected error while renewing the lease", self.name)
                delay = self.renew_interval / 2

    # -- guarding the key

    async def guard_key(self) -> None:
        """Keep ``members/<name>`` holding this member's facts under its lease (a task).

        A put by anyone else (``etcdctl put`` of the same key, a hand edit) replaces the value
        *and detaches the key from the lease*; a delete removes it while the lease lives on. Either
        way the fleet would lose this VM for good, since the keepalive only renews the lease. So
        the key is watched, and checked once per TTL besides (a watch gone silent; once per
        renewal was a third of a big fleet's etcd reads at rest), and written again at once."""
        while True:
            watch = self.store.watch(self.key)
            try:
                await watch.start(timeout=self.renew_interval)
                await self.restore_key()
                while True:
                    await watch.next(timeout=self.ttl)
                    await self.restore_key()
            except StoreError as exc:
                log.debug("%s: the watch of my key broke (%s); watching again", self.name, exc)
                await asyncio.sleep(min(1.0, self.renew_interval))
            finally:
                await watch.cancel()

    async def restore_key(self) -> bool:
        """Write the member key again if it is not this member's value under this lease; True if written."""
        lease = self._lease
        if lease is None or self._updating:
            return False  # the keepalive registers again when it can; an update is writing it now
        kv = await self.store.get(self.key, timeout=self.renew_interval)
        if kv is not None and kv.lease == lease.id and kv.value == self._member.encode():
            return False
        if self._lease is not lease:
            return False
        what = "deleted" if kv is None else f"overwritten (lease {kv.lease:x})"
        log.warning("%s: my member key was %s; registering it again under lease %x", self.name, what, lease.id)
        await self.store.put(self.key, self._member.encode(), lease=lease, timeout=self.renew_interval)
        return True

    # -- leaving

    async def _stop_keepalive(self) -> None:
        fence, self._fence_task = self._fence_task, None
        if fence is not None:
            fence.cancel()
            await asyncio.wait({fence})
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # asyncio.wait, not `await task`: the task's CancelledError must not be confused
            # with (and swallow) a cancellation of the caller.
            await asyncio.wait({task})

    async def leave(self) -> None:
        """Stop renewing and revoke the lease, which deletes the member key (and a leader key) now."""
        await self._stop_keepalive()
        lease, self._lease, self._deadline = self._lease, None, 0.0
        if lease is not None:
            await self._revoke_quietly(lease)
            log.info("%s: left the fleet", self.name)

    async def abandon(self) -> None:
        """Stop renewing without revoking: the lease runs out as if this node had crashed."""
        await self._stop_keepalive()

    async def _revoke_quietly(self, lease: Lease) -> None:
        try:
            await self.store.revoke(lease)
        except StoreError as exc:
            # Leaving must not fail: etcd expires the lease within one TTL anyway.
            log.warning("%s: could not revoke lease %x (%s); it expires within %ss",
                        self.name, lease.id, exc, lease.ttl)
