"""Only the leader's plans are followed (issue 17): the leader writes the plan with a plan-writer
record (name, term, lease) in one transaction guarded by its leader key; readers, followers and
the leader alike, skip a plan that no leader wrote and keep the one in force. Real etcd, real
elections (tests/integration/test_daemon_single.py forges a plan under a running daemon and its job)."""

from __future__ import annotations

import logging

import pytest
from support.fleet import fleet, leaders, one_leader
from support.waiting import until_async

from varunad.cluster.election import NotLeader, PlanWriter
from varunad.control.fleet import read_fleet, read_plan
from varunad.control.plans import PlanDoc
from varunad.store import schemas
from varunad.store.contract import HistoryCompacted
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


async def test_a_forged_well_formed_plan_is_not_followed(etcd, etcd_root, caplog):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes, EtcdStore(etcd.endpoint) as store:
        leader = await one_leader(nodes, timeout=10)
        real = PlanDoc.stop("j", 7, checkpoint=True, reason="the leader's")
        epoch = await leader.election.write_plan(real.encode())
        assert await read_plan(store, keys, timeout=3.0) == (real, epoch)
        writer = PlanWriter.decode((await store.get(keys.plan_writer)).value)
        assert writer == PlanWriter(name=leader.election.name, term=leader.election.state.term,
                                    lease=leader.membership.lease.id)

        before = schemas.rejected().get("plan", 0)
        forgeries = [
            PlanDoc.idle("forged").encode(),                 # etcdctl put .../plan '<a valid plan>'
            (await store.get(keys.plan)).value,              # a byte-for-byte copy of the leader's plan
        ]
        with caplog.at_level(logging.WARNING, logger="varunad.store.schemas"):
            for forged in forgeries:
                await store.put(keys.plan, forged)
                # what every follower and the leader read: the leader's plan, at its epoch
                assert await read_plan(store, keys, timeout=3.0) == (real, epoch)
                snap = await read_fleet(store, keys, timeout=3.0)
                assert (snap.plan, snap.plan_epoch) == (real, epoch)
            # a writer record put after the plan (not in its transaction) proves nothing either
            await store.put(keys.plan, PlanDoc.idle("forged again").encode())
            await store.put(keys.plan_writer, writer.encode())
            assert await read_plan(store, keys, timeout=3.0) == (real, epoch)
        assert schemas.rejected()["plan"] > before
        assert any("no leader wrote it" in r.getMessage() for r in caplog.records)

        # the leader's next plan is followed again
        later = PlanDoc.idle("the leader's next")
        epoch2 = await leader.election.write_plan(later.encode())
        assert await read_plan(store, keys, timeout=3.0) == (later, epoch2)
        # a writer record deleted by a hand: the one written with the plan is in etcd's history (an
        # outside test saw the leader drop its own plan and restart the job's workers)
        kept = (await store.get(keys.plan_writer)).value
        await store.delete(keys.plan_writer)
        assert await read_plan(store, keys, timeout=3.0) == (later, epoch2)
        await store.put(keys.plan_writer, kept)   # what follows is about the leader key, not this record

        # a plan of an earlier leader stays in force until the next leader writes one
        await leader.stop()
        nodes.remove(leader)
        successor = await one_leader(nodes, timeout=10)
        assert successor.election.state.term != writer.term
        assert await read_plan(store, keys, timeout=3.0) == (later, epoch2)


async def test_a_deposed_leader_cannot_write_a_plan(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes, EtcdStore(etcd.endpoint) as store:
        old = await one_leader(nodes, timeout=10)
        epoch = await old.election.write_plan(PlanDoc.idle("old").encode())
        # The old leader stops watching (a stalled process) while its lease still holds, so it
        # still believes it leads; meanwhile its leader key goes and another member takes it.
        old.task.cancel()
        await store.delete(keys.leader)
        others = [n for n in nodes if n is not old]
        new = await until_async(lambda: next(iter(leaders(others)), None), timeout=10, what="a new leader")
        assert old.election.is_leader()
        with pytest.raises(NotLeader):
            await old.election.write_plan(PlanDoc.idle("stale").encode())
        assert not old.election.is_leader()
        assert await read_plan(store, keys, timeout=3.0) == (PlanDoc.idle("old"), epoch)
        epoch2 = await new.election.write_plan(PlanDoc.idle("new").encode())
        assert await read_plan(store, keys, timeout=3.0) == (PlanDoc.idle("new"), epoch2)


async def test_a_leader_key_rewritten_in_place_fences_its_holder(etcd, etcd_root):
    """``etcdctl put .../leader <the leader's own name>`` keeps the name and the create revision
    but drops the lease: the guard compares the key's mod revision too, so the holder's next
    write is refused rather than made under a key that no longer expires with it."""
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a"]) as nodes, EtcdStore(etcd.endpoint) as store:
        node = await one_leader(nodes, timeout=10)
        node.task.cancel()
        await store.put(keys.leader, node.election.name)
        with pytest.raises(NotLeader):
            await node.election.write_plan(PlanDoc.idle("x").encode())
        assert await read_plan(store, keys, timeout=3.0) == (None, 0)


async def test_a_plan_stays_in_force_once_etcd_compacted_its_history(etcd, etcd_root):
    """Issue 27: etcd compacts on its own (``--auto-compaction-*``). The check that a leader wrote the
    plan in force reads the leader key at the plan's revision when the leader changed since; once that
    revision is compacted it decides from the keys as they are now, instead of failing every cycle
    (which froze the fleet: no daemon could read the plan, the leader could not read the fleet)."""
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes, EtcdStore(etcd.endpoint) as store:
        first = await one_leader(nodes, timeout=10)
        plan = PlanDoc.stop("j", 3, checkpoint=True, reason="the first leader's")
        epoch = await first.election.write_plan(plan.encode())
        # the leader changes, so the check needs the leader key as it was at the plan's revision
        await first.stop()
        nodes.remove(first)
        successor = await one_leader(nodes, timeout=10)
        assert successor.election.name != first.election.name
        before = schemas.rejected().get("plan", 0)

        etcd.compact()
        with pytest.raises(HistoryCompacted):
            await store.get(keys.leader, revision=epoch)
        assert await read_plan(store, keys, timeout=3.0) == (plan, epoch)
        snap = await read_fleet(store, keys, timeout=3.0)
        assert (snap.plan, snap.plan_epoch) == (plan, epoch)
        assert schemas.rejected().get("plan", 0) == before  # nothing taken for a forgery

        # garbage put over it: the walk back to the previous value meets the compaction and stops
        # there (no plan is in force) instead of failing; a plan the new leader writes is followed
        await store.put(keys.plan, b"\x00 not a plan")
        etcd.compact()
        assert await read_plan(store, keys, timeout=3.0) == (None, 0)
        later = PlanDoc.idle("the successor's")
        epoch2 = await successor.election.write_plan(later.encode())
        etcd.compact()
        assert await read_plan(store, keys, timeout=3.0) == (later, epoch2)
