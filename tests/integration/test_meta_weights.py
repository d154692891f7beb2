"""A model built on the meta device trains from the user's weights, each worker materializing
only its stage: the losses equal a plain single-process loop that loads the same weights.

Real worker processes from the local launcher (tests/workers/train_weights.py) at P = 1 and
P = 2, for a hand-written model with CutPoints and a non-persistent buffer (a single
safetensors file) and for transformers' GPT-2 (head tied to the embedding, which save_pretrained
writes once; sharded checkpoint directory) and Llama (rotary frequencies, non-persistent).
The weights are made here with save_pretrained / save_file from random configs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from support import TESTS

from trainer import GlobalBatches
from trainer.launch import launch

pytestmark = pytest.mark.slow

WORKERS = TESTS / "workers"
sys.path.insert(0, str(WORKERS))
from meta_models import build, data  # noqa: E402

STEPS, BATCH = 4, 8


def _weights(tmp_path: Path, arch: str) -> Path:
    torch.manual_seed(3)
    model = build(arch)
    if arch == "mixer":
        from safetensors.torch import save_file
        path = tmp_path / "mixer.safetensors"
        save_file(model.state_dict(), str(path))
        return path
    path = tmp_path / arch
    # small shards: the worker reads the index and opens only the files its stage's tensors are in
    model.lm.save_pretrained(str(path), max_shard_size="40KB" if arch == "gpt2" else "10GB")
    return path


def _reference(arch: str, weights: Path) -> list[float]:
    """The plain loop: the model built on the CPU, loaded from the same weights, trained with SGD."""
    if arch == "mixer":
        from safetensors.torch import load_file
        model = build(arch)
        model.load_state_dict(load_file(str(weights)))
    else:
        import transformers
        from meta_models import CausalLM
        model = CausalLM(transformers.AutoModelForCausalLM.from_pretrained(str(weights)))
    examples = data()
    batches = GlobalBatches(len(examples), BATCH, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(examples[batches.indices(step)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch,stages", [("mixer", 1), ("mixer", 2), ("gpt2", 1), ("gpt2", 2), ("llama", 2)])
def test_meta_model_trains_from_its_weights_like_a_plain_loop(tmp_path, arch, stages):
    if arch != "mixer":
        pytest.importorskip("transformers")
    weights = _weights(tmp_path, arch)
    if arch == "gpt2":
        assert (weights / "model.safetensors.index.json").exists()
    out = tmp_path / "out"
    out.mkdir()
    result = launch(WORKERS / "train_weights.py", ["--out", str(out), "--model", arch, "--weights", str(weights),
                                                   "--steps", str(STEPS), "--batch-size", str(BATCH)],
                    stages=stages, replicas=1, threads=1, timeout=240)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(stages)]
    expected = _reference(arch, weights)
    last = next(r for r in records if r["stage"] == stages - 1)
    assert last["losses"] == pytest.approx(expected, rel=1e-5)
    for r in records:
        assert r["meta_left"] == [] and r["mine"]
        assert r["outside"] == [], f"stage {r['stage']} gave storage to tensors of other stages"
    if stages > 1:
        assert not set(records[0]["mine"]) >= set(records[1]["mine"])
