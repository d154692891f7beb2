"""Tied embedding and output head train exactly at every P x D, in both ways of tying them.

`module`: one Parameter used by the first and the last layer (Hugging Face's way); `shared`:
two Parameters named in `shared_weights` (Varuna's way). At P = 1 both copies sit on one stage
next to the data-parallel all-reduce, the case that once lost the tied sum (issue 13).

Real worker processes from the local launcher, real gloo and ZeroMQ; each launch trains both
styles (tests/workers/train_tied.py), and every result is compared with a plain
single-process PyTorch loop over the same global batches.
"""

import json
from pathlib import Path

import pytest
import torch
from support import TESTS

from trainer import GlobalBatches
from trainer.data import TextDataset
from trainer.launch import launch
from trainer.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.slow

WORKER = TESTS / "workers" / "train_tied.py"
CONFIG = GPTConfig.preset("tiny", seq_len=16, n_embd=32)   # the worker's model
STEPS, BATCH = 5, 8
STYLES = ("module", "shared")
TIED = ("wte.weight", "lm_head.weight")
# P = 2 cuts after block 1, P = 4 between every block: the embedding sits on the first stage,
# the head on the last, so from P = 2 on the tied copies live on different stages.
CUTS = {1: None, 2: [2], 4: [1, 2, 3]}
# Each launch trains both styles under each of its schedules (one process start per worker).
# (1 x 1 and 4 x 1 are the model zoo's: its hand GPT ties its head both ways at every P x D.)
LAUNCHES = {(1, 2): ["varuna"], (2, 1): ["varuna"], (2, 2): ["varuna", "1f1b"]}
CONFIGS = [(stages, replicas, schedule) for (stages, replicas), schedules in LAUNCHES.items()
           for schedule in schedules]
# The 2 x 2 run also checkpoints after step 3 (each tied copy on its own stage, in its own
# file); the 1 x 2 run then also trains on from that checkpoint, both copies on one stage.
CHECKPOINTED, RESUMED, RESUME_AT = (2, 2), (1, 2), 3


def reference():
    """Per-step losses, final parameters and SGD momentum of the truly tied model (one tensor)."""
    torch.manual_seed(1234)
    model = GPT(CONFIG, seed=0)
    data = TextDataset(CONFIG.seq_len, num_examples=128, seed=0)
    batches = GlobalBatches(len(data), BATCH, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**data.batch(batches.indices(step)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    named = dict(model.named_parameters())
    return losses, {n: q.detach().clone() for n, q in named.items()}, {
        n: opt.state[q]["momentum_buffer"].clone() for n, q in named.items()}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per configuration, shared by the tests that read it."""
    root = tmp_path_factory.mktemp("tied")
    store = root / "store"
    done: dict[tuple, Path] = {}

    def get(stages, replicas):
        key = (stages, replicas)
        if key not in done:
            args = []
            if key == CHECKPOINTED:
                args = ["--store", str(store), "--checkpoint-at", str(RESUME_AT)]
            if key == RESUMED:
                get(*CHECKPOINTED)
                args = ["--resume-from", str(store), "--resume-at", str(RESUME_AT)]
            out = root / f"{stages}x{replicas}"
            result = launch(WORKER, ["--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH),
                                     "--schedules", ",".join(LAUNCHES[key]), *args],
                            # one thread each: a tiny model gains nothing from more, and
                            # idle OpenMP threads spinning on a busy machine cost many times its work
                            stages=stages, replicas=replicas, cuts=CUTS[stages], threads=1, timeout=240)
            assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
            done[key] = out
        return done[key]

    get.store = store
    return get


def read(run: Path):
    """Every rank's record and state of one trained model."""
    ranks = sorted(int(f.stem.removeprefix("rank")) for f in run.glob("rank*.json"))
    return [(json.loads((run / f"rank{r}.json").read_text()),
             torch.load(run / f"state_rank{r}.pt", weights_only=True)) for r in ranks]


def check_against(ref, ranks, world: int, steps=range(STEPS)) -> None:
    ref_losses, ref_params, ref_momentum = ref
    assert len(ranks) == world
    for record, _ in ranks:
        assert [r["step"] for r in record["record"]] == list(steps)
        got = [r["loss"] for r in record["record"]]
        assert got == pytest.approx([ref_losses[s] for s in steps], rel=1e-5), (record["stage"], record["replica"])
    seen = set()
    for record, state in ranks:
        for name, value in state["params"].items():
            # the `shared` head is the reference's embedding: one tensor in the math
            like = "wte.weight" if name in TIED else name
            where = f"{name} on stage {record['stage']} replica {record['replica']}"
            torch.testing.assert_close(value, ref_params[like], rtol=1e-4, atol=1e-6, msg=where)
            torch.testing.assert_close(state["momentum"][name], ref_momentum[like], rtol=1e-4, atol=1e-6,
                                       msg=f"momentum of {where}")
            seen.add(name)
    assert seen - {"lm_head.weight"} == set(ref_params)
    # Every copy of the tied weight, on every stage and replica, holds the same bits after
    # every step, and so does its optimizer state: the copies never drift apart.
    for i, step in enumerate(steps):
        copies = [tuple(bits) for record, _ in ranks for bits in record["record"][i]["tied"].values()]
        assert copies and len(set(copies)) == 1, f"tied copies differ after step {step}"


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stages,replicas,schedule", CONFIGS)
def test_tied_weights_train_exactly(runs, ref, stages, replicas, schedule, style):
    ranks = read(runs(stages, replicas) / f"{style}-{schedule}")
    check_against(ref, ranks, stages * replicas)
    if style == "shared":
        held = {n for _, state in ranks for n in state["params"]}
        assert set(TIED) <= held, "Varuna's way keeps both Parameters"


@pytest.mark.parametrize("style", STYLES)
def test_checkpoint_from_2x2_resumes_tied_copies_at_1x2(runs, ref, style):
    """Written where the copies live on different stages (separate files), loaded where both
    sit on one stage next to the all-reduce: training goes on as if never stopped."""
    out = runs(*RESUMED)
    assert (runs.store / style / f"varuna_ckpt_{RESUME_AT}" / "manifest.json").exists()
    check_against(ref, read(out / f"{style}-varuna-resumed"), 2, steps=range(RESUME_AT, STEPS))
