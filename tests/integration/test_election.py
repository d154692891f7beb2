"""varunad.cluster.election against a real etcd: one leader, failover within a TTL, fencing."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from support.fleet import TTL, fleet, leaders, one_leader
from support.waiting import until_async

from varunad.cluster.election import NotLeader, Role
from varunad.store.keys import Keys

MARGIN = 3.0  # generous: etcd's expiry check (500 ms), a watch round trip, a loaded CI host


async def test_exactly_one_of_three_contenders_leads(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a", "b", "c"]) as nodes:
        leader = await one_leader(nodes, timeout=5)
        state = leader.election.state
        assert state.role is Role.LEADER and state.leader == leader.election.name
        assert "leads (term" in state.describe() and state.describe().endswith(".")
        stored = await nodes[0].store.get(keys.leader)
        assert stored.value.decode() == leader.election.name
        assert stored.lease == leader.membership.lease.id and stored.create_revision == state.term
        for follower in (n for n in nodes if n is not leader):
            assert follower.election.state.role is Role.FOLLOWER
            assert f"follows {leader.election.name} because" in follower.election.state.describe()
            with pytest.raises(NotLeader):
                await follower.election.write_as_leader(keys.plan, "follower plan")
        epoch = await leader.election.write_as_leader(keys.plan, "plan-1")
        assert (await leader.store.get(keys.plan)).mod_revision == epoch
        # Nobody else ever believed it led, not even briefly.
        took_lead = [s.name for n in nodes for _, s in n.changes if s.role is Role.LEADER]
        assert took_lead == [leader.election.name]


async def test_failover_within_a_ttl_when_the_leader_stops_renewing(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a", "b", "c"]) as nodes:
        old = await one_leader(nodes, timeout=5)
        old_term = old.election.state.term
        await old.election.write_as_leader(keys.plan, "old plan")
        await old.membership.abandon()  # the leader's VM freezes: no renewals, no revoke
        stopped = time.monotonic()
        old_deadline = old.membership.lease_deadline
        others = [n for n in nodes if n is not old]

        new = await until_async(lambda: next(iter(leaders(others)), None), timeout=TTL + MARGIN,
                               what="a new leader")
        took = time.monotonic() - stopped
        assert took < TTL + MARGIN
        # The old leader gave up by its own deadline, before the new one could be elected.
        assert not old.election.is_leader()
        step_down = next(t for t, s in old.changes if s.role is Role.FOLLOWER and "deadline" in s.reason)
        assert step_down <= old_deadline + 0.5
        assert new.election.state.term > old_term
        assert len(leaders(nodes)) == 1

        with pytest.raises(NotLeader):
            await old.election.write_as_leader(keys.plan, "stale plan")
        epoch = await new.election.write_as_leader(keys.plan, "new plan")
        plan = await new.store.get(keys.plan)
        assert (plan.value, plan.mod_revision) == (b"new plan", epoch)


class FrozenClock:
    """A node's monotonic clock that stops while the node is "paused", like a suspended VM."""

    def __init__(self):
        self.frozen_at: float | None = None

    def __call__(self) -> float:
        return self.frozen_at if self.frozen_at is not None else time.monotonic()

    def freeze(self):
        self.frozen_at = time.monotonic()


async def test_etcd_fences_a_deposed_leader_that_still_believes_it_leads(etcd, etcd_root):
    keys = Keys(etcd_root)
    clock = FrozenClock()
    async with fleet(etcd.endpoint, keys, ["x"], clock=clock) as (stale,):
        async with fleet(etcd.endpoint, keys, ["y"]) as (other,):
            await until_async(stale.election.is_leader, timeout=5, what="x leading")
            # x's time stops and its renewals stop: it keeps believing it leads.
            clock.freeze()
            await stale.membership.abandon()
            stale.task.cancel()
            await until_async(other.election.is_leader, timeout=TTL + MARGIN, what="y taking over")
            assert stale.election.state.is_leader  # wrong, but only etcd can tell it so
            with pytest.raises(NotLeader, match="deposed"):
                await stale.election.write_as_leader(keys.plan, "stale plan")
            assert not stale.election.is_leader()
            assert "refused a write guarded by my term" in stale.election.state.reason
            assert await stale.store.get(keys.plan) is None


async def test_leader_with_frozen_etcd_stops_leading_by_its_own_deadline(etcd_fault, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd_fault.endpoint, keys, ["p", "q"], timeout=1.0) as nodes:
        leader = await one_leader(nodes, timeout=5)
        with etcd_fault.paused():
            deadline = leader.membership.lease_deadline
            # The election loop itself reports the step-down (on_change) at the deadline, while
            # its read of the leader key is still unanswered. Watch only what it reports here:
            # asking is_leader() would compute the answer on the spot.
            change = await until_async(
                lambda: next(((t, s) for t, s in leader.changes if s.role is Role.FOLLOWER), None),
                timeout=TTL + 1, interval=0.02, what="the leader's loop stepping down")
            reported_at, state = change
            assert reported_at <= deadline + 0.25
            assert "deadline" in state.reason and "before anyone else" in state.reason
            assert not leader.election.is_leader() and time.monotonic() >= deadline
            assert not any(n.election.is_leader() for n in nodes)
        # etcd is back: the fleet elects a leader again (the leases were renewed or replaced).
        await one_leader(nodes, timeout=TTL + 2 * MARGIN)


async def test_leader_resigns_and_leave_hands_over_at_once(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["r", "s"]) as nodes:
        leader = await one_leader(nodes, timeout=5)
        other = next(n for n in nodes if n is not leader)
        leader.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader.task
        left = time.monotonic()
        await leader.membership.leave()  # revokes the lease: the leader key goes with it
        await until_async(other.election.is_leader, timeout=2.0, what="handover after leave")
        assert time.monotonic() - left < TTL  # faster than any expiry
        other.task.cancel()  # or its next cycle would take the vacant key again
        with contextlib.suppress(asyncio.CancelledError):
            await other.task
        await other.election.resign()
        assert not other.election.is_leader() and "resigned" in other.election.state.describe()
        assert await other.store.get(keys.leader) is None
