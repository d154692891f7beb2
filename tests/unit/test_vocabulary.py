"""One vocabulary in `varunactl status` and `watch`: a restart is a restart, a morph is a morph, in
every state the progress line can show (unit tests over the status document, no ring)."""

from __future__ import annotations

import io
import itertools

import pytest

from varunad.control.jobs import CHANGES, STATES, JobSpecError, JobState
from varunad.control.status import activity
from varunad.ctl.commands import print_job
from varunad.ctl.progress import advance, bar_line, morph_line, plain_line, start

REASONS = {  # what the leader writes in each case
    "stopping": "a worker failed (rank 1 on vm2): stopping the epoch, then checking which VMs answer",
    "restart": "ValueError: boom (rank 1 on vm2): starting the same plan again from the newest checkpoint "
               "(restart 1 of at most 3)",
    "morph": "vm2 was lost (it stopped answering; its peer rank 0 on vm1): re-planning on the VMs left",
    "": "vm3 joined: 2x2 on 4 members is estimated 40% faster than 2x1; checkpointing, then re-planning",
}


def _doc(state: str, change: str, **kw) -> dict:
    plan = {"P": 2, "D": 1, "micro_batch_size": 4, "schedule": "varuna", "members": ["vm1", "vm2"],
            "estimated_s": 0.1, "calibrated": True, "micro_batches": 3, "alternatives": [], "ruled_out": []}
    return {"job": "gpt", "state": state, "activity": activity(state, change), "reason": REASONS.get(change, "x"),
            "step": 12, "steps": 30, "epoch": 7, "plan": plan, "redoing": None, "loss": 2.5, "samples_per_s": 40.0,
            "busy_fraction": None, "restarts": 1, "error": None, "store_failing": None, "warnings": [],
            "morphs": [], "loss_history": [], **kw}


def _shown(doc: dict) -> list[str]:
    out = io.StringIO()
    print_job(doc, out)
    return [bar_line(doc, 30), plain_line(doc, 30), out.getvalue().splitlines()[0]]


def test_each_state_and_change_has_one_word():
    words = {(s, c): activity(s, c) for s, c in itertools.product(STATES, CHANGES)}
    assert words[("morphing", "restart")] == "restarting"
    assert words[("morphing", "stopping")] == "stopping"
    assert words[("morphing", "morph")] == words[("morphing", "")] == "morphing"  # "": a state from before `change`
    for (state, change), word in words.items():
        if state != "morphing":
            assert word == state, (state, change)


@pytest.mark.parametrize("change", CHANGES)
def test_a_restart_is_never_called_a_morph_nor_a_morph_a_restart(change):
    for line in _shown(_doc("morphing", change)):
        if change in ("restart", "stopping"):
            assert "morph" not in line, line
            assert ("restarting" if change == "restart" else "stopping") in line, line
        else:
            assert "morphing" in line and "restart" not in line, line


@pytest.mark.parametrize("state", [s for s in STATES if s != "morphing"])
def test_other_states_show_themselves_whatever_change_was_left(state):
    for change in CHANGES:
        for line in _shown(_doc(state, change, reason="why")):
            assert "morphing" not in line and "restarting" not in line and "stopping" not in line, line
            assert state in line or state == "running", line


def test_the_lines_of_a_restart_and_a_morph_once_planned():
    restart = {"reason": REASONS["restart"], "from": "2x1", "to": "2x1", "from_epoch": 7, "to_epoch": 9,
               "noticed_at": 100.0, "stopped_at": 101.0, "planned_at": 102.0, "duration_s": 2.0, "checkpoint": False,
               "restart": True, "cause": "the checkpoint store refused a write", "source": "checkpoint",
               "resumed_from": 10, "source_why": ""}
    morph = {**restart, "to": "1x1", "restart": False, "cause": "vm2 was lost", "reason": REASONS["morph"]}
    line = morph_line(restart)
    assert line.startswith("restart 2x1 after the checkpoint store refused a write") and "morph" not in line
    assert morph_line(morph).startswith("morph 2x1 -> 1x1") and "restart" not in morph_line(morph)
    # watch's plain output: a new line when the job goes from stopping to restarting
    shown = start("gpt", 30, tty=False)
    shown, first = advance(shown, _doc("morphing", "stopping"), now=0.0, wall=100.0)
    shown, second = advance(shown, _doc("morphing", "restart"), now=0.1, wall=100.1)
    assert "stopping (" in first and "restarting (" in second, (first, second)


def test_the_change_is_checked_and_a_state_written_before_it_reads():
    with pytest.raises(JobSpecError, match="job change 'rebooting'"):
        JobState(job="gpt", state="morphing", change="rebooting")
    old = JobState(job="gpt", state="morphing").encode().replace(b'"change": "", ', b"")
    assert b"change" not in old and JobState.decode(old).change == ""
