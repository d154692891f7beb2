"""An etcd outage is not a VM loss (issue 17, item 4): the leader's decision after every lease
lapsed at once, from the fleet's snapshot alone (varunad.control.outage, through leader.decide)."""

from __future__ import annotations

from support.decisions import member, reports_for, run_plan, running, snapshot

from varunad.control.decide import LeaderMemory, decide


def d(snap, *, now=100.0, outage_until=0.0):
    return decide(snap, LeaderMemory(), now=now, start_timeout=60.0, outage_until=outage_until)


def reincarnated(names=("d1", "d2", "d3"), shift=1000):
    """Every member registered again under a new lease, as after an etcd stall."""
    return {n: (member(n), 100 + int(n[-1]) + shift) for n in names}


def test_members_back_under_new_leases_with_live_workers_keep_their_epoch():
    plan = run_plan()
    snap = snapshot(plan=plan, epoch=50, states=running(), members=reincarnated(), reports=reports_for(plan, 50))
    dec = d(snap)
    assert dec.action == "nothing", dec.sentence  # before: "abort ... left the fleet (its lease ended)"


def test_absent_members_are_awaited_after_this_daemon_saw_etcd_fail():
    plan = run_plan()
    members = reincarnated(("d1",))
    reports = {"d1": reports_for(plan, 50)["d1"]}
    snap = snapshot(plan=plan, epoch=50, states=running(), members=members, reports=reports)
    dec = d(snap, now=100.0, outage_until=105.0)
    assert dec.action == "wait" and "d2, d3" in dec.reason and "register again" in dec.reason
    # not forever: once the grace has passed they are lost
    dec = d(snap, now=106.0, outage_until=105.0)
    assert dec.action == "abort" and "d2, d3 were lost" in dec.reason


def test_a_reregistered_member_whose_report_is_not_back_yet_is_awaited():
    plan = run_plan()
    reports = reports_for(plan, 50)
    del reports["d2"]
    snap = snapshot(plan=plan, epoch=50, states=running(), members=reincarnated(), reports=reports)
    assert d(snap, outage_until=105.0).action == "wait"


def test_a_lost_vm_without_an_outage_here_is_lost_at_once():
    plan = run_plan()
    members = {n: (member(n), 100 + int(n[-1])) for n in ("d1", "d3")}
    snap = snapshot(plan=plan, epoch=50, states=running(), members=members, reports=reports_for(plan, 50))
    dec = d(snap)
    assert dec.action == "abort" and "d2 was lost" in dec.reason


def test_a_restarted_daemon_without_its_workers_is_a_lost_member():
    plan = run_plan()
    reports = reports_for(plan, 50)
    reports["d2"] = reports_for(plan, 0, outcome="killed")["d2"]   # a new process: no worker of epoch 50
    snap = snapshot(plan=plan, epoch=50, states=running(), members=reincarnated(), reports=reports)
    dec = d(snap, outage_until=105.0)
    assert dec.action == "abort" and "d2" in dec.reason


def test_a_member_whose_workers_finished_during_the_outage_is_not_lost():
    plan = run_plan()
    reports = reports_for(plan, 50)
    reports["d3"] = reports_for(plan, 50, outcome="done")["d3"]   # its worker reached the last step first
    snap = snapshot(plan=plan, epoch=50, states=running(), members=reincarnated(), reports=reports)
    assert d(snap).action == "nothing"


def test_a_member_key_gone_while_its_lease_lives_is_awaited_for_a_while_then_lost():
    # d2's key deleted or overwritten by hand while its lease lives: its daemon writes it back at once
    plan = run_plan()
    members = {n: (member(n), 100 + int(n[-1])) for n in ("d1", "d3")}
    snap = snapshot(plan=plan, epoch=50, states=running(), members=members, reports=reports_for(plan, 50))
    memory = LeaderMemory(restoring_until={"d2": 104.0})
    dec = decide(snap, memory, now=100.0, start_timeout=60.0)
    assert dec.action == "wait" and "d2 is missing or unreadable but its lease lives" in dec.reason, dec.sentence
    dec = decide(snap, memory, now=105.0, start_timeout=60.0)
    assert dec.action == "abort" and "d2 was lost" in dec.reason, dec.sentence


def test_the_words_of_a_loss_say_what_is_left_to_plan_on():
    """A probe lost a whole fleet at once: the morph said "vm1, vm2, vm3, vm4 were lost (its lease
    ended): re-planning on the VMs left", with no VM left."""
    plan = run_plan()
    reports = {"d1": reports_for(plan, 50)["d1"]}
    some = snapshot(plan=plan, epoch=50, states=running(), members={"d1": (member("d1"), 101)}, reports=reports)
    dec = d(some, now=106.0, outage_until=105.0)
    assert dec.reason == "d2, d3 were lost (their leases ended): re-planning on the VMs left", dec.reason
    none = snapshot(plan=plan, epoch=50, states=running(), members={}, reports={})
    dec = d(none, now=106.0)
    assert dec.action == "abort" and dec.reason == (
        "d1, d2, d3 were lost (their leases ended): no VM is left: the job resumes from its newest checkpoint "
        "once VMs register"), dec.reason
    back = snapshot(plan=plan, epoch=50, states=running(), members=reincarnated(), reports={})
    dec = d(back, now=106.0)
    assert dec.action == "abort" and dec.reason.endswith("re-planning on the VMs registered again since"), dec.reason
    # back under their names, they are still the VMs the next epoch cannot resume from (a probe's
    # morph after a whole fleet and etcd came back said "checkpoint" with no reason)
    assert dec.lost == ("d1", "d2", "d3")
