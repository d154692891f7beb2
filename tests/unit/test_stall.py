"""A running epoch that stopped stepping is stuck (varunad.control.stall, through leader.decide):
restarted as a failed epoch after the stall timeout, or ten times its longest wait between two
steps if that is longer; never while the checkpoint store holds its workers."""

from __future__ import annotations

from dataclasses import replace

from support.decisions import reports_for, run_plan, running, snapshot

from varunad.control.decide import LeaderMemory, decide
from varunad.control.stall import STALL_FACTOR, StepWatch


def at(memory, plan, step, now, *, stall=30.0, store_failing=False):
    reports = reports_for(plan, 50, step=step)
    if store_failing:   # the first member's workers hold their state: the store refuses the checkpoint
        m = plan.members[0]
        workers = tuple(replace(w, store_failing_since=3, store_error="No space left on device")
                        for w in reports[m].workers)
        reports[m] = replace(reports[m], workers=workers)
    memory.steps.see(50, step, now)   # what the leader read in the epoch's progress records
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=reports)
    return decide(snap, memory, now=now, start_timeout=60.0, stall_timeout=stall)


def test_an_epoch_without_a_step_for_the_stall_timeout_is_restarted_as_a_failure():
    plan, memory = run_plan(), LeaderMemory()
    assert at(memory, plan, 3, 100.0).action == "nothing"
    assert at(memory, plan, 4, 101.0).action == "nothing"
    assert at(memory, plan, 4, 131.0).action == "nothing"   # 30 s: not yet
    dec = at(memory, plan, 4, 131.5)
    assert dec.action == "abort" and dec.failure, dec.sentence
    assert "no worker of epoch 50 finished a step in 30s (the last was step 4" in dec.reason
    assert "a worker is stuck" in dec.reason


def test_slow_steps_stretch_the_limit_to_ten_times_the_longest_wait():
    plan, memory = run_plan(), LeaderMemory()
    at(memory, plan, 0, 0.0)
    at(memory, plan, 1, 20.0)   # steps of 20 s: the limit is 200 s, not 30
    assert at(memory, plan, 1, 20.0 + STALL_FACTOR * 20.0).action == "nothing"
    assert at(memory, plan, 1, 20.5 + STALL_FACTOR * 20.0).action == "abort"


def test_workers_the_checkpoint_store_holds_are_not_stuck():
    plan, memory = run_plan(), LeaderMemory()
    at(memory, plan, 3, 100.0)
    assert at(memory, plan, 3, 200.0, store_failing=True).action == "nothing"
    # once the store takes their writes again, the wait starts from then
    assert at(memory, plan, 3, 220.0).action == "nothing"
    assert at(memory, plan, 3, 230.5).action == "abort"


def test_zero_turns_it_off_and_a_new_epoch_starts_a_new_watch():
    plan, memory = run_plan(), LeaderMemory()
    at(memory, plan, 3, 0.0, stall=0)
    assert at(memory, plan, 3, 10_000.0, stall=0).action == "nothing"
    watch = StepWatch()
    watch.see(7, 9, 0.0)
    watch.see(8, 2, 50.0)   # the next epoch: its own clock
    watch.see(8, 2, 79.0)
    assert watch.stuck(8, 30.0) is None
    watch.see(8, 2, 81.0)
    assert watch.stuck(8, 30.0) is not None
    assert watch.stuck(7, 30.0) is None   # not the epoch it watches


def test_only_time_between_reads_of_the_progress_counts():
    # a leader that read no progress for a while (busy with other decisions) judges nothing by it
    plan, memory = run_plan(), LeaderMemory()
    at(memory, plan, 3, 100.0)
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50, step=3))
    assert decide(snap, memory, now=1000.0, start_timeout=60.0, stall_timeout=30.0).action == "nothing"
    assert at(memory, plan, 4, 1001.0).action == "nothing"   # and the step it then reads is new


def test_before_the_first_step_only_the_start_timeout_counts():
    plan, memory = run_plan(), LeaderMemory(epoch_seen={50: 0.0})
    at(memory, plan, -1, 0.0)
    assert at(memory, plan, -1, 59.0).action == "nothing"   # past the 30 s stall timeout, within the start's
    dec = at(memory, plan, -1, 61.0)
    assert dec.action == "abort" and "did not reach a first step within 60s" in dec.reason, dec.sentence
