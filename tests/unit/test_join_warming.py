"""A VM that joins a running job is taken in once its spare workers have imported torch
(DaemonMember.warming), for a bounded while: the scale-up's morph then waits for no import.
The whole path (a daemon joining a ring, its first worker started in a spare) runs in
tests/integration/test_daemon_ring.py::test_scale_up_then_a_preemption_notice."""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.fleet import make_member

from varunad.cluster.facts import DaemonMember
from varunad.control.decide import JOIN_WARM_WAIT, LeaderMemory, still_warming


def _daemon(name: str, **changes) -> DaemonMember:
    base = make_member(name)
    return DaemonMember(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **changes)


def test_a_warming_newcomer_is_waited_for_a_bounded_while():
    memory = LeaderMemory()
    members = {"d4": (_daemon("d4", warming=True), 7), "d5": (_daemon("d5"), 8)}
    assert still_warming(["d4", "d5"], members, memory, now=100.0) == ["d4"]
    assert still_warming(["d4", "d5"], members, memory, now=100.0 + JOIN_WARM_WAIT - 1) == ["d4"]
    # measured from when the leader first saw it warming, not from each round
    assert still_warming(["d4", "d5"], members, memory, now=100.0 + JOIN_WARM_WAIT) == []
    # the same VM registered again (a new lease) is waited for again
    members["d4"] = (members["d4"][0], 9)
    assert still_warming(["d4"], members, memory, now=200.0) == ["d4"]
    # once it says its spares are ready, at once
    members["d4"] = (dataclasses.replace(members["d4"][0], warming=False), 9)
    assert still_warming(["d4"], members, memory, now=200.5) == []


def test_warming_is_a_member_fact_that_old_records_lack():
    m = _daemon("d1", warming=True)
    assert DaemonMember.decode(m.encode()).warming is True
    doc = json.loads(m.encode())
    del doc["warming"]   # a record of a daemon from before the fact: never waited for
    assert DaemonMember.decode(json.dumps(doc).encode()).warming is False
    with pytest.raises(ValueError, match="warming"):
        _daemon("d1", warming="yes")
