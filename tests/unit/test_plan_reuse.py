"""make_plan keeps its last few plans (varunad.control.plans): the leader plans a morph while the
old workers stop and again once they have; the second is the first, unless an input changed."""

from __future__ import annotations

from dataclasses import replace

from support.decisions import member, spec

from varunad.control import plans
from varunad.control.plans import make_plan, uniform_calibration


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = plans.planner.plan

    def plan(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(plans.planner, "plan", plan)
    monkeypatch.setattr(plans, "_PLANNED", type(plans._PLANNED)())
    return calls


def test_the_same_inputs_are_planned_once_and_keep_their_own_reason(monkeypatch):
    calls = _counting(monkeypatch)
    s = spec(batch_size=12)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)]
    cals = {"cpu": uniform_calibration(s, "cpu")}
    first, planned = make_plan(s, members, cals, calibrated=False, reason="ahead of the stop")
    again, planned_again = make_plan(s, list(members), dict(cals), calibrated=False, reason="d4 was lost")
    assert len(calls) == 1
    assert again.reason == "d4 was lost" and first.reason == "ahead of the stop"
    assert replace(again, reason=first.reason) == first and planned_again is planned


def test_any_changed_input_plans_again(monkeypatch):
    calls = _counting(monkeypatch)
    s = spec(batch_size=12)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)]
    cals = {"cpu": uniform_calibration(s, "cpu")}
    make_plan(s, members, cals, calibrated=False, reason="r")
    variants = [
        dict(members=members[:2]),                                      # a member lost
        dict(members=[members[0], members[1], (members[2][0], 999)]),   # one registered again
        dict(slowdowns={"d3/0": 4.0}),                                  # a straggler
        dict(memory_scale={"cpu": 0.5}),                                # a stage ran out of memory
        dict(s=spec(batch_size=24)),                                    # another job
        dict(calibrated=True),
    ]
    docs = []
    for v in variants:
        docs.append(make_plan(v.get("s", s), v.get("members", members), cals, calibrated=v.get("calibrated", False),
                              reason="r", memory_scale=v.get("memory_scale"), slowdowns=v.get("slowdowns"))[0])
    assert len(calls) == 1 + len(variants)
    assert docs[0].members == ("d1", "d2") and docs[2].members == ("d1", "d2")   # planned afresh, not reused
    assert docs[1].incarnations["d3"] == 999
