"""Measured speed per slot, stragglers with hysteresis, and plans around a slow slot
(varunad.control.speeds, varunad.control.plans.make_plan's ``slowdowns``)."""

from __future__ import annotations

import dataclasses

import pytest
from support.calibrations import calibration
from support.decisions import member, spec

from trainer.planning.calibration import LinkCost
from trainer.planning.plan import PlanError
from varunad.control.plans import make_plan, uniform_calibration
from varunad.control.records import Progress
from varunad.control.speeds import Expected, SlotSpeeds, base_kind, bucket, slowed_calibrations, slowed_kind

LINKS = {"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e9)}


def _expected(n: int = 3, compute_s: float = 0.01) -> dict[int, Expected]:
    return {r: Expected(f"d{r + 1}/0", "cpu", compute_s) for r in range(n)}


def _feed(speeds: SlotSpeeds, steps: range, per_rank: dict[int, float], epoch: int = 7, t0: float = 0.0) -> list[bool]:
    """One progress round per step: rank r reports compute per_rank[r] (seconds per micro-batch)."""
    changed = []
    for step in steps:
        progress = [Progress(job="j", epoch=epoch, rank=r, step=step, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                             compute_s=c) for r, c in per_rank.items()]
        changed.append(speeds.observe(epoch, _expected(len(per_rank)), progress, now=t0 + step))
    return changed


def test_a_slot_slower_than_its_kind_for_a_window_becomes_a_straggler_and_its_peers_do_not():
    speeds = SlotSpeeds(threshold=1.5, window=3, forget_s=600)
    # the whole fleet 1.6x slower than calibrated (a ring sharing cores): nobody is a straggler
    changed = _feed(speeds, range(0, 5), {0: 0.016, 1: 0.017, 2: 0.016})
    assert not any(changed) and speeds.stragglers == {}
    assert speeds.paces == pytest.approx({"d1/0": 1.0, "d2/0": 1.06, "d3/0": 1.0}, abs=0.01)
    # d3 turns 4x slower: a straggler only after `window` slow reports in a row, not at the first
    changed = _feed(speeds, range(5, 10), {0: 0.016, 1: 0.016, 2: 0.064})
    assert changed.index(True) == 2 and speeds.stragglers == {"d3/0": pytest.approx(4.0, rel=0.01)}
    assert speeds.slowdowns() == {"d3/0": 4.0}


def test_the_first_step_of_an_epoch_and_repeated_steps_are_not_measured():
    speeds = SlotSpeeds(threshold=1.5, window=1, forget_s=600)
    _feed(speeds, range(0, 1), {0: 0.01, 1: 0.5})     # the first step: warming up, not its pace
    assert speeds.stragglers == {} and speeds.paces == {}
    _feed(speeds, range(1, 2), {0: 0.01, 1: 0.01})
    _feed(speeds, range(1, 2), {0: 0.01, 1: 0.5})     # the same step again says nothing new
    assert speeds.stragglers == {}


def test_hysteresis_a_straggler_near_the_threshold_stays_one_until_clearly_fast_again():
    speeds = SlotSpeeds(threshold=1.5, window=2, forget_s=600)
    _feed(speeds, range(0, 4), {0: 0.01, 1: 0.02})
    assert "d2/0" in speeds.stragglers
    _feed(speeds, range(4, 8), {0: 0.01, 1: 0.0145})   # below the threshold, above threshold * RECOVER
    assert "d2/0" in speeds.stragglers
    changed = _feed(speeds, range(8, 12), {0: 0.01, 1: 0.010})
    assert True in changed and speeds.stragglers == {}


def test_a_straggler_no_plan_measures_is_forgotten_after_forget_s_and_a_new_leader_adopts_the_old_ones():
    speeds = SlotSpeeds(threshold=1.5, window=1, forget_s=30)
    _feed(speeds, range(0, 3), {0: 0.01, 1: 0.01, 2: 0.05})
    assert set(speeds.stragglers) == {"d3/0"}
    # the next epoch runs without d3: nothing measures it, until forget_s after its last report
    two = {0: Expected("d1/0", "cpu", 0.01), 1: Expected("d2/0", "cpu", 0.01)}
    for t in (10, 31):
        progress = [Progress(job="j", epoch=8, rank=r, step=t, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                             compute_s=0.01) for r in two]
        speeds.observe(8, two, progress, now=t)
    assert set(speeds.stragglers) == {"d3/0"}
    assert speeds.observe(8, two, [], now=40) is True and speeds.stragglers == {}
    heir = SlotSpeeds(threshold=1.5, window=1, forget_s=30)
    heir.adopt({"d3/0": 5.0, "bad": "x", "d1/0": 0.5}, now=0.0)
    assert heir.slowdowns() == {"d3/0": 5.7}


def test_a_lone_slot_is_compared_with_its_calibration_only_when_measured_and_threshold_0_is_off():
    alone = SlotSpeeds(threshold=1.5, window=1, forget_s=600)
    _feed(alone, range(0, 3), {0: 0.025})   # 2.5x its calibration: within CROSS x the threshold
    assert alone.stragglers == {} and alone.paces == {"d1/0": 2.5}
    _feed(alone, range(3, 7), {0: 0.04})
    assert alone.stragglers == {"d1/0": 4.0}
    synthetic = SlotSpeeds(threshold=1.5, window=1, forget_s=600)
    for step in range(3):   # a synthetic calibration's times say nothing about speed
        p = Progress(job="j", epoch=7, rank=0, step=step, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                     compute_s=0.5)
        synthetic.observe(7, _expected(1), [p], now=step, calibrated=False)
    assert synthetic.stragglers == {} and synthetic.paces == {}
    off = SlotSpeeds(threshold=0, window=1, forget_s=600)
    _feed(off, range(0, 3), {0: 0.01, 1: 0.05})
    assert off.stragglers == {} and off.paces["d2/0"] == 5.0


def test_slowed_kinds_round_trip_and_scale_only_compute():
    assert [bucket(f) for f in (0.5, 1.0, 1.2, 2.1, 3.7, 6.0)] == [1.0, 1.0, 1.4, 2.0, 4.0, 5.7]
    assert base_kind(slowed_kind("NVIDIA A100-SXM4-80GB", 2.8)) == ("NVIDIA A100-SXM4-80GB", 2.8)
    assert base_kind("cpu~bad") == ("cpu~bad", 1.0) and slowed_kind("cpu", 1.0) == "cpu"
    cal = calibration(4, step_s=1e-3, links=LINKS)
    both = slowed_calibrations({"cpu": cal}, [("cpu", 4.0), ("gpu", 2.0)])
    slow = both["cpu~4x"]
    assert set(both) == {"cpu", "cpu~4x"} and slow.device_kind == "cpu~4x"
    for a, b in zip(cal.segments, slow.segments):
        assert (b.step_s, b.param_bytes, b.static_bytes) == (pytest.approx(4 * a.step_s), a.param_bytes, a.static_bytes)
        for x, y in zip(a.costs, b.costs):
            assert y.forward_s == pytest.approx(4 * x.forward_s) and y.backward_s == pytest.approx(4 * x.backward_s)
            assert y.activation_bytes == x.activation_bytes


def test_a_plan_leaves_a_much_slower_slot_idle_where_using_it_costs_more_than_it_brings():
    s = spec(batch_size=12)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)]
    cals = {"cpu": uniform_calibration(s, "cpu")}
    even, _ = make_plan(s, members, cals, calibrated=False, reason="t")
    assert (even.plan.P, even.plan.D) == (1, 3)
    doc, planned = make_plan(s, members, cals, calibrated=False, reason="t", slowdowns={"d3/0": 4.0})
    assert doc.members == ("d1", "d2") and (doc.plan.P, doc.plan.D) == (1, 2)
    assert doc.estimated_s < even.estimated_s * 4   # what 1x3 would take at d3's pace
    assert any("cpu~4x" in n and "left out" in n for n in planned.notes)


def test_a_pipeline_gives_a_slower_slot_fewer_layers_where_it_cannot_leave_it_out():
    """Two slots, a model that fits neither alone: both are needed, the slow one takes less."""
    s = spec(batch_size=8)
    members = [(member("d1"), 101), (member("d2"), 102)]
    cal = calibration(12, sizes=(1, 2, 4, 8), param_bytes=40 << 20, optimizer_bytes=0, links=LINKS)
    even, _ = make_plan(s, members, {"cpu": cal}, calibrated=True, reason="t")
    doc, planned = make_plan(s, members, {"cpu": cal}, calibrated=True, reason="t", slowdowns={"d2/0": 2.0})
    assert (even.plan.P, doc.plan.P) == (2, 2)
    kinds = [st.device_kind for st in planned.stages]
    slow_stage = kinds.index("cpu~2x")
    sizes = [st.end_segment - st.first_segment for st in planned.stages]
    assert sizes[slow_stage] < sizes[1 - slow_stage], (kinds, sizes)
    where = doc.plan.positions()
    assert next(x.member for x in doc.slots if where[x.rank][0] == slow_stage) == "d2"


def test_replicas_of_one_kind_at_different_speeds_take_uneven_shares_of_the_global_batch():
    """Three slots, one at half speed: neither 1x2 (it idle) nor an even 1x3 (everyone at its
    pace) is the best plan; 1x3 with a smaller share for the slow replica is."""
    s = spec(batch_size=24)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)]
    cal = calibration(4, sizes=(1, 2, 4), forward_s=1e-3, links=LINKS)
    without, _ = make_plan(s, members[:2], {"cpu": cal}, calibrated=True, reason="t")
    doc, planned = make_plan(s, members, {"cpu": cal}, calibrated=True, reason="t", slowdowns={"d3/0": 2.0})
    shares = doc.plan.shares
    assert (doc.plan.P, doc.plan.D) == (1, 3) and shares is not None and sum(shares) == 24, planned.explain()
    slow = doc.plan.positions()[next(x.rank for x in doc.slots if x.member == "d3")][1]
    assert shares[slow] < min(sh for r, sh in enumerate(shares) if r != slow)
    assert all(sh % doc.plan.micro_batch_size == 0 for sh in shares)
    assert planned.estimated_s < without.estimated_s * 0.95
    assert any("uneven shares" in n for n in planned.notes)
    # the stage's kind is the slots' own: the leader measures every slot against its full speed
    assert [st.device_kind for st in planned.stages] == ["cpu"]
    # the shares reach the workers whole, in the plan document's ParallelPlan
    assert type(doc.plan).from_dict(doc.plan.to_dict()).shares == shares


def test_uneven_shares_in_a_pipeline_keep_one_partition_and_give_the_slow_replica_less():
    s = spec(batch_size=32)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3, 4)]
    # a model no slot holds alone, with cheap all-reduces: 2x2 is the healthy fleet's plan
    cal = calibration(8, sizes=(1, 2, 4), param_bytes=80 << 20, optimizer_bytes=0, links=LINKS,
                      allreduce={"intra": LinkCost(50e-6, 50e9), "inter": LinkCost(50e-6, 50e9)})
    doc, planned = make_plan(s, members, {"cpu": cal}, calibrated=True, reason="t", slowdowns={"d4/0": 2.0})
    assert (doc.plan.P, doc.plan.D) == (2, 2) and doc.plan.shares is not None, planned.explain()
    slow = doc.plan.positions()[next(x.rank for x in doc.slots if x.member == "d4")][1]
    assert doc.plan.shares[slow] < doc.plan.shares[1 - slow]
    assert planned.micro_batches == max(doc.plan.shares) // doc.plan.micro_batch_size
    # a plan whose shares are not the global batch, or whose m is not its largest share's, is refused
    for shares, m in (((20, 11), planned.micro_batches), (doc.plan.shares, planned.micro_batches + 1)):
        with pytest.raises(PlanError):
            dataclasses.replace(planned, parallel=planned.parallel.replace(shares=shares), micro_batches=m)


def test_uneven_shares_are_not_planned_for_speeds_that_are_the_same():
    s = spec(batch_size=24)
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)]
    cal = calibration(4, sizes=(1, 2, 4), links=LINKS)
    doc, _ = make_plan(s, members, {"cpu": cal}, calibrated=True, reason="t")
    assert doc.plan.shares is None and (doc.plan.P, doc.plan.D) == (1, 3)


def test_balanced_counts_minimise_the_slowest_replica():
    from trainer.planning.planner import _balanced_counts
    assert _balanced_counts([1.0, 1.0, 2.0], [1.0, 1.0, 2.0], 10) == (4, 4, 2)
    assert _balanced_counts([1.0, 1.0], [1.0, 1.0], 1) is None
    counts = _balanced_counts([0.5, 3.0], [1.0, 3.0], 12)
    assert sum(counts) == 12 and min(counts) >= 1
    worst = max(a + (c - 1) * p for a, p, c in zip([0.5, 3.0], [1.0, 3.0], counts))
    assert all(worst <= max(0.5 + (c - 1) * 1.0, 3.0 + (12 - c - 1) * 3.0) for c in range(1, 12))


def test_a_kind_with_one_measured_slot_is_compared_with_the_fastest_slot_of_any_kind():
    speeds = SlotSpeeds(threshold=1.5, window=1, forget_s=600)
    expected = {0: Expected("a1/0", "A100", 0.01), 1: Expected("a2/0", "A100", 0.01), 2: Expected("v1/0", "V100", 0.03)}
    for step in range(3):   # the V100 at 2.5x its own calibration, the A100s at 1.2x theirs
        progress = [Progress(job="j", epoch=7, rank=r, step=step, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                             compute_s=c) for r, c in ((0, 0.012), (1, 0.012), (2, 0.075))]
        speeds.observe(7, expected, progress, now=step)
    # measured against another kind's calibration: only CROSS x the threshold counts
    assert speeds.paces == {"a1/0": 1.0, "a2/0": 1.0, "v1/0": pytest.approx(2.08, abs=0.01)}
    assert speeds.stragglers == {}
    for step in range(3, 6):   # now at 4x its calibration: 3.3x the A100s
        progress = [Progress(job="j", epoch=7, rank=r, step=step, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                             compute_s=c) for r, c in ((0, 0.012), (1, 0.012), (2, 0.12))]
        speeds.observe(7, expected, progress, now=step)
    assert set(speeds.stragglers) == {"v1/0"}


def test_a_replica_of_the_same_stage_is_the_reference_and_other_stages_only_past_cross_times_the_threshold():
    """A healthy pipeline's stages differ by the calibration's error (2.5x seen under load): not a
    straggler. A replica 2.5x slower than its twin on the same stage is one."""
    pipeline = {0: Expected("d1/0", "cpu", 0.01, stage=0), 1: Expected("d2/0", "cpu", 0.01, stage=1)}
    both = {**pipeline, 2: Expected("d3/0", "cpu", 0.01, stage=0), 3: Expected("d4/0", "cpu", 0.01, stage=1)}
    for name, expected, measured, slow in (("2x1", pipeline, {0: 0.01, 1: 0.025}, set()),
                                           ("2x2", both, {0: 0.01, 1: 0.01, 2: 0.025, 3: 0.011}, {"d3/0"})):
        speeds = SlotSpeeds(threshold=1.5, window=2, forget_s=600)
        for step in range(4):
            progress = [Progress(job="j", epoch=7, rank=r, step=step, loss=1.0, samples_per_s=1.0,
                                 busy_fraction=1.0, compute_s=c) for r, c in measured.items()]
            speeds.observe(7, expected, progress, now=step)
        assert set(speeds.stragglers) == slow, name


def test_the_leader_plans_again_for_a_slot_slower_than_planned_or_a_planned_straggler_back_at_full_speed():
    from varunad.node.leader_pace import _judged, speeds_moved
    judged = {"d1/0", "d2/0", "d3/0"}
    assert speeds_moved({"d3/0": 2.0}, {}, judged)                       # a new straggler
    assert speeds_moved({"d3/0": 4.0}, {"d3/0": 2.0}, judged)            # slower than planned
    assert not speeds_moved({"d3/0": 2.0}, {"d3/0": 2.0}, judged)        # as planned
    assert not speeds_moved({}, {"d3/0": 2.0}, {"d1/0", "d2/0"})         # not judged: idle, or no healthy peer
    assert speeds_moved({}, {"d3/0": 2.0}, judged)                       # a smaller share, now at full speed
    assert speeds_moved({"d3/0": 1.4}, {"d3/0": 2.0}, judged)            # faster than planned
    # 1x3 with d3 planned slow: its peers are healthy, so its speed is judged
    row = [Expected(f"d{i}/0", "cpu", 0.01, stage=0) for i in (1, 2, 3)]
    assert _judged(row, {"d3/0": 2.0}) == {"d1/0", "d2/0", "d3/0"}
    # 2x2 whose stage 1 holds both slow slots: each is the other's reference, so neither is judged
    two = [Expected("a/0", "cpu", 0.01, stage=0), Expected("b/0", "cpu", 0.01, stage=0),
           Expected("c/0", "cpu", 0.01, stage=1), Expected("d/0", "cpu", 0.01, stage=1)]
    assert _judged(two, {"c/0": 2.0, "d/0": 2.0}) == {"a/0", "b/0"}
    assert not speeds_moved({}, {"c/0": 2.0, "d/0": 2.0}, _judged(two, {"c/0": 2.0, "d/0": 2.0}))
    # a stage alone (a pipeline with a slow stage given fewer layers): no replica to judge it by
    assert _judged([Expected("a/0", "cpu", 0.01, stage=0), Expected("b/0", "cpu", 0.01, stage=1)], {"b/0": 2.0}) \
        == set()


def test_status_says_the_shares_of_a_plan_that_gives_replicas_uneven_ones():
    from varunad.control.status import plan_lines
    plan = {"P": 1, "D": 3, "micro_batch_size": 2, "micro_batches": 5, "estimated_s": 0.2, "shares": [10, 10, 4],
            "alternatives": [], "ruled_out": []}
    lines = plan_lines(plan)
    assert lines[0].startswith("why       1x3, micro-batch 2 x up to 5 per replica"), lines
    assert any("replicas take 10, 10, 4 examples of each step's 24" in ln for ln in lines), lines
    assert not any("shares" in ln for ln in plan_lines({**plan, "shares": None}))



def test_status_names_the_schedule_of_a_pipeline_and_why_not_the_others():
    from varunad.control.status import plan_lines
    why = "the other schedules: varuna (4x1) 0.330 s (schedule zb-h1: 0.270 s)"
    plan = {"P": 4, "D": 1, "micro_batch_size": 1, "micro_batches": 8, "estimated_s": 0.27, "schedule": "zb-h1",
            "alternatives": [], "ruled_out": [why]}
    lines = plan_lines(plan)
    assert lines[0] == "why       4x1, micro-batch 1 x 8 per replica, schedule zb-h1: estimated 0.270 s per step"
    assert lines[-1] == f"  not     {why}"
    # without a pipeline every schedule runs the same: none is named
    assert "schedule" not in plan_lines({**plan, "P": 1, "D": 4, "ruled_out": []})[0]
