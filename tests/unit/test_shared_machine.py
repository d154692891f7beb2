"""Daemons on one machine share its cores (varunad.cluster.facts, trainer.planning.planner): each
reports the kernel's boot id, its cores and its workers' threads; the planner slows the stages of a
machine whose workers' threads outnumber its cores, the calibration is measured with that
machine's slots busy, and the report replays what the planner assumed.

Unit of the planner cases: 4 identical segments, forward 1 s and backward 2 s per sample, so one
sample through the whole model costs 12 s; a global batch of 8 in micro-batches of 1.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.calibrations import calibration
from support.decisions import member, spec

from trainer.planning.calibration import LinkCost
from trainer.planning.plan import PlanError, Slot
from trainer.planning.planner import _crowding, plan
from varunad.cluster.facts import DaemonMember, machine_id
from varunad.control.plans import calibrated_load, make_plan, profile_slots
from varunad.report.traces import predict

GiB = 2**30
FREE = {"intra": LinkCost(0.0, 1e18), "inter": LinkCost(0.0, 1e18)}
RING = {"intra": LinkCost(0.0, 1e12), "inter": LinkCost(0.0, 1e12)}   # an all-reduce that costs a little


def _cal(kind="cpu"):
    return calibration(4, model="toy", kind=kind, forward_s=1.0, activation_bytes=100, input_bytes=0,
                       param_bytes=GiB // 8, optimizer_bytes=GiB // 8, links=FREE, allreduce=RING)


def _ring(n=4, machine="boot-1", threads=1, memory=16 * GiB):
    """n one-slot daemons of a local ring: one address, one machine."""
    return [Slot(f"vm{i}/0", "127.0.0.1", "cpu", memory, machine=machine, threads=threads) for i in range(n)]


def test_four_one_thread_workers_on_two_cores_run_at_half_speed_so_two_of_them_win():
    alone = plan(_ring(machine=""), 8, [_cal()])     # no machine known: each slot has its own cores
    assert (alone.P, alone.D) == (1, 4) and alone.contention == ()
    assert alone.estimated_s == pytest.approx(24.0, rel=1e-3)

    shared = plan(_ring(), 8, [_cal()], machine_cores={"boot-1": 2})
    # 1x4 would compute at half speed (48 s plus a dearer all-reduce); 1x2 computes 4 x 12 s at full speed
    assert (shared.P, shared.D) == (1, 2), shared.explain()
    assert shared.estimated_s == pytest.approx(48.0, rel=1e-3)
    assert shared.contention == ()
    assert "2 workers share machine boot-1 (2 threads on 2 cores)" in shared.notes
    crowded = [c for c in shared.candidates if (c.P, c.D) == (1, 4)]
    assert crowded and min(c.simulated_s or c.estimate_s for c in crowded) > 48.0


def test_a_plan_that_crowds_a_machine_says_by_how_much_it_slowed_its_stages():
    # 4 workers are needed (memory: one segment per slot), 4 threads on 2 cores: each stage at half speed
    cal = calibration(4, model="toy", kind="cpu", forward_s=1.0, activation_bytes=100, input_bytes=0,
                      param_bytes=GiB, optimizer_bytes=2 * GiB, links=FREE, allreduce=RING)
    free = plan(_ring(machine="", memory=6 * GiB), 8, [cal])
    shared = plan(_ring(memory=6 * GiB), 8, [cal], machine_cores={"boot-1": 2})
    assert (shared.P, shared.D) == (free.P, free.D) == (4, 1)
    assert shared.contention == (2.0, 2.0, 2.0, 2.0)
    assert shared.estimated_s == pytest.approx(2 * free.estimated_s, rel=1e-3)
    assert any("compute planned 2x slower than calibrated" in n for n in shared.notes), shared.notes


def test_a_calibration_measured_under_the_same_load_is_not_slowed_again():
    p = plan(_ring(), 8, [_cal()], machine_cores={"boot-1": 2}, calibrated_load={"cpu": 2.0})
    assert (p.P, p.D) == (1, 4) and p.contention == ()
    assert p.estimated_s == pytest.approx(24.0, rel=1e-3)


def test_gpu_slots_and_machines_with_cores_to_spare_share_nothing():
    gpus = _ring(threads=0)
    assert plan(gpus, 8, [_cal()], machine_cores={"boot-1": 1}).D == 4
    roomy = plan(_ring(), 8, [_cal()], machine_cores={"boot-1": 4})
    assert (roomy.P, roomy.D) == (1, 4) and roomy.contention == ()


def test_slot_checks_its_machine_fields():
    with pytest.raises(PlanError, match="threads"):
        Slot("a/0", "h", "cpu", GiB, machine="m", threads=-1)
    with pytest.raises(PlanError, match="machine"):
        Slot("a/0", "h", "cpu", GiB, machine=None)   # type: ignore[arg-type]


# --- the daemon's facts and the leader's use of them ---------------------------------------------------

def _on(m: DaemonMember, machine="boot-1", cores=2, threads=1) -> DaemonMember:
    return dataclasses.replace(m, machine=machine, cores=cores, threads=threads, memory_bytes=16 * GiB)


def test_a_record_from_a_release_before_machines_is_a_machine_of_its_own():
    old = json.loads(member("d1").encode())
    for name in ("machine", "cores", "threads"):
        del old[name]
    m = DaemonMember.decode(json.dumps(old).encode())
    assert (m.machine, m.cores, m.threads) == ("", 0, 0)
    assert m.machine_key == "member:d1" != member("d2").machine_key
    bad = {**old, "cores": -1}
    with pytest.raises(ValueError, match="cores"):
        DaemonMember.decode(json.dumps(bad).encode())


def test_machine_id_is_the_boot_id_and_nothing_that_is_not_one(tmp_path):
    f = tmp_path / "boot_id"
    f.write_text("0b6e3c1c-6c1d-4f5e-9a57-1a2b3c4d5e6f\n")
    assert machine_id(str(f)) == "0b6e3c1c-6c1d-4f5e-9a57-1a2b3c4d5e6f"
    f.write_text("a b/c\n")
    assert machine_id(str(f)) == ""
    assert machine_id(str(tmp_path / "missing")) == ""
    assert machine_id() == machine_id()   # this host's, stable


def test_a_calibration_on_a_shared_machine_then_times_as_many_slots_busy_as_it_has_cores():
    lone = _on(member("d1"))
    assert profile_slots(lone, 4) == 2 and calibrated_load(lone) == 0.5   # a ring of 4 on 2 cores
    assert profile_slots(lone, 1) == 0                                     # alone on its machine
    four = _on(member("d1", slots=4))
    assert profile_slots(four, 4) == 0 and calibrated_load(four) == 2.0    # its own 4 slots busy, as before
    assert profile_slots(_on(member("d1"), threads=2), 4) == 0             # the probe forks one-thread slots
    assert profile_slots(_on(member("d1"), threads=0), 4) == 0             # GPU slots
    assert calibrated_load(member("d1")) == 1.0                            # an older daemon: unknown


def test_make_plan_counts_a_machines_cores_only_for_a_measured_calibration():
    s = spec(batch_size=8)
    members = [(_on(member(f"d{i}")), 100 + i) for i in (1, 2, 3, 4)]
    cals = {"cpu": _cal()}
    measured, planned = make_plan(s, members, cals, calibrated=True, reason="r")
    assert measured.shape == "1x2" and planned.contention == ()
    synthetic, _ = make_plan(s, members, cals, calibrated=False, reason="r")
    assert synthetic.shape == "1x4"   # a synthetic calibration times nothing: no cores to count
    apart = [(_on(m, machine=f"vm-{m.name}"), lease) for m, lease in members]
    assert make_plan(s, apart, cals, calibrated=True, reason="r")[0].shape == "1x4"


def test_the_report_replays_the_stages_as_slowed_as_the_planner_had_them():
    cal = _cal()
    doc = {"P": 1, "D": 1, "micro_batch_size": 1, "cuts": [], "calibrated": True, "stage_kinds": ["cpu"],
           "micro_batches": 8, "link_kinds": [], "allreduce_kinds": ["intra"]}
    plain, _ = predict(doc, {"cpu": cal.to_bytes()}, 8)
    slowed, _ = predict({**doc, "stage_slowed": [2.0]}, {"cpu": cal.to_bytes()}, 8)
    assert plain == pytest.approx(96.0, rel=1e-3) and slowed == pytest.approx(2 * plain, rel=1e-3)
    junk, _ = predict({**doc, "stage_slowed": ["x"]}, {"cpu": cal.to_bytes()}, 8)
    assert junk == pytest.approx(plain)


def test_a_slot_sharing_its_machine_with_other_workers_is_measured_but_never_a_straggler():
    from varunad.control.records import Progress
    from varunad.control.speeds import Expected, SlotSpeeds

    def run(shared: bool) -> SlotSpeeds:
        speeds = SlotSpeeds(threshold=1.5, window=2, forget_s=600)
        expected = {r: Expected(f"d{r + 1}/0", "cpu", 0.01, shared=shared) for r in range(3)}
        for step in range(8):
            progress = [Progress(job="j", epoch=7, rank=r, step=step, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                                 compute_s=c) for r, c in {0: 0.01, 1: 0.01, 2: 0.04}.items()]
            speeds.observe(7, expected, progress, now=float(step))
        return speeds

    apart, together = run(False), run(True)
    assert apart.stragglers == {"d3/0": pytest.approx(4.0, rel=0.01)}
    assert together.stragglers == {} and together.paces["d3/0"] == pytest.approx(4.0, rel=0.01)


def test_the_leader_expects_the_slots_of_a_shared_machine_as_shared():
    from support.decisions import run_plan, snapshot

    from varunad.node.leader_pace import expected_of

    members = {"d1": (_on(member("d1")), 101), "d2": (_on(member("d2")), 102),
               "d3": (_on(member("d3"), machine="boot-2"), 103)}
    doc = run_plan()
    expected = expected_of(doc, {"stage_compute_s": [0.01] * doc.plan.P}, snapshot(members=members))
    shared = {e.slot: e.shared for e in expected.values()}
    assert shared == {"d1/0": True, "d2/0": True, "d3/0": False}


def test_a_slot_alone_in_its_plan_shares_its_machine_with_the_daemons_the_plan_left_out():
    """`varunactl up 2` ran a 1x1 job on one daemon; measured against its calibration it was called
    a straggler and moved to the other daemon of the same host, and back again."""
    from support.decisions import run_plan, snapshot

    from varunad.node.leader_pace import expected_of

    doc = run_plan(members=("d1",))   # 1x1
    members = {"d1": (_on(member("d1")), 101)}
    alone = expected_of(doc, {"stage_compute_s": [0.01] * doc.plan.P}, snapshot(members=members))
    members["d2"] = (_on(member("d2")), 102)   # not in the plan, on the same machine
    beside = expected_of(doc, {"stage_compute_s": [0.01] * doc.plan.P}, snapshot(members=members))
    members["d2"] = (_on(member("d2"), machine="boot-2"), 102)   # a machine of its own
    apart = expected_of(doc, {"stage_compute_s": [0.01] * doc.plan.P}, snapshot(members=members))
    assert [e.shared for e in alone.values()] == [False]
    assert [e.shared for e in beside.values()] == [True]
    assert [e.shared for e in apart.values()] == [False]


def test_crowding_from_a_calibration_measured_alone_that_also_timed_the_machine_busy():
    # one one-thread slot of two cores measured alone (load 0.5); two busy at once computed 1.5x slower
    assert _crowding(1, 2, 0.5, 1.5, 1.0) == pytest.approx(1.0)   # alone, as calibrated
    assert _crowding(2, 2, 0.5, 1.5, 1.0) == pytest.approx(1.5)   # sharing the memory bandwidth
    assert _crowding(4, 2, 0.5, 1.5, 1.0) == pytest.approx(3.0)   # and taking turns on the cores
    assert _crowding(3, 4, 0.25, 1.5, 0.5) == pytest.approx(1.5)  # past the probe's load, no more than it
    # four slots of one daemon profiled at once on two cores: its numbers already take turns
    assert _crowding(4, 2, 2.0) == pytest.approx(1.0) and _crowding(8, 2, 2.0) == pytest.approx(2.0)
    # not probed (an older calibration, or a machine of its own): only turns beyond its load count
    assert _crowding(2, 2, 0.5) == 1.0 and _crowding(4, 2, 0.5) == 2.0


def test_a_calibration_that_timed_the_machine_busy_slows_the_plans_that_fill_it():
    cal = dataclasses.replace(_cal(), busy_slowdown=1.5, busy_load=1.0)
    p = plan(_ring(), 8, [cal], machine_cores={"boot-1": 2}, calibrated_load={"cpu": 0.5})
    # 1x2 fills the two cores: 4 x 12 s, 1.5x slower; 1x4 would be 3x slower (24 x 3), 1x1 96 s
    assert (p.P, p.D) == (1, 2) and p.contention == (pytest.approx(1.5),)
    assert p.estimated_s == pytest.approx(72.0, rel=1e-3)
    assert any("compute planned 1.5x slower than calibrated" in n for n in p.notes), p.notes
    assert plan(_ring(machine=""), 8, [cal]).estimated_s == pytest.approx(24.0, rel=1e-3)   # no machine: no sharing
