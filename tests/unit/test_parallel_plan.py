"""trainer.planning.parallel.ParallelPlan: the one plan value from the planner to a worker.

That it really crosses every hop (planner -> etcd -> daemon -> worker environment -> Varuna) is
shown by the daemon ring tests and by `test_a_new_field_crosses_every_hop_untouched` below."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.errors import ConfigError
from trainer.planning.parallel import ParallelPlan, ParallelPlanError, micro_batches, replica_slice, share_micro_batches
from trainer.worker_env import WorkerAssignment


def test_ranks_default_to_replica_major_and_positions_invert_them():
    plan = ParallelPlan(P=3, D=2)
    assert plan.ranks == ((0, 3), (1, 4), (2, 5))
    assert plan.stage_to_rank == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert [plan.position(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert all(plan.rank_of(*plan.position(r)) == r for r in range(6))
    assert plan.positions() == {r: plan.position(r) for r in range(6)}
    assert (plan.world_size, plan.shape) == (6, "3x2")
    with pytest.raises(ParallelPlanError, match="rank 6 is in no stage"):
        plan.position(6)


@pytest.mark.parametrize("fields, words", [
    (dict(P=0, D=1), "P must be an int >= 1"),
    (dict(P=10**9, D=10**9), "more than 65536 workers"),
    (dict(P=True, D=1), "P must be an int"),
    (dict(P=2, D=1.0), "D must be an int"),
    (dict(P=1, D=1, micro_batch_size=0), "micro_batch_size"),
    (dict(P=1, D=1, schedule="zigzag"), "schedule 'zigzag' is not one of"),
    (dict(P=1, D=1, schedule=["varuna"]), "is not one of"),
    (dict(P=1, D=1, micro_batch_size=10**40), "micro_batch_size must be an int in 1.."),
    (dict(P=2, D=1, cuts=(10**40,)), "increasing"),
    (dict(P=2, D=1, cuts=()), "needs 1 increasing cut points"),
    (dict(P=3, D=1, cuts=(4, 2)), "increasing"),
    (dict(P=3, D=1, cuts=(2, 2)), "increasing"),
    (dict(P=2, D=1, cuts=(-1,)), "increasing"),
    (dict(P=2, D=1, cuts=(True,)), "increasing"),
    (dict(P=2, D=1, recompute=(True,)), r"one true/false per stage \(2\)"),
    (dict(P=2, D=1, recompute=(1, 0)), "one true/false per stage"),
    (dict(P=2, D=2, ranks=((0, 1), (2,))), "2 stages of 2 replicas"),
    (dict(P=2, D=2, ranks=((0, 1), (2, 2))), "0..3 once each"),
    (dict(P=2, D=2, ranks=((0, 1), (2, 4))), "0..3 once each"),
    (dict(P=1, D=2, ranks=(("0", 1),)), "0..1 once each"),
    (dict(P=1, D=3, shares=(6, 4)), r"one number of examples >= 1 per replica \(3\)"),
    (dict(P=1, D=2, shares=(6, 4, 2)), r"per replica \(2\)"),
    (dict(P=1, D=2, shares=(6, 0)), "examples >= 1"),
    (dict(P=1, D=2, shares=(6, -1)), "examples >= 1"),
    (dict(P=1, D=2, shares=(True, 4)), "examples >= 1"),
    (dict(P=1, D=2, shares=(6, 4.0)), "examples >= 1"),
    (dict(P=1, D=2, shares=(6, 2**40)), "examples >= 1"),
    (dict(P=1, D=2, shares=10), "examples >= 1"),
])
def test_a_plan_that_is_not_one_is_refused_with_the_reason(fields, words):
    with pytest.raises(ParallelPlanError, match=words):
        ParallelPlan(**fields)
    with pytest.raises(ValueError):   # to code that builds one from input, a ValueError
        ParallelPlan(**fields)


def test_from_dict_reads_json_lists_ignores_a_newer_releases_fields_and_names_what_is_missing():
    plan = ParallelPlan(P=2, D=2, micro_batch_size=4, schedule="1f1b", cuts=(3,), recompute=(True, False),
                        ranks=((3, 0), (1, 2)))
    doc = json.loads(plan.to_json())
    assert doc["ranks"] == [[3, 0], [1, 2]] and doc["cuts"] == [3]
    assert ParallelPlan.from_dict({**doc, "interleave": 2}) == plan
    assert ParallelPlan.from_json(plan.to_json()) == plan and hash(ParallelPlan.from_json(plan.to_json())) == hash(plan)
    with pytest.raises(ParallelPlanError, match="malformed parallel plan.*'P'"):
        ParallelPlan.from_dict({"D": 2})
    with pytest.raises(ParallelPlanError, match="JSON object"):
        ParallelPlan.from_dict([2, 2])
    with pytest.raises(ParallelPlanError, match="is JSON"):
        ParallelPlan.from_json("{P=2}")


def test_the_original_varuna_stage_to_rank_map_becomes_a_plan():
    plan = ParallelPlan.from_stage_to_rank({"0": [5, 2], 1: ["0", 4], 2: [3, 1]})
    assert (plan.P, plan.D, plan.ranks) == (3, 2, ((5, 2), (0, 4), (3, 1)))
    with pytest.raises(ParallelPlanError, match="numbered 0..P-1"):
        ParallelPlan.from_stage_to_rank({0: [0], 2: [1]})
    with pytest.raises(ParallelPlanError, match="same number of replicas"):
        ParallelPlan.from_stage_to_rank({0: [0, 1], 1: [2]})
    with pytest.raises(ParallelPlanError, match="stage -> \\[ranks\\]"):
        ParallelPlan.from_stage_to_rank({0: "ab"})


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 6), D=st.integers(1, 6), data=st.data())
def test_any_valid_plan_survives_the_worker_environment(P, D, data):
    order = data.draw(st.permutations(range(P * D)))
    ranks = tuple(tuple(order[s * D + r] for r in range(D)) for s in range(P))
    cuts = tuple(sorted(data.draw(st.sets(st.integers(0, 40), min_size=P - 1, max_size=P - 1))))
    plan = ParallelPlan(P=P, D=D, ranks=ranks, cuts=data.draw(st.none() | st.just(cuts)),
                        recompute=data.draw(st.none() | st.lists(st.booleans(), min_size=P, max_size=P).map(tuple)),
                        micro_batch_size=data.draw(st.none() | st.integers(1, 64)),
                        schedule=data.draw(st.none() | st.sampled_from(["varuna", "gpipe", "1f1b"])),
                        shares=data.draw(st.none() | st.lists(st.integers(1, 64), min_size=D, max_size=D).map(tuple)))
    rank = data.draw(st.integers(0, P * D - 1))
    a = WorkerAssignment(rank=rank, plan=plan, endpoints=[f"tcp://h:{i}" for i in range(P * D)], dist_url="")
    back = WorkerAssignment.from_env(a.to_env())
    assert back.plan == plan and back.position() == plan.position(rank)


def test_a_new_field_crosses_every_hop_untouched():
    """What "adding a plan field touches the type, its producer and its consumer" rests on: a
    field the hops in between do not know (here added by subclassing) reaches the worker as it was
    written, through the etcd document and the worker environment."""
    from varunad.control.plans import PlanDoc, PlanSlot

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Wider(ParallelPlan):
        interleave: int = 1

    plan = Wider(P=1, D=2, interleave=3)
    doc = PlanDoc(kind="run", reason="t", job="j", plan=plan, dist_url="tcp://h:9",
                  slots=tuple(PlanSlot(rank=r, member=f"m{r}", slot=0, endpoint=f"tcp://h:{r}") for r in range(2)))
    stored = json.loads(doc.encode())
    assert stored["plan"]["interleave"] == 3
    a = WorkerAssignment(rank=1, plan=plan, endpoints=doc.endpoints(), dist_url=doc.dist_url)
    assert json.loads(a.to_env()["VARUNA_PLAN"])["interleave"] == 3
    assert Wider.from_json(a.to_env()["VARUNA_PLAN"]).interleave == 3


# -- uneven data-parallel shares ----------------------------------------------------------------------

def test_shares_round_trip_as_tuples_and_a_new_d_drops_them():
    plan = ParallelPlan(P=2, D=3, shares=[6, 4, 2])   # a JSON list comes back as the tuple the field holds
    assert plan.shares == (6, 4, 2)
    assert json.loads(plan.to_json())["shares"] == [6, 4, 2]
    back = ParallelPlan.from_json(plan.to_json())
    assert back == plan and type(back.shares) is tuple and hash(back) == hash(plan)
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    assert ParallelPlan(P=1, D=2).shares is None and ParallelPlan.from_json(ParallelPlan(P=1, D=2).to_json()).shares is None
    # three replicas' shares say nothing about two: a new D drops them, unless given with it
    assert plan.replace(P=3, D=2, ranks=None).shares is None
    assert plan.replace(P=3, D=2, ranks=None, shares=(7, 5)).shares == (7, 5)
    assert plan.replace(ranks=((3, 4, 5), (0, 1, 2))).shares == (6, 4, 2)   # renumbered: the same replicas
    assert ParallelPlan.from_stage_to_rank({0: [1, 0]}, shares=(3, 1)).shares == (3, 1)


@pytest.mark.parametrize("batch, replicas, shares, slices", [
    (12, 3, None, [(0, 4), (4, 4), (8, 4)]),
    (12, 3, (6, 4, 2), [(0, 6), (6, 4), (10, 2)]),
    (12, 3, (5, 4, 3), [(0, 5), (5, 4), (9, 3)]),
    (10, 3, (4, 3, 3), [(0, 4), (4, 3), (7, 3)]),   # shares need not divide the batch evenly
    (7, 1, (7,), [(0, 7)]),
    (7, 1, None, [(0, 7)]),
])
def test_replica_slices_are_contiguous_in_replica_order_and_tile_the_batch(batch, replicas, shares, slices):
    got = [replica_slice(batch, replicas, shares, r) for r in range(replicas)]
    assert got == slices
    assert [o for o, _ in got] == [sum(n for _, n in got[:r]) for r in range(replicas)]
    assert sum(n for _, n in got) == batch


def test_replica_slice_refuses_shares_that_are_not_the_batch_in_words_that_say_what_to_change():
    with pytest.raises(ConfigError, match=r"shares \[6, 4, 1\] add up to 11 examples, the global batch is 12") as info:
        replica_slice(12, 3, (6, 4, 1), 0)
    assert "add up to the global batch" in info.value.hint
    with pytest.raises(ConfigError, match=r"name 2 replicas, the plan has 3"):
        replica_slice(12, 3, (6, 6), 0)
    with pytest.raises(ConfigError, match="replica 3 is outside 0..2"):
        replica_slice(12, 3, (6, 4, 2), 3)
    with pytest.raises(ConfigError, match="replica True is outside"):
        replica_slice(12, 3, None, True)
    with pytest.raises(ConfigError, match="share of a replica must be a positive integer, got 0"):
        replica_slice(12, 2, (12, 0), 0)
    # without shares, the one rule's own words (micro_batches): the batch must split evenly
    with pytest.raises(ConfigError) as even:
        micro_batches(30, 4, 4)
    with pytest.raises(ConfigError, match="does not split evenly over 4 replicas") as sliced:
        replica_slice(30, 4, None, 0)
    assert str(sliced.value) == str(even.value) and sliced.value.hint == even.value.hint


def test_a_share_is_cut_into_micro_batches_as_the_even_split_is():
    assert share_micro_batches(5, 2) == (2, 2, 1)
    assert share_micro_batches(2, 4) == (2,)
    assert share_micro_batches(8, 4) == (4, 4)
    assert micro_batches(30, 2, 4) == share_micro_batches(15, 4)
    with pytest.raises(ConfigError, match="share must be a positive integer"):
        share_micro_batches(0, 4)
