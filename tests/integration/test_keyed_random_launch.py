"""Randomness that belongs to the sample: the counter-based generator, the capture's keyed random
ops, and (slow) every P x D, recompute and resume reproducing the plain loop with dropout on.

Launch tests use real worker processes, real gloo and ZeroMQ; the models are Hugging Face GPT-2
and BERT with dropout 0.1 everywhere (random init, tiny configs) and a hand-written network with
stochastic depth, dropout on flattened tokens and noise injection (tests/support/keyed_zoo.py).


The tests of tests/unit/test_keyed_random.py that need processes or a real etcd (tests/README.md).
"""

import json
from pathlib import Path

import pytest
from support import TESTS

WORKER = TESTS / "workers" / "keyed_check.py"


# -- the engine (slow: real workers) ---------------------------------------------------------

def _launch(out: Path, stages: int, replicas: int, *args: str) -> Path:
    from trainer.launch import launch
    result = launch(WORKER, ["--out", str(out), *args], stages=stages, replicas=replicas, timeout=400)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    return out


def _losses(out: Path, name: str, rank: int) -> list[float]:
    return [r["loss"] for r in json.loads((out / f"{name}_losses_rank{rank}.json").read_text())["record"]]


@pytest.fixture(scope="module")
def references():
    pytest.importorskip("transformers")
    from support import keyed_zoo
    return keyed_zoo.references(keyed_zoo.MODELS)


@pytest.mark.slow
def test_the_randomness_matters_and_the_reference_does_not_depend_on_its_micro_batches(references):
    from support import keyed_zoo
    for name in keyed_zoo.MODELS:
        assert keyed_zoo.reference(name, micro_batch_size=5) == pytest.approx(references[name], rel=1e-5)
    # with another seed the masks differ, and so does the model: the comparisons below can fail
    seed = keyed_zoo.SEED
    try:
        keyed_zoo.SEED = seed + 1
        other = keyed_zoo.reference("gpt2")
    finally:
        keyed_zoo.SEED = seed
    assert other != pytest.approx(references["gpt2"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stages,replicas,args", [
    # (1x1 is left out: every row below is compared with the plain loop itself, not with 1x1)
    pytest.param(2, 1, (), id="2x1-recompute"),
    pytest.param(1, 2, (), id="1x2"),
    pytest.param(2, 2, ("--schedule", "1f1b", "--chunk-size", "4"), id="2x2-1f1b-ragged"),
    pytest.param(4, 1, ("--recompute", "0", "--schedule", "gpipe"), id="4x1-no-recompute"),
])
def test_every_layout_trains_the_plain_loops_model(tmp_path, references, stages, replicas, args):
    from support import keyed_zoo
    out = _launch(tmp_path / "out", stages, replicas, *args)
    for name in keyed_zoo.MODELS:
        for rank in range(stages * replicas):
            assert _losses(out, name, rank) == pytest.approx(references[name], rel=1e-5), f"{name} rank {rank}"


@pytest.mark.slow
def test_a_resumed_run_draws_what_the_uninterrupted_one_drew(tmp_path, references):
    """A checkpoint of step 3 written at 2 x 2 resumes at 1 x 3 (a morph's shapes) on the
    uninterrupted run's losses: the step is part of every draw's key, nothing else needs restoring."""
    store = tmp_path / "store"
    first = _launch(tmp_path / "first", 2, 2, "--models", "gpt2,depth", "--store", str(store),
                    "--checkpoint-at", "3")
    second = _launch(tmp_path / "second", 1, 3, "--models", "gpt2,depth", "--store", str(store), "--resume", "3")
    for name in ("gpt2", "depth"):
        assert _losses(first, name, 0) == pytest.approx(references[name], rel=1e-5)
        for rank in range(3):
            assert _losses(second, name, rank) == pytest.approx(references[name][3:], rel=1e-5)
