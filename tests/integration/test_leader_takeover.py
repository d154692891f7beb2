"""A leader lost mid-morph: real etcd, real daemons, real workers.

The leader writes a stop plan, then dies before it writes the next run plan; the daemon that
leads next finds the stop and finishes the morph. Its record said neither where the job resumed
("resumed_from -1") nor that a VM of the stopped epoch had left meanwhile, and it lasted "0.0 s"
(an outside probe: a notice to the leader during a join's morph).
"""

from __future__ import annotations

import signal

import pytest
from support.etcd_server import EtcdServer
from support.ring import Ring

from varunad.control.fleet import read_plan

pytestmark = pytest.mark.slow


def test_a_morph_the_next_leader_finishes_says_where_it_resumed_and_who_left(tmp_path):
    server = EtcdServer()
    server.start()
    # each daemon a VM of its own with room for two of the model's five segments: 3 slots run 3x1
    ring = Ring(tmp_path / "ring", server.endpoint, root="/takeover/", ttl=4.0, own_machines=True,
                extra=["--calibrate", "profile", "--memory", str(2**30), "--abort-grace", "2",
                       "--progress-interval", "0.5", "--debounce", "0.2"])
    try:
        for name in ("t1", "t2", "t3"):
            ring.start(name)
        ring.wait_members(["t1", "t2", "t3"])
        # slow steps: the stop-with-checkpoint the notice asks for waits for a step boundary
        ring.submit("takeover", steps=30, every=4, script_args=("--step-sleep", "2.0"))
        st = ring.poll(lambda: (s := ring.status("takeover"))["step"] >= 5 and s["plan"]["P"] == 3 and s,
                       timeout=180, what="takeover training 3x1")
        leader = ring.leader()
        leaving = next(m for m in st["plan"]["members"] if m != leader)
        ring.daemons[leaving].proc.send_signal(signal.SIGTERM)   # a notice: the leader stops the epoch
        ring.poll(lambda: (p := ring.call(read_plan(ring.store, ring.keys, timeout=5))[0]) is not None
                  and p.kind == "stop", timeout=30, what="the leader's stop plan", interval=0.05)
        ring.daemons[leader].proc.kill()   # the leader is lost before it plans again
        spare = ring.start("t4")   # with the one member left, two slots again: 2x1
        assert spare.alive
        st = ring.poll(lambda: (s := ring.status("takeover"))["state"] == "running" and s["plan"]["P"] == 2
                       and s["morphs"] and s, timeout=120, what="the next leader's plan")
        morph = st["morphs"][-1]
        assert f"{leaving} is leaving" in morph["reason"], morph
        assert morph["reason"].endswith(f"; {leader} left meanwhile"), morph   # the leaving one is named once
        assert morph["source"] == "checkpoint" and morph["resumed_from"] >= 4, morph
        assert morph["duration_s"] > 0 and morph["from"] == "3x1", morph
    finally:
        ring.close()
        server.close()
