"""One rule for batch and micro-batch sizes (trainer.planning.parallel.micro_batches), followed by the
engine under the launcher, by `varunactl submit` and by the planner: a replica's share of the global
batch is cut into micro-batches of the chosen size, the last one smaller when the size does not
divide the share; only a global batch that does not split evenly over the replicas is refused, in
the same words everywhere."""

from __future__ import annotations

import pytest

from trainer.errors import ConfigError
from trainer.planning.calibration import Calibration, LinkCost
from trainer.planning.parallel import micro_batches
from trainer.planning.plan import Slot
from trainer.planning.planner import plan
from varunad.control.jobs import JobSpec, JobSpecError

FREE = {"intra": LinkCost(0.0, 1e18), "inter": LinkCost(0.0, 1e18)}


@pytest.mark.parametrize("batch, replicas, chunk, sizes", [
    (30, 1, 4, (4, 4, 4, 4, 4, 4, 4, 2)),
    (30, 2, 4, (4, 4, 4, 3)),
    (12, 3, 4, (4,)),
    (6, 3, 4, (2,)),  # a size above the share: one micro-batch of the whole share
    (8, 2, 2, (2, 2)),
])
def test_a_share_is_cut_into_micro_batches_the_last_one_smaller(batch, replicas, chunk, sizes):
    assert micro_batches(batch, replicas, chunk) == sizes
    assert sum(micro_batches(batch, replicas, chunk)) * replicas == batch


def test_a_batch_that_does_not_split_over_the_replicas_is_refused_with_what_fits():
    with pytest.raises(ConfigError, match=r"the global batch 30 does not split evenly over 4 replicas .*"
                                          r"divisible by 4, or one of 1, 2, 3, 5, 6, 10, 15, 30 replicas"):
        micro_batches(30, 4, 4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="must be a positive integer"):
            micro_batches(8, 1, bad)


def _spec(**kw) -> JobSpec:
    return JobSpec(**{**dict(job="j", script="train.py", batch_size=30, steps=3, checkpoint_every=3,
                             bundle_digest="a" * 64, bundle_bytes=10), **kw})


def test_submit_takes_the_job_the_launcher_trains_and_refuses_in_the_rules_words():
    """batch 30, micro-batch 4: the launcher trained it; the job spec (what submit builds) takes it."""
    assert _spec(chunk_size=4).micro_batch_sizes() == [4]
    with pytest.raises(JobSpecError, match="the micro-batch size must be a positive integer, got 0"):
        _spec(chunk_size=0)


def test_the_planner_plans_a_fixed_micro_batch_that_leaves_a_smaller_last_one():
    """Two slots, global batch 30, the job's micro-batch 4: the planner finds a plan (before, none
    fit: it asked for whole micro-batches of 4), its m counts the smaller last micro-batch, and
    it never picks a replica count that does not divide the batch."""
    cal = Calibration.uniform(model="toy", device_kind="cpu", segments=4, micro_batch_sizes=(1, 2, 4), forward_s=0.01,
                              backward_s=0.02, activation_bytes=100, peak_activation_bytes=1000, param_bytes=1000,
                              optimizer_bytes=2000, links=FREE)
    slots = [Slot(f"s{i}", "host", "cpu", 2**30) for i in range(4)]
    p = plan(slots, 30, [cal], micro_batch_sizes=[4])
    assert p.micro_batch_size == 4 and 30 % p.D == 0
    assert p.micro_batches == len(micro_batches(30, p.D, 4))
    # the planner's own choice (auto) still cuts each share evenly
    auto = plan(slots, 30, [cal], micro_batch_sizes=[1, 2, 3, 5, 6, 10, 15, 30])
    assert 30 % (auto.D * auto.micro_batch_size) == 0


