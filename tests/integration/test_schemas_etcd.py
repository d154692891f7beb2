"""Bad values in etcd are rejected by type, in one place, and never stop a reader (issue 17).

Against a real etcd where the reader needs one: the plan's history, the leader key, the member key.


The tests of tests/unit/test_schemas.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from support.decisions import BAD_PLANS
from support.fleet import fleet, make_member, one_leader
from support.waiting import until_async

from varunad.cluster.membership import Member, Membership
from varunad.control.fleet import read_plan
from varunad.control.plans import PlanDoc
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

# The values the chaos run wrote (issue 17, item 1), and more of the same kind.


async def test_a_garbage_plan_leaves_the_previous_one_in_force(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a"]) as nodes, EtcdStore(etcd.endpoint) as store:
        leader = await one_leader(nodes, timeout=10.0)
        good = PlanDoc.stop("j", 7, checkpoint=True, reason="a real one")
        rev = await leader.election.write_plan(good.encode())
        for value in BAD_PLANS[:3]:
            await store.put(keys.plan, value)
        doc, epoch = await read_plan(store, keys, timeout=3.0)
        assert (doc, epoch) == (good, rev)
        later = await leader.election.write_plan(PlanDoc.idle("next").encode())
        assert await read_plan(store, keys, timeout=3.0) == (PlanDoc.idle("next"), later)


async def test_a_leader_key_without_a_lease_is_removed_and_someone_leads(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.leader, "ghost")   # etcdctl put /varunad/leader ghost
        async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes:
            leader = await one_leader(nodes, timeout=10.0)
            kv = await store.get(keys.leader)
            assert kv.value.decode() == leader.membership.name and kv.lease == leader.membership.lease.id


async def test_a_leader_key_on_a_stranger_lease_is_removed(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        stranger = await store.grant(30)
        await store.put(keys.leader, "nobody", lease=stranger)
        try:
            async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes:
                leader = await one_leader(nodes, timeout=10.0)
                assert leader.membership.name in ("a", "b")
        finally:
            await store.revoke(stranger)


@pytest.mark.parametrize("how", ["overwrite", "delete"])
async def test_a_member_whose_key_is_overwritten_or_deleted_registers_again(etcd, etcd_root, how):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store, EtcdStore(etcd.endpoint) as mine:
        m = Membership(mine, keys, make_member("vm1"), ttl=2.0)
        await m.join()
        guard = asyncio.create_task(m.guard_key())
        try:
            if how == "overwrite":
                await store.put(keys.member("vm1"), b"junk")
            else:
                await store.delete(keys.member("vm1"))

            async def restored():
                kv = await store.get(keys.member("vm1"))
                return kv is not None and kv.lease == m.lease.id and Member.decode(kv.value) == m.member

            await until_async(restored, timeout=5.0, what="vm1's key written again under its lease")
        finally:
            guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await guard
            await m.leave()


