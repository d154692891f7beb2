"""A stage holds only its own: after `Varuna(...)` returns and the script drops its model, no
other stage's parameter or buffer is alive in a worker, and the user's model object is gone.

Real worker processes from the local launcher (where the worker freezes the garbage
collector's view of the heap, which once froze torch.export's reference cycles and with them
the whole model); each worker holds weak references to every tensor of the model it built
(tests/workers/stage_refs.py).
"""

import json
from pathlib import Path

import pytest
from support import TESTS

from trainer.launch import launch

pytestmark = pytest.mark.slow

WORKER = TESTS / "workers" / "stage_refs.py"


def _run(tmp_path: Path, model: str, stages: int) -> list[dict]:
    result = launch(WORKER, ["--out", str(tmp_path), "--model", model], stages=stages, replicas=1, threads=1, timeout=240)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(stages)]


def _check(records: list[dict], stages: int) -> None:
    assert sorted(r["stage"] for r in records) == list(range(stages))
    names = set(records[0]["names"])
    for r in records:
        assert r["model_collected"], f"stage {r['stage']}: the user's model object is still alive"
        assert r["alive_not_mine"] == [], f"stage {r['stage']} keeps other stages' tensors alive"
        assert r["mine"] and set(r["alive"]) < names
        assert r["loss"] > 0
    # together the stages hold the whole model, each a part of it
    assert set().union(*(r["alive"] for r in records)) == names


def test_hand_written_model_with_cutpoints(tmp_path):
    _check(_run(tmp_path, "mlp", 3), 3)


def test_transformers_gpt2(tmp_path):
    pytest.importorskip("transformers")
    records = _run(tmp_path, "gpt2", 2)
    _check(records, 2)
    # the tied head is the embedding's Parameter: alive on the first stage and on the last
    for r in records:
        assert {"lm.transformer.wte.weight", "lm.lm_head.weight"} <= set(r["alive"])
