"""The simulator replays build_table's lists; hand-checkable cases pin its arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.planning.calibration import Calibration, LinkCost, TiedWeights
from trainer.planning.schedule import SCHEDULES, Action, ScheduleError, build_table
from trainer.planning.simulator import SimulationError, StageCost, Transfer, simulate, stage_costs

F, B = 1.0, 2.0


def _equal(P, *, latency=0.0, transfer=0.0, **kw):
    link = Transfer(latency, transfer)
    return [StageCost(F, B, recompute_s=F, send_act=link, send_grad=link, **kw) for _ in range(P)]


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 6), m=st.integers(1, 10), ar=st.sampled_from([0.0, 0.5]))
def test_gpipe_on_a_free_network_takes_m_plus_p_minus_1_slots(P, m, ar):
    result = simulate(build_table("gpipe", P, m, False), _equal(P, allreduce_s=ar, step_s=0.25))
    assert result.minibatch_s == pytest.approx((m + P - 1) * (F + B) + ar + 0.25)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_single_stage_is_m_times_forward_plus_backward(name):
    result = simulate(build_table(name, 1, 5), _equal(1))
    assert result.minibatch_s == pytest.approx(5 * (F + B))
    (stage,) = result.stages
    assert stage.compute_s == pytest.approx(15.0) and stage.idle_s == pytest.approx(0.0)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_send_latency_is_paid_once_each_way_in_two_stages(m):
    table = build_table("gpipe", 2, m, False)
    free = simulate(table, _equal(2)).minibatch_s
    slow = simulate(table, _equal(2, latency=0.3)).minibatch_s
    # the critical path crosses the link once forward (first micro-batch) and once back (last)
    assert slow - free == pytest.approx(2 * 0.3)


def test_sends_on_one_link_queue_behind_each_other():
    # forward 1 s, each activation needs 3 s on the wire: micro-batch 1 arrives at 1 + 3 + 3
    costs = [
        StageCost(F, B, send_act=Transfer(0.0, 3.0)),
        StageCost(F, B),
    ]
    result = simulate(build_table("gpipe", 2, 2, False), costs)
    # stage 1: F0 at 4..5, F1 at 7..8, B0 8..10, B1 10..12; stage 0: B0 10..12, B1 12..14
    assert result.stages[1].finish_s == pytest.approx(12.0)
    assert result.minibatch_s == pytest.approx(14.0)


def test_recompute_costs_time_where_the_table_has_it():
    P, m = 3, 4
    with_r = simulate(build_table("gpipe", P, m, True), _equal(P)).stages
    without = simulate(build_table("gpipe", P, m, False), _equal(P)).stages
    assert with_r[0].compute_s == pytest.approx(without[0].compute_s + m * F)
    assert with_r[2].compute_s == pytest.approx(without[2].compute_s)  # last stage never recomputes


def test_a_forward_that_keeps_its_graph_costs_forward_graph_s():
    # one stage never recomputes: every FORWARD keeps the graph
    alone = simulate(build_table("varuna", 1, 4), [StageCost(F, B, recompute_s=1.5, forward_graph_s=1.5)])
    assert alone.minibatch_s == pytest.approx(4 * (1.5 + B))
    # two stages: the first recomputes (F without the graph, then R), the last keeps its graph
    costs = [StageCost(F, B, recompute_s=1.5, forward_graph_s=1.5) for _ in range(2)]
    stages = simulate(build_table("gpipe", 2, 3, True), costs).stages
    assert stages[0].compute_s == pytest.approx(3 * (F + 1.5 + B))
    assert stages[1].compute_s == pytest.approx(3 * (1.5 + B))
    # without recompute the first stage keeps its graph too
    assert simulate(build_table("gpipe", 2, 3, False), costs).stages[0].compute_s == pytest.approx(3 * (1.5 + B))
    assert StageCost(F, B).forward_graph_s == F   # unspecified: the plain forward


def test_message_overheads_keep_both_stages_busy():
    link = Transfer(0.0, 0.0, send_s=0.1, recv_s=0.2)
    costs = [StageCost(F, B, send_act=link, send_grad=link) for _ in range(2)]
    result = simulate(build_table("gpipe", 2, 1, False), costs)
    # F0 | send 0.1 | recv 0.2, F1, B1 | send 0.1 | recv 0.2, B0: the critical path pays each twice
    assert result.minibatch_s == pytest.approx(2 * (F + B) + 2 * 0.3)
    assert [st.message_s for st in result.stages] == pytest.approx([0.3, 0.3])
    # with m micro-batches every stage pays m messages each way
    result = simulate(build_table("1f1b", 2, 4, False), costs)
    assert [st.message_s for st in result.stages] == pytest.approx([4 * 0.3, 4 * 0.3])


def test_tied_allreduce_waits_for_every_holder():
    costs = [StageCost(F, B, tied_allreduce_s=0.5, step_s=0.25) for _ in range(2)]
    result = simulate(build_table("gpipe", 2, 1, False), costs)
    # stage 1 is done at 4 but meets stage 0 in the all-reduce at 6; both then sum for 0.5
    assert result.minibatch_s == pytest.approx(2 * (F + B) + 0.5 + 0.25)
    assert [st.finish_s for st in result.stages] == pytest.approx([6.75, 6.75])
    assert result.stages[1].allreduce_s == pytest.approx(0.5)
    # one holder alone has nobody to meet (its copies are summed locally, for free)
    alone = simulate(build_table("gpipe", 1, 1, False), [StageCost(F, B, tied_allreduce_s=0.5)])
    assert alone.minibatch_s == pytest.approx(F + B)


def test_stage_costs_charge_tied_weights_and_message_overheads():
    link = LinkCost(1e-3, 1e3, send_overhead_s=0.01, recv_overhead_s=0.02)
    cal = Calibration.uniform(
        model="m", device_kind="k", segments=4, micro_batch_sizes=(1,), forward_s=0.1, backward_s=0.2,
        recompute_s=0.15, activation_bytes=50, peak_activation_bytes=70, param_bytes=300, optimizer_bytes=600,
        links={"intra": link, "inter": link}, allreduce={"intra": LinkCost(0.0, 1e3), "inter": LinkCost(0.0, 1e2)},
        tied=[TiedWeights((0, 3), 100)],
    )
    s0, s1 = stage_costs([cal, cal], [0, 2, 4], 1, 1, ["intra"], ["intra", "intra"])
    assert (s0.forward_s, s0.forward_graph_s) == pytest.approx((0.2, 0.3))
    assert s0.send_act == Transfer(1e-3, 50 / 1e3, 0.01, 0.02) and s1.send_grad == Transfer(1e-3, 50 / 1e3, 0.01, 0.02)
    # D = 1: no data-parallel all-reduce, but the first and last stage sum the tied 100 bytes
    assert s0.allreduce_s == s1.allreduce_s == 0
    assert s0.tied_allreduce_s == s1.tied_allreduce_s == pytest.approx(100 / 1e3)
    # D = 2: the tied weights leave the stages' rings for the tied group of 4 workers
    s0, s1 = stage_costs([cal, cal], [0, 2, 4], 1, 2, ["intra"], ["intra", "inter"])
    assert s0.allreduce_s == pytest.approx(500 / 1e3) and s1.allreduce_s == pytest.approx(500 / 1e2)
    assert s0.tied_allreduce_s == pytest.approx(2 * 3 / 4 * 100 / 1e2)   # crosses hosts: "inter"
    # one stage holds both copies: no tied all-reduce, one copy in its ring
    (one,) = stage_costs([cal], [0, 4], 1, 2, [], ["intra"])
    assert one.tied_allreduce_s == 0 and one.allreduce_s == pytest.approx(1100 / 1e3)


MEM = dict(static_bytes=1000, input_bytes=10, activation_bytes=100)


@pytest.mark.parametrize(
    "name, recompute, stage, expected",
    [
        ("1f1b", True, 0, 1000 + 4 * 10 + 100),  # P-s inputs, one recomputed set
        ("1f1b", True, 2, 1000 + 2 * 10 + 100),
        ("1f1b", False, 0, 1000 + 4 * 110),  # P-s full sets
        ("1f1b", False, 3, 1000 + 110),  # the last stage holds one
        ("gpipe", False, 1, 1000 + 6 * 110),  # everything in flight
        ("gpipe", True, 0, 1000 + 6 * 10 + 100),
        ("varuna", True, 0, 1000 + 6 * 10 + 100),  # bound 2(P-s) = 8 > m: all inputs
        ("varuna", True, 2, 1000 + 4 * 10 + 100),  # the bound 2(P-s) = 4 inputs
        ("varuna", False, 1, 1000 + 3 * 110),
    ],
)
def test_peak_memory_follows_the_schedule(name, recompute, stage, expected):
    P, m = 4, 6
    costs = [StageCost(F, B, recompute_s=F, **MEM) for _ in range(P)]
    result = simulate(build_table(name, P, m, recompute), costs)
    assert result.stages[stage].peak_bytes == expected
    # a pass's working bytes come once, on top of the most it stashes (a pass runs at its peak)
    working = [StageCost(F, B, recompute_s=F, working_bytes=7, **MEM) for _ in range(P)]
    assert simulate(build_table(name, P, m, recompute), working).stages[stage].peak_bytes == expected + 7


def test_stage_costs_sum_segments_and_pick_link_kinds():
    links = {"intra": LinkCost(0.0, 1000.0), "inter": LinkCost(0.5, 100.0)}
    cal = Calibration.uniform(
        model="m", device_kind="k", segments=5, micro_batch_sizes=(1, 2), forward_s=0.1, backward_s=0.2,
        activation_bytes=50, peak_activation_bytes=70, param_bytes=300, optimizer_bytes=600, step_s=0.01,
        input_bytes=4, links=links, allreduce={"intra": LinkCost(0.0, 1e3), "inter": LinkCost(0.01, 1e2)},
    )
    costs = stage_costs([cal, cal], [0, 2, 5], 2, 4, ["inter"], ["intra", "inter"])
    s0, s1 = costs
    assert (s0.forward_s, s0.backward_s, s0.recompute_s) == pytest.approx((0.4, 0.8, 0.4))
    assert (s1.forward_s, s1.step_s) == pytest.approx((0.6, 0.03))
    assert s0.send_act == Transfer(0.5, 100 / 100.0)  # 2 samples x 50 bytes over "inter"
    assert s1.send_grad == Transfer(0.5, 1.0) and s1.send_act == Transfer()
    assert (s0.input_bytes, s1.input_bytes) == (8, 100)
    assert s1.activation_bytes == 3 * 140 and s1.static_bytes == 3 * 1200
    assert s0.allreduce_s == pytest.approx(2 * 3 / 4 * 600 / 1e3)
    assert s1.allreduce_s == pytest.approx(2 * 3 / 4 * 900 / 1e2 + 6 * 0.01)
    with pytest.raises(SimulationError, match="rise strictly"):
        stage_costs([cal, cal], [0, 5, 5], 2, 4, ["inter"], ["intra", "inter"])
    with pytest.raises(SimulationError, match="unknown link kind"):
        stage_costs([cal, cal], [0, 2, 5], 2, 4, ["wifi"], ["intra", "inter"])


def test_mismatched_costs_and_deadlocks_are_reported():
    with pytest.raises(SimulationError, match="3 stage costs"):
        simulate(build_table("1f1b", 2, 2), _equal(3))
    table = {s: list(v) for s, v in build_table("1f1b", 2, 2).items()}
    i, j = table[0].index(Action.parse("0SA0")), table[0].index(Action.parse("0RG0"))
    table[0][i], table[0][j] = table[0][j], table[0][i]
    with pytest.raises(ScheduleError, match="0RG0 never receives"):
        simulate(table, _equal(2))


def test_jitter_is_seeded_and_only_slows_down():
    table = build_table("1f1b", 4, 8)
    costs = _equal(4, transfer=0.05)
    base = simulate(table, costs).minibatch_s
    a = simulate(table, costs, jitter_s=0.5, seed=3).minibatch_s
    assert a == simulate(table, costs, jitter_s=0.5, seed=3).minibatch_s
    assert a != simulate(table, costs, jitter_s=0.5, seed=4).minibatch_s
    assert a > base


@pytest.mark.parametrize("P, m", [(4, 8), (8, 32)])
@pytest.mark.parametrize("balanced", [False, True])
def test_varuna_absorbs_a_noisy_network_better_than_gpipe_and_1f1b(P, m, balanced):
    costs = _equal(P, transfer=0.05)
    if balanced:  # the last stage never recomputes; a balanced partition gives it more layers
        costs[-1] = StageCost(4 * F / 3, 4 * B / 3)

    def mean_time(name):
        table = build_table(name, P, m, True)
        return np.mean([simulate(table, costs, jitter_s=0.5, seed=k).minibatch_s for k in range(20)])

    varuna = mean_time("varuna")
    assert varuna < mean_time("1f1b")
    assert varuna < mean_time("gpipe")
