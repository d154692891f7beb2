"""The planner on small fleets whose best configuration can be worked out by hand.

Unit: one segment's forward + backward = 3 s per sample (forward 1, backward 2) unless stated;
on a free network P stages x D replicas of a uniform model take (m + P - 1) * 3 * n/P seconds,
with m = global batch / D for micro-batch size 1.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from support.calibrations import calibration

from trainer.planning.calibration import Calibration, LinkCost
from trainer.planning.parallel import ParallelPlan
from trainer.planning.plan import ModelTooLarge, Plan, PlanError, Slot, StagePlan
from trainer.planning.planner import plan
from trainer.planning.schedule import SCHEDULES, validate
from trainer.planning.simulator import simulate, stage_costs

GiB = 2**30
FREE = {"intra": LinkCost(0.0, 1e18), "inter": LinkCost(0.0, 1e18)}


def _cal(kind="gpu", f=1.0, segments=4, param=GiB // 2, opt=GiB, peak=1000, links=FREE, allreduce=None, sizes=(1,)):
    return calibration(segments, model="toy", kind=kind, sizes=sizes, forward_s=f, activation_bytes=100,
                       peak_activation_bytes=peak, input_bytes=0, param_bytes=param, optimizer_bytes=opt, links=links,
                       allreduce=allreduce)


def _slots(n, kind="gpu", mem=64, per_host=4, prefix=""):
    return [Slot(f"{prefix}{kind}{i}", f"{prefix}{kind}-host{i // per_host}", kind, mem * GiB) for i in range(n)]


def test_free_network_prefers_pure_data_parallelism():
    # P=1, D=4: m=2, 2 x 12 = 24 s; P=2, D=2: (4+1) x 6 = 30 s; P=4, D=1: (8+3) x 3 = 33 s
    p = plan(_slots(4), 8, [_cal()])
    assert (p.P, p.D, p.micro_batches) == (1, 4, 2)
    assert p.estimated_s == pytest.approx(24.0)
    assert p.cuts == () and p.notes == ()


def test_expensive_all_reduce_pushes_towards_a_deep_pipeline():
    slow_ring = {"intra": LinkCost(0.0, 1e6), "inter": LinkCost(0.0, 1e6)}  # 1 MB/s
    p = plan(_slots(4), 8, [_cal(allreduce=slow_ring)])
    assert (p.P, p.D) == (4, 1)  # the only configuration without an all-reduce
    assert p.cuts == (0, 1, 2)
    assert p.estimated_s == pytest.approx(33.0)


def test_auto_takes_the_schedule_whose_replay_is_fastest():
    # 4 x 1 with a backward of two units split in halves: zb-h1 drains in (P-1) units, so
    # 8 x 3 + 3 = 27 s against 33 s for 1F1B's order (Varuna's and GPipe's are no faster here)
    slow_ring = {"intra": LinkCost(0.0, 1e6), "inter": LinkCost(0.0, 1e6)}
    each = {name: plan(_slots(4), 8, [_cal(allreduce=slow_ring)], schedule=name) for name in SCHEDULES}
    assert each["1f1b"].estimated_s == pytest.approx(33.0)
    assert each["zb-h1"].estimated_s == pytest.approx(27.0)
    p = plan(_slots(4), 8, [_cal(allreduce=slow_ring)], schedule="auto")
    assert p.parallel.schedule == "zb-h1" and p.estimated_s == min(x.estimated_s for x in each.values())
    assert p.ruled_out[-1].startswith("the other schedules: varuna (4x1) ")
    assert p.ruled_out[-1].endswith("(schedule zb-h1: 27.000 s)")
    validate(p.table(), p.P, p.micro_batches, p.recompute)
    # a tie goes to the schedule listed first: without a pipeline every schedule is the same
    tie = plan(_slots(4), 8, [_cal()], schedule="auto")
    assert (tie.P, tie.parallel.schedule) == (1, "varuna")


def test_memory_forces_a_pipeline_and_balances_the_cut():
    # static 2 GiB per segment, 8 GiB x 0.9 usable: at most 3 segments per slot, so P >= 2;
    # P=2, D=2 (m=4): 5 x 6 = 30 s beats P=4, D=1: 33 s
    p = plan(_slots(4, mem=8), 8, [_cal()])
    assert (p.P, p.D, p.cuts) == (2, 2, (1,))
    assert [(s.first_segment, s.end_segment) for s in p.stages] == [(0, 2), (2, 4)]
    assert all(s.memory_bytes <= s.capacity_bytes for s in p.stages)


def test_what_every_worker_holds_beyond_its_tensors_counts_on_every_stage():
    # 10 GiB x 0.9 usable holds the whole model's 8 GiB of state: P=1; with 1.5 GiB of cuBLAS
    # workspaces on every worker (a GPU calibration's worker_bytes) it no longer does
    assert plan(_slots(4, mem=10), 8, [_cal()]).P == 1
    held = dataclasses.replace(_cal(), worker_bytes=3 * GiB // 2)
    p = plan(_slots(4, mem=10), 8, [held])
    assert (p.P, p.D) == (2, 2)
    assert all(s.memory_bytes >= 4 * GiB + 3 * GiB // 2 for s in p.stages)
    assert all(s.memory_bytes <= s.capacity_bytes for s in p.stages)


def test_recompute_only_where_the_stash_does_not_fit():
    # big activations: stage 0 of 2 stashes 2 micro-batches (4 GiB each) and must recompute;
    # the last stage stashes one and keeps its graph
    # big activations (3 GiB per segment and sample), 6 GiB x 0.9 usable: one stage cannot hold
    # both segments' graphs (0.5 + 2 x 3 GiB each); stage 0 of 2 would stash 2 full sets
    # (6.5 GiB) so it recomputes (3.5 GiB), the last stage keeps one (3.5 GiB)
    cal = _cal(segments=2, param=GiB // 8, opt=GiB // 4, peak=3 * GiB)
    p = plan(_slots(2, mem=6), 8, [cal])
    assert p.P == 2
    assert p.recompute == (True, False)
    assert p.stages[0].memory_bytes < 8 * GiB * 0.9
    validate(p.table(), p.P, p.micro_batches, p.recompute)


def test_micro_batches_must_be_whole():
    # 6 samples over 4 slots: D=4 does not divide the batch, so D is 1, 2 or 3
    p = plan(_slots(4), 6, [_cal()])
    assert p.D in (1, 2, 3) and p.D * p.micro_batches * p.micro_batch_size == 6
    # P=1, D=3 (m=2: 2 x 12 s) ties with P=2, D=2 (m=3: 4 x 6 s); ties go to the shallower pipeline
    assert (p.P, p.D) == (1, 3) and p.estimated_s == pytest.approx(24.0)
    assert len(p.unused) == 1 and "1 slots idle" in p.notes[-1]


def test_larger_micro_batches_win_when_they_are_cheaper_per_sample():
    cal = Calibration.uniform(
        model="toy", device_kind="gpu", segments=2, micro_batch_sizes=(1, 2), forward_s=1.0, backward_s=2.0,
        activation_bytes=1, peak_activation_bytes=1, param_bytes=1, optimizer_bytes=1, links=FREE,
    )
    cheaper = [
        seg.__class__(seg.param_bytes, seg.optimizer_bytes, seg.step_s,
                      (seg.costs[0], seg.costs[1].__class__(1.0, 2.0, 1.0, 2, 2)))  # batch 2 costs what 1 does
        for seg in cal.segments
    ]
    cal = Calibration(model="toy", device_kind="gpu", micro_batch_sizes=(1, 2), input_bytes=(0, 0),
                      segments=tuple(cheaper), links=FREE, allreduce=FREE)
    p = plan(_slots(1), 8, [cal])
    assert (p.micro_batch_size, p.micro_batches) == (2, 4)


def test_neighbour_stages_share_a_host():
    # 8 GiB slots hold 3 segments at most, so P >= 2; P=2, D=2 takes 30 s plus an all-reduce of
    # 1 GiB over 1 GiB/s (1 s), P=4, D=1 33 s. Two slots per host: each replica's pair shares one.
    ring = {"intra": LinkCost(0.0, GiB), "inter": LinkCost(0.0, GiB)}
    slots = _slots(4, per_host=2, mem=8)
    p = plan(slots, 8, [_cal(allreduce=ring)])
    assert (p.P, p.D) == (2, 2) and p.estimated_s == pytest.approx(31.0)
    host = {s.slot_id: s.host for s in slots}
    for r in range(p.D):
        pair = [slot for slot, (st, rep) in p.assignment.items() if rep == r]
        assert len({host[x] for x in pair}) == 1
    assert p.link_kinds == ("intra",) and p.allreduce_kinds == ("inter", "inter")
    assert p.stage_to_slots() == {0: ["gpu0", "gpu2"], 1: ["gpu1", "gpu3"]}


def test_a_slower_kind_gets_fewer_layers():
    # 12 segments of 2 GiB static; 2 fast slots (10 GiB x 0.9: 4 segments each) cannot hold them
    # all; 2 slow slots (2x slower, 32 GiB). Best: 4 stages, slow ones first (more memory, and
    # early stages stash more), 2 segments per slow stage and 4 per fast one: every stage takes
    # 12 s per micro-batch, (8 + 3) x 12 = 132 s.
    slots = _slots(2, "fast", mem=10) + _slots(2, "slow", mem=32)
    p = plan(slots, 8, [_cal("fast", 1.0, segments=12), _cal("slow", 2.0, segments=12)])
    assert [s.device_kind for s in p.stages] == ["slow", "slow", "fast", "fast"]
    assert [s.end_segment - s.first_segment for s in p.stages] == [2, 2, 4, 4]
    assert all(s.compute_s == pytest.approx(12.0) for s in p.stages)
    assert p.estimated_s == pytest.approx(132.0)


def test_a_kind_that_would_slow_the_pipeline_is_left_out_and_named():
    slots = _slots(4, "fast") + _slots(4, "slow")
    p = plan(slots, 8, [_cal("fast", 1.0), _cal("slow", 5.0)])
    assert {s.device_kind for s in p.stages} == {"fast"}
    assert any(n.startswith("left out slow (4 slots)") for n in p.notes)
    assert all(not slot.startswith("slow") for slot in p.assignment)


def test_uncalibrated_kinds_are_named():
    p = plan(_slots(2) + _slots(2, "tpu"), 4, [_cal()])
    assert "left out tpu (2 slots): no calibration for this device kind" in p.notes


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_plan_estimate_is_a_replay_of_its_own_table(schedule):
    links = {"intra": LinkCost(1e-3, 1e3), "inter": LinkCost(1e-2, 1e2)}
    slots = _slots(8, per_host=2, mem=8)
    p = plan(slots, 16, [_cal(links=links)], schedule=schedule)
    assert p.P > 1, p.explain()
    costs = stage_costs([_cal(links=links)] * p.P, [s.first_segment for s in p.stages] + [4],
                        p.micro_batch_size, p.D, p.link_kinds, p.allreduce_kinds)
    replay = simulate(p.table(), costs)
    assert replay.minibatch_s == pytest.approx(p.estimated_s)
    for stage, peak in zip(p.stages, replay.peak_bytes):
        assert peak <= stage.memory_bytes  # the planner's memory is the schedule's bound


def _working(cal: Calibration, by_segment: dict[int, int]) -> Calibration:
    """`cal` with a pass's working bytes measured on the given segments (0 elsewhere)."""
    segs = tuple(dataclasses.replace(seg, costs=tuple(dataclasses.replace(c, working_bytes=by_segment.get(i, 0))
                                                      for c in seg.costs))
                 for i, seg in enumerate(cal.segments))
    return dataclasses.replace(cal, segments=segs)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_stage_is_promised_its_largest_segments_working_bytes(schedule):
    """A loss's logits and their gradients live only while the last segment's passes run: the
    stage holding it is promised them once (not per micro-batch), another stage its own largest."""
    cal = _cal(links={"intra": LinkCost(1e-3, 1e3), "inter": LinkCost(1e-2, 1e2)})
    worked = _working(cal, {0: 7_000, 1: 9_000, 3: 300_000_000})
    p = plan(_slots(8, per_host=2, mem=8), 16, [cal], schedule=schedule)
    q = plan(_slots(8, per_host=2, mem=8), 16, [worked], schedule=schedule)
    assert (q.P, q.cuts) == (p.P, p.cuts) and p.P > 1, q.explain()
    held = {s.first_segment: (s.end_segment, s.memory_bytes) for s in p.stages}
    for stage in q.stages:
        end, before = held[stage.first_segment]
        extra = max({0: 7_000, 1: 9_000, 3: 300_000_000}.get(i, 0) for i in range(stage.first_segment, end))
        assert stage.memory_bytes == before + extra
    costs = stage_costs([worked] * q.P, [s.first_segment for s in q.stages] + [4], q.micro_batch_size, q.D,
                        q.link_kinds, q.allreduce_kinds)
    replay = simulate(q.table(), costs)
    assert replay.peak_bytes[-1] > 300_000_000
    for stage, peak in zip(q.stages, replay.peak_bytes):
        assert peak <= stage.memory_bytes  # the planner's memory is still the schedule's bound


def test_working_bytes_can_push_a_model_onto_more_stages():
    """Twice the logits on the last stage is what made a plan that fit on paper fail on a slot."""
    cal = _cal(param=GiB // 4, opt=GiB // 2)   # 1 GiB a segment: the four fit one 5 GiB slot
    p = plan(_slots(2, mem=5), 2, [cal])
    q = plan(_slots(2, mem=5), 2, [_working(cal, {3: GiB})])
    assert p.P == 1 and q.P == 2, (p.explain(), q.explain())
    assert max(s.memory_bytes for s in q.stages) <= 5 * GiB


def test_explain_prints_the_choice_and_its_runners_up():
    p = plan(_slots(4), 8, [_cal()])
    text = p.explain()
    assert text.splitlines()[0].startswith("plan: P=1 x D=4, micro-batch 1, m=2, schedule varuna")
    rows = [line for line in text.splitlines() if re.match(r"^[* ]\s*\d+ x", line)]
    assert rows[0].startswith("* 1 x  4") and len(rows) == len(p.candidates) > 3
    assert sum(r.startswith("*") for r in rows) == 1
    assert p.candidates[0].simulated_s == pytest.approx(24.0)
    unverified = [c.estimate_s for c in p.candidates if c.simulated_s is None]
    assert unverified == sorted(unverified)


def test_nothing_fits_says_what_to_change():
    # each segment (2 GiB of weights and training state) fits a 3 GiB slot, the four do not fit two
    with pytest.raises(PlanError, match="no configuration of 2 slots fits") as err:
        plan(_slots(2, mem=3), 8, [_cal()])
    assert "add slots or memory" in str(err.value) and not isinstance(err.value, ModelTooLarge)


def test_a_segment_no_slot_holds_is_refused_in_numbers_as_beyond_any_number_of_slots():
    """More slots cannot help a segment larger than a slot: the leader fails such a job instead
    of keeping it queued (and the queue behind it) for good."""
    with pytest.raises(ModelTooLarge, match=r"the model cannot fit any number of these slots: the first of its 4 "
                                            r"segments .* needs 2048\.0 MiB on a gpu slot even alone on a stage at "
                                            r"micro-batch 1 \(its weights and training state 2048\.0 MiB\), and a "
                                            r"slot has 1945\.6 MiB usable") as err:
        plan(_slots(64, mem=2), 8, [_cal()], memory_fraction=0.95)
    assert "CutPoints" in err.value.hint and "more memory" in err.value.hint


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="zigzag"), "schedule .zigzag. is not one of"),
        (dict(memory_fraction=0.0), "memory_fraction"),
        (dict(micro_batch_sizes=(3,)), "no micro-batch size"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan(_slots(2), 8, [_cal()], **kwargs)


def test_inputs_are_checked():
    with pytest.raises(PlanError, match="unique"):
        plan(_slots(2) + _slots(1), 8, [_cal()])
    with pytest.raises(PlanError, match="disagree"):
        plan(_slots(2), 8, [_cal("a"), _cal("b", segments=5)])
    with pytest.raises(PlanError, match="no slot has a calibrated"):
        plan(_slots(2, "tpu"), 8, [_cal()])
    with pytest.raises(ValueError):
        Slot("a", "h", "gpu", 0)


def test_plan_validates_itself():
    stage = StagePlan(0, 4, "gpu", False, 1, 2, 1.0)
    par = ParallelPlan(P=1, D=2, micro_batch_size=1, schedule="varuna", cuts=(), recompute=(False,))
    good = dict(parallel=par, micro_batches=4, global_batch=8, stages=(stage,),
                assignment={"a": (0, 0), "b": (0, 1)}, link_kinds=(), allreduce_kinds=("intra",), estimated_s=1.0)
    assert (Plan(**good).P, Plan(**good).D, Plan(**good).recompute) == (1, 2, (False,))
    with pytest.raises(PlanError, match="global batch"):
        Plan(**{**good, "micro_batches": 3})
    with pytest.raises(PlanError, match="exactly one slot"):
        Plan(**{**good, "assignment": {"a": (0, 0), "b": (0, 0)}})
    with pytest.raises(PlanError, match="recompute flags"):
        Plan(**{**good, "parallel": par.replace(recompute=(True,))})
    with pytest.raises(PlanError, match="decides micro-batch"):
        Plan(**{**good, "parallel": par.replace(cuts=None)})
    with pytest.raises(ValueError, match="increasing cut points"):
        par.replace(cuts=(1,))


def test_the_plan_names_its_alternatives_and_what_ruled_out_the_obvious_ones():
    # 2 GiB of weights and optimizer state per segment, 7.2 GiB usable per slot: no single slot
    # holds the model, so neither every slot data-parallel (1x4) nor one slot (1x1) can run
    p = plan(_slots(4, mem=8), 8, [_cal()])
    assert (p.P, p.D) == (2, 2)
    assert [r.split(":")[0] for r in p.ruled_out] == ["1x4 (every slot data-parallel)", "1x1 (one slot)"]
    assert all("memory: one gpu slot cannot hold the whole model" in r for r in p.ruled_out), p.ruled_out
    alternatives = p.alternatives(3)
    assert 1 <= len(alternatives) <= 3 and all((c.P, c.D) != (2, 2) or c.micro_batch_size != 1
                                                for c in alternatives)
    assert "not: 1x4 (every slot data-parallel): memory" in p.explain()
    # a global batch that does not split over every slot rules 1xN out by the micro-batch count
    q = plan(_slots(3), 8, [_cal()])
    assert any(r.startswith("1x3 (every slot data-parallel): the global batch 8 does not split") for r in q.ruled_out)
