"""Uneven data-parallel shares (`ParallelPlan.shares`: a slow replica takes fewer examples of the
global batch) train the plain loop's model, dropout and stochastic depth included: the replicas'
slices stay contiguous in replica order, the loss is normalised by the global batch, gradients
are summed and every draw is keyed by its example's global index
([Note: the global batch defines the math] in ARCHITECTURE.md).

Real worker processes, real gloo and ZeroMQ, through the launcher's `shares`. The worker script
(tests/workers/keyed_check.py) passes each replica's even shard, as a script written before shares
existed does, and the replicas of a stage trade them for their shares (trainer.engine.replica_share);
one run passes each replica its own share instead. The shares are not multiples of the micro-batch
size, so a replica ends in a smaller micro-batch, and in 1x3 replica 1's share is the even size,
which only the stage's replicas together can tell apart from an even shard.

The unit tests of the rule and the plan field: tests/unit/test_parallel_plan.py, test_data.py."""

import json

import pytest
from support import TESTS

WORKER = TESTS / "workers" / "keyed_check.py"
MODELS = ("gpt2", "depth")   # a Hugging Face model with dropout, and stochastic depth with noise


@pytest.fixture(scope="module")
def references():
    pytest.importorskip("transformers")
    from support import keyed_zoo
    return keyed_zoo.references(MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("stages,replicas,shares,args", [
    # global batch 12, micro-batches of 2: shares of 5 and 3 end in a micro-batch of 1
    pytest.param(1, 3, (5, 4, 3), ("--reverse-replicas",), id="1x3-5,4,3-even-shards-replicas-reversed"),
    pytest.param(2, 2, (7, 5), (), id="2x2-7,5-even-shards"),
    pytest.param(2, 2, (3, 9), ("--own-share", "--schedule", "1f1b"), id="2x2-3,9-own-shares-1f1b"),
])
def test_uneven_shares_train_the_plain_loops_model(tmp_path, references, stages, replicas, shares, args):
    from trainer.launch import launch
    out = tmp_path / "out"
    result = launch(WORKER, ["--out", str(out), "--models", ",".join(MODELS), "--evaluate", *args], stages=stages,
                    replicas=replicas, shares=shares, timeout=300)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    for name in MODELS:
        docs = [json.loads((out / f"{name}_losses_rank{rank}.json").read_text()) for rank in range(stages * replicas)]
        for rank, doc in enumerate(docs):
            assert [r["loss"] for r in doc["record"]] == pytest.approx(references[name], rel=1e-5), f"{name} rank {rank}"
        # an evaluation batch too: the same loss on every worker, from even shards or from the shares
        assert all(doc["eval"] == pytest.approx(docs[0]["eval"], rel=1e-6) for doc in docs)
        assert all(doc["eval_own"] == pytest.approx(docs[0]["eval"], rel=1e-5) for doc in docs)


@pytest.mark.slow
def test_shares_that_are_not_the_global_batch_stop_every_worker_in_one_sentence(tmp_path):
    from trainer.launch import launch
    result = launch(WORKER, ["--out", str(tmp_path), "--models", "depth"], stages=1, replicas=2, shares=(6, 4),
                    timeout=120)
    assert not result.ok
    assert "shares [6, 4] add up to 10 examples, the global batch is 12" in "\n".join(result.errors)
