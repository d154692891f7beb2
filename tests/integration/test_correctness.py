"""Any P x D and any schedule computes what a plain single-process loop computes ([Note: the global batch defines the math] in ARCHITECTURE.md).

Real worker processes from the local launcher, real gloo all-reduce, real ZeroMQ streams.
"""

import json

import pytest
import torch
from support import REPO, TESTS
from support.reference import reference_run

from trainer.launch import launch
from trainer.models.gpt import GPT, GPTConfig
from varunad.report.traces import load_events

WORKER = TESTS / "workers" / "train_check.py"
STEPS, BATCH = 5, 12

pytestmark = pytest.mark.slow


def run_workers(tmp_path, stages, replicas, *args, name="run", cuts=None, **launch_options):
    out = tmp_path / name
    result = launch(WORKER, ["--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH), *args],
                    stages=stages, replicas=replicas, timeout=240, cuts=cuts, **launch_options)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    return out


def read_losses(out, rank=0):
    return json.loads((out / f"losses_rank{rank}.json").read_text())


def merged_params(out):
    params = {}
    for f in sorted(out.glob("params_rank*.pt")):
        params.update(torch.load(f, weights_only=True))
    return params


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS, BATCH)


# Six launches cover the axes: every P x D shape of the old 15-launch matrix, each schedule on a
# pipeline (P >= 2), recompute on (the worker's default) and off, the tied embedding split over the
# first and last stage (P >= 2) and counted once by global-norm clipping, ragged micro-batches
# (12 examples over 2 replicas in chunks of 4: micro-batches of 4 and 2), and each stage holding a
# share of the parameters (a cut between every block of the 4 x 1 pipeline).
MATRIX = [
    pytest.param(1, 1, "varuna", (), None, None, id="1x1-varuna"),
    pytest.param(1, 2, "1f1b", (), None, None, id="1x2-1f1b"),
    pytest.param(2, 1, "gpipe", ("--recompute", "0"), None, None, id="2x1-gpipe-no-recompute"),
    pytest.param(2, 2, "1f1b", (), None, None, id="2x2-1f1b-ragged"),
    pytest.param(4, 1, "varuna", ("--clip", "0.5"), 0.5, [1, 2, 3], id="4x1-varuna-clip-cut-every-block"),
    # split backwards with deferred weight passes on stages 1 and 2, the tied head's among them
    pytest.param(3, 1, "zb-h1", ("--recompute", "0"), None, None, id="3x1-zb-h1-no-recompute"),
]


@pytest.mark.parametrize("stages,replicas,schedule,extra,clip,cuts", MATRIX)
def test_matches_single_process(tmp_path, reference, stages, replicas, schedule, extra, clip, cuts):
    ref_losses, ref_params = reference if clip is None else reference_run(STEPS, BATCH, clip=clip)
    out = run_workers(tmp_path, stages, replicas, "--schedule", schedule, "--chunk-size", "4", *extra, cuts=cuts)
    world = stages * replicas
    for rank in range(world):
        got = [r["loss"] for r in read_losses(out, rank)["record"]]
        assert got == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
    ref_params = dict(ref_params)
    ref_eval = ref_params.pop("eval")
    assert read_losses(out)["eval"] == pytest.approx(ref_eval, rel=1e-5)
    params = merged_params(out)
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-6, msg=name)
    if clip is not None:
        # clipping acts on the norm over all stages, as torch's clip_grad_norm_ over the whole model
        # would (the tied embedding, held by the first and last stage, counted once)
        assert ref_losses[-1] != pytest.approx(reference[0][-1], rel=1e-3), f"{clip} must actually clip"
    if stages == 4:
        sizes = [read_losses(out, r)["param_bytes"] for r in range(4)]
        whole = sum(p.numel() * 4 for p in GPT(GPTConfig.preset("tiny")).parameters())
        # the tied embedding lives on the first and last stage, so those hold a bit more than 1/P
        assert max(sizes) < 0.5 * whole
        assert sum(sizes) < 1.5 * whole


def test_bf16_tracks_the_bf16_reference(tmp_path):
    ref_losses, _ = reference_run(STEPS, BATCH, precision="bf16")
    out = run_workers(tmp_path, 2, 1, "--precision", "bf16")
    got = [r["loss"] for r in read_losses(out)["record"]]
    # bf16 rounding differs with micro-batching, so agreement is to bf16's precision
    assert got == pytest.approx(ref_losses, rel=2e-2)
    assert got[-1] < got[0]


def test_planner_recompute_flags_reach_the_workers_and_recompute_replays_dropout(tmp_path):
    """A script that leaves `recompute` unset follows the plan's per-stage flags (the planner's
    choice, passed on by the daemon): stage 0 told not to recompute runs no recompute action. With dropout,
    recompute on and off give the same gradients: the masks are replayed (the same cut in both runs,
    so both compare the same stage's gradients)."""
    runs = {}
    for flags in ([False, False], [True, False]):
        name = "on" if flags[0] else "off"
        runs[name] = run_workers(tmp_path, 2, 1, "--dropout", "0.2", "--grads", "--recompute", "-1", name=name,
                                 cuts=[1], recompute=flags, trace_dir=tmp_path / f"trace_{name}")
    recomputes = {name: [e for e in load_events([tmp_path / f"trace_{name}"]) if e["cat"] == "recompute"]
                  for name in runs}
    assert recomputes["off"] == [] and recomputes["on"]
    assert {e["pid"] for e in recomputes["on"]} == {0}  # the last stage keeps its graph either way
    for rank in range(2):
        off = torch.load(runs["off"] / f"grads_rank{rank}.pt", weights_only=True)
        on = torch.load(runs["on"] / f"grads_rank{rank}.pt", weights_only=True)
        assert off.keys() == on.keys() and off
        for name in off:
            torch.testing.assert_close(on[name], off[name], rtol=1e-5, atol=1e-7, msg=name)


def test_checkpoint_from_4x1_resumes_in_2x2(tmp_path, reference):
    ref_losses, ref_params = reference
    store = tmp_path / "store"
    first = run_workers(tmp_path, 4, 1, "--store", str(store), "--checkpoint-at", "3", name="first")
    assert (store / "varuna_ckpt_3" / "manifest.json").exists()
    second = run_workers(tmp_path, 2, 2, "--store", str(store), "--resume", "3", name="second")
    resumed = read_losses(second)["record"]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx(ref_losses[3:], rel=1e-5)
    assert [r["loss"] for r in read_losses(first)["record"]] == pytest.approx(ref_losses, rel=1e-5)
    params = merged_params(second)
    for name, ref in ref_params.items():
        if name == "eval":
            continue
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-6, msg=name)


def test_a_staged_checkpoint_holds_its_step_while_training_goes_on(tmp_path, reference):
    """Varuna's tmpdir: each worker writes locally and a background thread copies into the store
    while steps 4 and 5 change the parameters; rank 0 commits once every worker's files are in."""
    ref_losses, ref_params = reference
    store, staging = tmp_path / "store", tmp_path / "staging"
    first = run_workers(tmp_path, 2, 2, "--store", str(store), "--checkpoint-at", "3", "--tmpdir", str(staging),
                        name="first")
    assert [r["loss"] for r in read_losses(first)["record"]] == pytest.approx(ref_losses, rel=1e-5)
    ckpt = store / "varuna_ckpt_3"
    assert (ckpt / "manifest.json").exists()
    assert len(list((ckpt / "writers").glob("*-rank*.json"))) == 4   # every worker said its files were in
    assert [p for p in staging.rglob("*") if p.is_file()] == []   # the local copies are gone
    second = run_workers(tmp_path, 4, 1, "--store", str(store), "--resume", "3", name="second")
    resumed = read_losses(second)["record"]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx(ref_losses[3:], rel=1e-5)
    params = merged_params(second)
    for name, ref in ref_params.items():
        if name != "eval":
            torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-6, msg=name)


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path):
    # 2**22 overflows fp16 activation gradients of this model; 2**17 does not (measured)
    out = run_workers(tmp_path, 2, 1, "--precision", "fp16", "--init-loss-scale", str(2.0**22),
                      "--steps", "8", name="fp16")
    record = read_losses(out)["record"]
    assert record[0]["overflow"] is True
    assert record[0]["scale"] == 2.0**21
    scales = [r["scale"] for r in record]
    assert scales == sorted(scales, reverse=True)
    assert any(not r["overflow"] for r in record), "the scale never came down far enough"


def test_cnn_without_cutpoints_trains_under_2x1():
    """A non-transformer model, cut automatically between its Sequential blocks, learns."""
    script = REPO / "examples" / "train_cnn.py"
    result = launch(script, ["--steps", "30"], stages=2, replicas=1, timeout=240)
    assert result.ok, result.errors
    losses = [float(line.split()[-1]) for line in result.outputs[0].splitlines() if line.startswith("step ")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_batchnorm_statistics_and_evaluation_match_the_plain_loop(tmp_path):
    """A stage that recomputes its forwards still updates BatchNorm's statistics (and a buffer its
    forward adds to) once per micro-batch, as the eager loop does; `evaluate` normalises with the
    running statistics, as `model.eval()` does, and changes no buffer."""
    from support.batchnorm_net import plain_run

    out = tmp_path / "bn"
    result = launch(TESTS / "workers" / "batchnorm_check.py", ["--out", str(out)], stages=2, replicas=1,
                    timeout=240)
    assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
    want, want_eval = plain_run()
    got = {}
    for f in sorted(out.glob("buffers_rank*.pt")):
        got.update(torch.load(f, weights_only=True))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for rank in (0, 1):
        assert json.loads((out / f"eval_rank{rank}.json").read_text()) == pytest.approx(want_eval, rel=1e-5)
