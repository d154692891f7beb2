"""The profiler: a real calibration of the tiny GPT, checked against independently computed sizes,
its cache, and its fingerprint. No wall-clock assertions.

The in-process tests of tests/integration/test_profiler.py (tests/README.md).
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_gpt import tiny_gpt

from trainer.graph.partition import capture_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.planning.calibration import LinkCost
from trainer.profiler import (
    IN_FLIGHT,
    Profiler,
    fit_affine,
    measure_segments,
    measure_segments_interleaved,
    model_fingerprint,
    segment_slices,
)

FAST = dict(repeats=1, warmup=0)


def test_network_override_skips_measurement(tmp_path):
    model, data = tiny_gpt(n_layer=2)
    intra, inter = LinkCost(1e-4, 1e9), LinkCost(1e-3, 1e8)
    prof = Profiler(model, data.sample_batch, out_folder=tmp_path, links={"intra": intra},
                    allreduce={"intra": intra}, inter_link=inter, inter_allreduce=inter, **FAST)
    cal = prof.profile_all([1])
    assert not prof.network_measured
    assert cal.links == {"intra": intra, "inter": inter} and cal.allreduce["inter"] == inter
    # without an optimizer: AdamW's step is timed, the state is 2x the parameters
    assert all(s.optimizer_bytes == 2 * s.param_bytes and s.step_s > 0 for s in cal.segments)


def test_fingerprint_depends_on_structure_not_values():
    a, data = tiny_gpt()
    same = GPT(GPTConfig.preset("tiny"), seed=7)
    sample = data.sample_batch(2)
    assert model_fingerprint(a, sample=sample) == model_fingerprint(same, sample=sample)
    others = [GPT(GPTConfig.preset("tiny", n_layer=3)), GPT(GPTConfig.preset("tiny", n_embd=64)),
              GPT(GPTConfig.preset("tiny", dropout=0.1))]
    traced = capture_model(a, sample)
    prints = {model_fingerprint(a, traced=traced), *(model_fingerprint(m, sample=sample) for m in others),
              model_fingerprint(a, traced=traced, precision="fp16")}
    assert len(prints) == 5


def test_measure_segments_standalone():
    model, data = tiny_gpt(n_layer=2)
    slices = segment_slices(capture_model(model, data.sample_batch(2)))
    got = measure_segments(slices, data.sample_batch(2), segments=[1], repeats=1, warmup=0)
    assert list(got) == [1]
    assert got[1].activation_bytes == 2 * 32 * 48 * 4 and got[1].backward_s > 0


def test_the_split_backward_is_timed_where_a_segment_has_an_input_gradient():
    """Every other backward is split in its input and weight passes (zero-bubble schedules); the
    first segment, fed token ids, has no input gradient to split off."""
    model, data = tiny_gpt(n_layer=2)
    slices = segment_slices(capture_model(model, data.sample_batch(2)))
    got = measure_segments_interleaved(slices, data.sample_batch(2), in_flight=2, repeats=2, warmup=0)
    assert got[0].input_grad_s is None and got[0].weight_grad_s is None and got[0].split_bytes is None
    for k in range(1, len(slices)):
        assert got[k].input_grad_s > 0 and got[k].weight_grad_s > 0, k
        assert got[k].backward_s > 0
        # the gradients recorded between the passes: at least the block output's (batch x seq x width floats)
        assert got[k].split_bytes >= 2 * 32 * 48 * 4, (k, got[k].split_bytes)
        cost = got[k].cost()
        assert (cost.input_grad_s, cost.weight_grad_s, cost.split_bytes) == (
            got[k].input_grad_s, got[k].weight_grad_s, got[k].split_bytes)


def test_micro_batches_are_profiled_interleaved_as_a_pipeline_runs_them(tmp_path):
    """Several micro-batches per repeat, as a running stage holds them: their forwards without the
    graph, then with it (all their graphs alive at once), then their backwards oldest first. The
    profiler measures so by default on CPU."""
    model, data = tiny_gpt(n_layer=2)
    slices = segment_slices(capture_model(model, data.sample_batch(2)))
    seen: list[str] = []

    def forward_hook(_module, _args, out):
        if not torch.is_grad_enabled():
            seen.append("f")
            return
        i = sum(1 for x in seen if x.startswith("F"))
        seen.append(f"F{i}")
        out.register_hook(lambda _grad: seen.append(f"B{i}"))

    slices[0].module.register_forward_hook(forward_hook)
    got = measure_segments_interleaved(slices, data.sample_batch(2), in_flight=3, repeats=1, warmup=0)
    assert seen[:9] == ["f", "f", "f", "F0", "F1", "F2", "B0", "B1", "B2"]
    assert all(m.forward_s > 0 and m.recompute_s > 0 and m.backward_s > 0 for m in got.values())
    seen.clear()
    measure_segments(slices, data.sample_batch(2), repeats=1, warmup=0)
    assert seen[:3] == ["f", "F0", "B0"], "one micro-batch at a time unless asked"
    assert Profiler(model, data.sample_batch, out_folder=tmp_path).in_flight == IN_FLIGHT > 1
    with pytest.raises(ValueError, match="in_flight"):
        Profiler(model, data.sample_batch, out_folder=tmp_path, in_flight=0)


def test_fit_affine_recovers_a_line():
    sizes = [1e3, 1e5, 1e6, 1e7]
    a, b = fit_affine(sizes, [2e-4 + n / 1e9 for n in sizes])
    assert a == pytest.approx(2e-4, rel=1e-6) and 1 / b == pytest.approx(1e9, rel=1e-6)
    a, b = fit_affine(sizes, [n / 1e9 - 1e-6 for n in sizes])  # a negative intercept is clamped
    assert a == 0 and b > 0


def test_cpu_slots_need_one_thread_each(tmp_path):
    if torch.get_num_threads() == 1:
        pytest.skip("this process already runs one thread")
    model, data = tiny_gpt(n_layer=2)
    intra = LinkCost(1e-4, 1e9)
    prof = Profiler(model, data.sample_batch, gpus_per_node=2, out_folder=tmp_path, links={"intra": intra},
                    allreduce={"intra": intra}, **FAST)
    with pytest.raises(ValueError, match="one torch thread per slot"):
        prof.profile_all([2])


def test_a_calibration_holds_one_segments_training_state_at_a_time(tmp_path):
    """Each optimizer the profiler steps covers one segment's parameters, and when it is built no
    gradient of the model is alive: the segments' gradients were freed as each was measured."""
    model, data = tiny_gpt(n_layer=3)
    built: list[tuple[int, int]] = []   # (parameters stepped, model gradients alive)

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            built.append((sum(p.numel() for p in params), sum(p.grad is not None for p in model.parameters())))
            super().__init__(params, **kw)

    intra = LinkCost(1e-4, 1e9)
    prof = Profiler(model, data.sample_batch, out_folder=tmp_path, links={"intra": intra},
                    allreduce={"intra": intra}, **FAST)
    prof.set_optimizer(Recording(model.parameters(), lr=1e-3))
    built.clear()
    cal = prof.profile_all([2])
    largest = max(s.param_bytes for s in cal.segments) // 4
    assert len(built) >= cal.n_segments
    assert all(n <= largest for n, _ in built), (built, largest)
    assert all(alive == 0 for _, alive in built)
    assert all(p.grad is None for p in model.parameters())




def test_a_calibration_keeps_no_more_micro_batches_in_flight_than_the_global_batch_holds():
    """Four micro-batches of the whole batch at once held 1.7 GB for a model whose training state
    was 0.5 GB (an outside probe, batch 16, sizes 1 to 16); a step never holds more than B / b."""
    from trainer.profiler.slots import in_flight

    assert [in_flight(4, b, 16) for b in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]
    assert in_flight(4, 8, 64) == 4 and in_flight(1, 1, 64) == 1
    assert in_flight(4, 64, 48) == 1   # never below one
