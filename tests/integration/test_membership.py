"""varunad.cluster.membership against a real etcd: registration, keepalive, expiry, leave."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.fleet import make_member
from support.waiting import until_async

from varunad.cluster.membership import Membership, NameInUse, read_members
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

TTL = 2.0
MARGIN = 2.5  # etcd checks expiry every 500 ms; loaded CI machines are slower still


async def test_two_members_see_each_other(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        a = Membership(store, keys, make_member("a"), ttl=TTL)
        b = Membership(store, keys, make_member("b", slots=4, device_kind="NVIDIA H200"), ttl=TTL)
        await a.join()
        await b.join()
        try:
            snapshot = await read_members(store, keys)
            assert snapshot.names == ("a", "b")
            assert snapshot.get("b") == make_member("b", slots=4, device_kind="NVIDIA H200")
            assert "a" in snapshot and len(snapshot) == 2
            assert snapshot.revision >= (await store.get(keys.member("b"))).mod_revision
            assert a.lease_valid() and a.lease_deadline > time.monotonic()
            assert a.lease.id != b.lease.id
        finally:
            await a.leave()
            await b.leave()


async def test_member_whose_keepalive_stops_disappears_within_ttl(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        crashed = Membership(store, keys, make_member("crashed"), ttl=TTL)
        alive = Membership(store, keys, make_member("alive"), ttl=TTL)
        await crashed.join()
        await alive.join()
        await crashed.abandon()  # keepalive cancelled, lease not revoked: like a vanished VM
        stopped = time.monotonic()

        async def crashed_gone():
            return "crashed" not in await read_members(store, keys)

        await until_async(crashed_gone, timeout=TTL + MARGIN, interval=0.1, what="expiry of the crashed member")
        elapsed = time.monotonic() - stopped
        # Its own deadline had passed by then: the node knew before (or when) the fleet did.
        assert crashed.lease_deadline <= time.monotonic() and not crashed.lease_valid()
        # The renewed member outlived one TTL since it joined: the keepalive works.
        assert "alive" in await read_members(store, keys)
        assert alive.lease_valid()
        assert elapsed > 0.5  # not deleted by anything but expiry
        await alive.leave()


async def test_leave_removes_the_member_at_once(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        m = Membership(store, keys, make_member("leaving"), ttl=TTL)
        await m.join()
        assert await store.get(keys.member("leaving")) is not None
        lease = m.lease
        await m.leave()
        assert await store.get(keys.member("leaving")) is None
        assert await lease.time_to_live() is None
        assert m.lease is None and not m.lease_valid()
        await m.leave()  # twice is harmless


async def test_renewals_move_the_deadline_and_a_lost_lease_is_replaced(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        m = Membership(store, keys, make_member("m"), ttl=TTL)
        await m.join()
        first_deadline, first_lease = m.lease_deadline, m.lease
        await until_async(lambda: m.lease_deadline > first_deadline, timeout=TTL, what="a renewal")
        # etcd forgets the lease behind the node's back (e.g. etcd was frozen past the TTL).
        await store.revoke(first_lease)

        await until_async(lambda: m.lease is not None and m.lease.id != first_lease.id,
                         timeout=TTL + MARGIN, what="registration under a new lease")
        assert m.lease_valid()
        assert (await store.get(keys.member("m"))).lease == m.lease.id
        await m.update(make_member("m", slots=1))
        assert (await read_members(store, keys)).get("m").slots == 1
        await m.leave()


async def test_duplicate_name_is_refused_and_a_restart_waits_for_the_old_key(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        first = Membership(store, keys, make_member("dup"), ttl=TTL)
        await first.join()
        started = time.monotonic()
        with pytest.raises(NameInUse, match="unique name"):
            await Membership(store, keys, make_member("dup"), ttl=TTL).join(name_wait=0.5)
        assert time.monotonic() - started < 0.5 + 1.0
        # The first incarnation crashes; its successor waits for the old key, then registers.
        await first.abandon()
        second = Membership(store, keys, make_member("dup", version="0.2.0"), ttl=TTL)
        await second.join()
        assert (await read_members(store, keys)).get("dup").version == "0.2.0"
        assert second.lease.id != first.lease.id
        await second.leave()


async def test_unparseable_member_values_are_skipped(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.member("junk"), b"not json")
        await store.put(keys.member("other"), make_member("someone-else").encode())
        await store.put(keys.members + "x/nested", make_member("x").encode())
        await store.put(keys.member("good"), make_member("good").encode())
        assert (await read_members(store, keys)).names == ("good",)


async def test_member_survives_an_etcd_restart_shorter_than_its_ttl(etcd_fault, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd_fault.endpoint, timeout=1.0) as store:
        m = Membership(store, keys, make_member("steady"), ttl=5)
        await m.join()
        lease = m.lease
        # In a thread, so the keepalive keeps trying (and failing) while etcd is away.
        await asyncio.to_thread(etcd_fault.stop)
        await asyncio.to_thread(etcd_fault.start)
        back = time.monotonic()
        await until_async(lambda: m.lease_deadline > back, timeout=5, what="a renewal after the restart")
        # etcd renews every lease when it comes back, so nothing expired and nothing re-registered.
        assert m.lease is lease and m.lease_valid()
        assert (await store.get(keys.member("steady"))).lease == lease.id
        await m.leave()
