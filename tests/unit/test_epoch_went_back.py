"""A plan whose epoch is older than the one a daemon applied (etcd's data lost, or restored from an
older copy): the daemon says so once, applies none of those plans, and moves etcd's revision past
the epoch it applied, so that the leader's next plan is newer; the leader, seeing workers of an
epoch newer than its plan's, waits for that and then stops them. The whole of it against a real
etcd restored from a copy: tests/integration/test_etcd_restored.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace

from support.decisions import d, reports_for, run_plan, running, snapshot

from varunad.cluster.revision_floor import raise_revision_past
from varunad.node.follower import PlanFollowing
from varunad.store.keys import Keys


class _Revisions:
    """etcd's revision as writes move it: each put is one."""

    def __init__(self, revision: int) -> None:
        self.rev, self.keys = revision, set()

    async def revision(self, *, timeout=None) -> int:
        return self.rev

    async def put(self, key, value, *, lease=None, timeout=None) -> int:
        self.rev += 1
        self.keys.add(key)
        return self.rev


class _Daemon(PlanFollowing):
    def __init__(self, store: _Revisions) -> None:
        self.name = "vm1"
        self.applied_epoch = 991
        self._apply_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self.store, self.keys = store, Keys("/t/")
        self.config = SimpleNamespace(retry_timeout=1.0)
        self.marked = 0
        self.supervisor = SimpleNamespace(reporter=SimpleNamespace(mark=self._mark))
        self.reread: list[str] = []

    def _mark(self) -> None:
        self.marked += 1

    async def _read_plan(self, why: str, *, seen: int = 0) -> None:
        self.reread.append(why)


def test_an_older_plan_epoch_is_said_once_not_applied_and_moves_etcds_revision_past_the_epoch_applied(caplog):
    store = _Revisions(524)
    daemon = _Daemon(store)

    async def main():
        for _ in range(3):
            await daemon._apply(run_plan(), 524)
        await asyncio.gather(*daemon._background)

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "the plan's epoch 524 is older than epoch 991, which this daemon applied" in said[0]
    assert daemon.applied_epoch == 991
    assert store.rev == 992 and store.keys == {"/t/revision-floor"}
    assert daemon.marked == 1 and daemon.reread == ["etcd's revision moved forward"]


def test_moving_the_revision_stops_where_it_is_already_past():
    store = _Revisions(2000)
    assert asyncio.run(raise_revision_past(store, Keys("/t/"), 991, who="vm1", timeout=1.0)) == 2000
    assert store.keys == set()


def _went_back(*, revision: int, lease: int | None = 101):
    """d1 runs epoch 80 of job j; etcd's plan (and the job's state) are of epoch 50."""
    plan = run_plan()
    reports = reports_for(plan, 50)
    reports["d1"] = reports_for(plan, 80)["d1"]
    snap = snapshot(plan=plan, epoch=50, states=running(50), reports=reports)
    leases = {m: 100 + int(m[-1]) for m in reports}
    if lease is None:
        del leases["d1"]
    else:
        leases["d1"] = lease
    return dataclasses.replace(snap, revision=revision, report_leases=leases)


def test_the_leader_waits_for_the_revision_then_stops_the_lost_epoch_with_a_checkpoint():
    dec = d(_went_back(revision=60))
    assert dec.action == "wait" and "etcd's history went back (d1 ran epoch 80" in dec.reason, dec.reason
    assert "60" not in dec.reason   # the words do not change as the revision moves: logged once
    dec = d(_went_back(revision=81))
    assert dec.action == "abort" and dec.checkpoint and dec.stop_epoch == 80 and dec.job == "j", dec


def test_without_a_plan_the_rule_waits_for_nothing():
    """etcd lost all its data, or a hand deleted the plan key: no daemon sees an older plan to move
    the revision for, so waiting would be forever; the leader plans as usual (and the plan it
    writes is the older plan the daemons then react to)."""
    import dataclasses as dc

    snap = dc.replace(_went_back(revision=20), plan=None, plan_epoch=0)
    dec = d(snap)
    assert dec.action != "wait" and "history went back" not in dec.reason, dec


def test_a_report_not_on_its_members_lease_is_no_epoch_the_fleet_ran():
    # a hand's value (no lease, or another's): a forged epoch 1e9 must not hold the leader waiting
    for lease in (None, 0, 999):
        dec = d(_went_back(revision=60, lease=lease))
        assert "history went back" not in dec.reason, (lease, dec)
