"""The tree the step statistics are summed over (trainer.engine.setup.stats_tree).

The sum itself is shown against real workers by test_correctness (the loss every P x D reports
is the tree's sum) and test_worker_control (checkpoint and stop requests travel in it)."""

from __future__ import annotations

import pytest

from trainer.engine.setup import stats_tree as _stats_tree
from trainer.planning.parallel import ParallelPlan


def _layout(P: int, D: int) -> dict[int, list[int]]:
    return {s: [r * P + s for r in range(D)] for s in range(P)}


def stats_tree(layout: dict[int, list[int]], stage: int, replica: int):
    return _stats_tree(ParallelPlan.from_stage_to_rank(layout), stage, replica)


@pytest.mark.parametrize("P,D", [(2, 1), (1, 3), (3, 2), (4, 4), (8, 32)])
def test_every_worker_reaches_the_root_through_consistent_edges(P, D):
    layout = _layout(P, D)
    tree = {layout[s][r]: stats_tree(layout, s, r) for s in range(P) for r in range(D)}
    roots = [rank for rank, (parent, _) in tree.items() if parent is None]
    assert roots == [layout[0][0]]
    for rank, (parent, children) in tree.items():
        for child in children:
            assert tree[child][0] == rank   # a child names this worker as its parent
        if parent is not None:
            assert rank in tree[parent][1]
        depth, at = 0, rank
        while tree[at][0] is not None:
            at, depth = tree[at][0], depth + 1
        assert at == roots[0] and depth <= 2   # two levels: stage 0 of the replica, then the root
    assert sum(len(c) for _, c in tree.values()) == P * D - 1


def test_stage_zero_of_each_replica_gathers_its_own_pipeline():
    layout = {0: [5, 2], 1: [0, 4], 2: [3, 1]}   # any rank numbering, as a script's map may give
    assert stats_tree(layout, 0, 1) == (5, [4, 1])
    assert stats_tree(layout, 0, 0) == (None, [0, 3, 2])
    assert stats_tree(layout, 2, 1) == (2, [])
