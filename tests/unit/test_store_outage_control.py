"""A checkpoint store outage as the control plane sees it: how a worker's failure is classified,
what the worker report, `varunactl status`/`watch` and the metrics say, and the leader's start timeout.

The worker's side is in test_store_outage.py; a whole job through a full store in test_store_outage_job.py."""

from __future__ import annotations

import io
import re

from support.decisions import d, reports_for, run_plan, running, snapshot

from varunad.control.decide import LeaderMemory, error_summary, store_failing
from varunad.control.failures import classify
from varunad.control.records import WorkerRecord, WorkerReport
from varunad.ctl import progress
from varunad.node.metrics import DaemonMetrics

FULL = "No space left on device (/store/j/varuna_ckpt_24/layer.0.pt)"

_TRACEBACK = """rank 0 on vm1 exited with code 1; last output:
Traceback (most recent call last):
  File "train.py", line 40, in <module>
    model.step(batch)
trainer.errors.StoreOutage: could not write /store/j/epochs/117.json: No space left on device (the checkpoint store \
is full, read-only or failing: free space or remount it; training keeps its state and writes again when it can)
[launch] atexit: closing the control socket"""


def test_a_worker_that_died_of_a_store_outage_is_an_outage_not_a_failure_of_the_script():
    summary = error_summary(_TRACEBACK)
    assert "StoreOutage: could not write /store/j/epochs/117.json" in summary   # not the line printed after it
    assert classify(summary, None) == "outage"
    assert classify(summary, summary) == "outage"   # the same words again are not "deterministic" here
    # an older worker's CheckpointError with the store's own words
    older = "rank 1 on vm2 exited with code 1: CheckpointError: could not write /s/x: Read-only file system (check ...)"
    assert classify(older, None) == "outage"
    assert classify("rank 1 on vm2 exited with code 1: CheckpointError: checkpoint 3 has no ['w']", None) == "retry"
    assert classify("rank 1 on vm2 exited with code 1: ValueError: No space left on device", None) == "retry"


def test_the_worker_report_says_since_when_and_why_and_older_reports_still_read():
    rec = WorkerRecord(rank=2, slot=0, outcome="running", step=30, store_failing_since=24, store_error=FULL)
    assert rec.store_failing == f"checkpoints failing since step 24: {FULL}"
    assert WorkerRecord(rank=2, slot=0).store_failing == ""
    later = WorkerRecord(rank=0, slot=1, outcome="running", store_failing_since=27, store_error="Read-only file system")
    report = WorkerReport(member="vm1", job="j", epoch=5, workers=(later, rec))
    back = WorkerReport.decode(report.encode())
    assert back == report and back.store_failing("j", 5) == rec   # the earliest outage speaks for the VM
    assert back.store_failing("j", 4) is None and back.store_failing("other", 5) is None
    # a report of the release before: no outage fields, none assumed
    old = b'{"member": "vm1", "job": "j", "epoch": 5, "workers": [{"rank": 0, "slot": 0, "outcome": "running"}]}'
    assert WorkerReport.decode(old).store_failing("j", 5) is None
    try:
        WorkerRecord(rank=0, slot=0, store_failing_since=-5)
    except ValueError as exc:
        assert "store_failing_since" in str(exc)
    else:
        raise AssertionError("a negative step other than -1 was accepted")


def _doc(step: int, failing: str | None) -> dict:
    return {"job": "j", "state": "running", "step": step, "steps": 60, "epoch": 7, "loss": 2.5,
            "samples_per_s": 40.0, "plan": {"P": 2, "D": 1, "micro_batch_size": 4}, "morphs": [],
            "store_failing": failing}


def test_watch_says_checkpoints_are_failing_at_once_and_again_when_they_are_not():
    shown = progress.start("j", 60, tty=False, every_steps=20)
    shown, text = progress.advance(shown, _doc(24, None), now=0.0, wall=0.0)
    assert "failing" not in text
    failing = f"checkpoints failing since step 24: {FULL}"
    shown, text = progress.advance(shown, _doc(25, failing), now=1.0, wall=1.0)   # one step later: still a line
    assert text.startswith("j 25/60 running:") and "checkpoints failing since step 24: No space left" in text
    shown, text = progress.advance(shown, _doc(26, failing), now=2.0, wall=2.0)
    assert text == ""   # not repeated at every step
    shown, text = progress.advance(shown, _doc(27, None), now=3.0, wall=3.0)
    assert text.startswith("j 27/60") and "failing" not in text
    bar = progress.bar_line(_doc(25, failing), 60)
    assert bar.endswith(f"epoch 7 {failing}")
    long = failing + " and more" * 20
    assert progress.bar_line(_doc(25, long), 60).endswith("…") and len(progress.bar_line(_doc(25, long), 60)) < 200


async def test_the_metrics_carry_the_step_since_which_checkpoints_fail():
    m = DaemonMetrics()
    m.store_failing(job="j", rank=1, since=24, error=FULL)
    text = (await m.exposition()).decode()
    sample = 'varunad_checkpoints_failing_since_step{job="j",rank="1",reason="No space left on device"} 24.0'
    assert sample in text.splitlines()
    m.store_failing(job="j", rank=1, since=24, error="Read-only file system (/store/j)")
    text = (await m.exposition()).decode()
    assert len(re.findall(r"^varunad_checkpoints_failing_since_step\{", text, re.M)) == 1
    assert 'reason="Read-only file system"' in text
    m.store_failing(job="j", rank=1, since=-1, error="")
    assert "varunad_checkpoints_failing_since_step{" not in (await m.exposition()).decode()
    m.store_failing(job="j", rank=0, since=30, error=FULL)
    m.begin_epoch({0: 0}, "j")   # a worker killed while it failed says nothing more: its epoch's series go
    assert "varunad_checkpoints_failing_since_step{" not in (await m.exposition()).decode()
    m.store_failing(job="j", rank=0, since=-1, error="")   # a late word of the old epoch is harmless


def test_workers_held_by_the_store_before_their_first_step_are_not_stuck():
    plan = run_plan()
    memory = LeaderMemory(epoch_seen={50: 0.0})
    held = reports_for(plan, 50, step=-1)
    member0 = plan.members[0]
    rec = held[member0].workers[0]
    held[member0] = WorkerReport(member=member0, job="j", epoch=50, workers=(
        WorkerRecord(rank=rec.rank, slot=rec.slot, outcome="running", step=-1, store_failing_since=20,
                     store_error="No space left on device (/store/j/epochs/50.json)"),) + held[member0].workers[1:])
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=held)
    assert store_failing(snap)
    assert d(snap, memory, now=600.0).action == "nothing"
    # the same epoch without the outage is given up on, as before
    quiet = snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50, step=-1))
    assert not store_failing(quiet)
    assert d(quiet, memory, now=600.0).action == "abort"




def test_status_names_the_staging_directory_when_it_is_what_refused_the_checkpoint():
    """A daemon's --state-dir made read-only: status said "free space on the store" of a store that
    was fine; the path the error names says which of the two refused."""
    from varunad.ctl.commands import print_job

    def shown(failing: str) -> str:
        doc = {**_doc(25, failing), "activity": None, "reason": "running", "restarts": 0, "error": None,
               "busy_fraction": None,
               "plan": {"P": 2, "D": 1, "micro_batch_size": 4, "members": ["vm1"]}}
        out = io.StringIO()
        print_job(doc, out)
        return next(line for line in out.getvalue().splitlines() if line.startswith("store "))

    staged = shown("checkpoints failing since step 24: Read-only file system (/srv/vm1/staging/j/rank0/layer_000.pt)")
    assert "free space on the daemon's --state-dir, where checkpoints are staged" in staged
    assert "free space on the store or remount it writable" in shown(f"checkpoints failing since step 24: {FULL}")
