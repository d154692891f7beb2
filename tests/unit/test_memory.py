"""Memory measured beside the planner's estimate, and a slot that runs out: the worker's peak
meter, the per-stage rows of `varunactl status`, the classification of an out-of-memory failure
and the leader's smaller memory share, with real workers (one raising MemoryError, one killed by
the kernel's OOM killer under a cgroup v1 memory limit, under a real daemon)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from support.calibrations import calibration

from trainer.engine.memory import PeakMemory, device_peak, process_bytes, reset_peak, resident_bytes
from trainer.planning.calibration import LinkCost
from trainer.planning.plan import Slot
from trainer.planning.planner import plan
from trainer.planning.schedule import SCHEDULES, stash_bound
from varunad.control.failures import BACKOFF, classify, memory_backoff
from varunad.control.records import Progress
from varunad.control.status import memory_lines, stage_memory
from varunad.node.oom import OOM_WORDS, kernel_oom_kills


def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    t.fill_(1.0)   # resident only once written
    return t


def test_the_peak_on_a_cpu_is_the_whole_process_from_the_stage_on_not_the_build():
    """On a CPU the slot's memory holds the whole worker process (the interpreter, torch, the
    script's libraries): a probe measured workers at 520 MB resident whose status said 188 MB,
    the stage's weights plus what it grew by."""
    if kernel_oom_kills() is None or not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    build = _touch(300 << 20)   # what a model's build touched and freed before the stage trains
    del build
    meter = PeakMemory(torch.device("cpu"))
    start = resident_bytes()
    assert start <= meter.peak_bytes() < start + (100 << 20)
    work = _touch(160 << 20)
    del work
    peak = meter.peak_bytes()
    assert start + (150 << 20) <= peak < start + (300 << 20)
    assert meter.peak_bytes() >= peak   # a high-water mark: freeing does not lower it


def test_a_measurement_inside_a_meters_span_keeps_the_meters_peak():
    """The profiler resets the mark for each segment's pass inside a calibration run's meter: a
    reviewer saw the run's peak lose everything before the last reset. A new meter starts afresh."""
    if kernel_oom_kills() is None or not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    cpu = torch.device("cpu")
    meter = PeakMemory(cpu)
    start = resident_bytes()
    work = _touch(160 << 20)
    del work
    assert reset_peak(cpu)
    assert device_peak(cpu) < start + (100 << 20)   # the inner measurement starts low
    assert meter.peak_bytes() >= start + (150 << 20)   # the meter's span keeps what came before
    later = PeakMemory(cpu)
    assert later.peak_bytes() < resident_bytes() + (100 << 20)


def test_a_process_holds_its_resident_size_beyond_the_models_tensors_each_storage_once():
    if resident_bytes() is None:
        pytest.skip("needs Linux /proc")
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    model[1].weight = torch.nn.Parameter(model[0].weight.data)   # two parameters, one storage
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)   # resident only once written
    tensors = (2048 * 2048 + 2 * 2048) * 4
    rss = resident_bytes()
    assert abs(rss - tensors - process_bytes(model)) < (8 << 20)
    assert abs(process_bytes(model.to("meta")) - resident_bytes()) < (8 << 20)   # a meta model holds nothing


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_the_estimate_counts_the_micro_batches_in_flight_and_recompute(schedule):
    """Each stage's memory is its weights, gradients and optimizer state plus, for the micro-batches
    the schedule keeps in flight on it, their inputs (recomputing) or their whole activations, and
    what a split backward keeps between its passes."""
    seg, act = 100 << 20, 30 << 20
    slots = [Slot(f"s{i}", f"h{i}", "cpu", 4 << 30) for i in range(4)]
    fast = {"intra": LinkCost(1e-5, 1e10), "inter": LinkCost(1e-5, 1e10)}
    cal = calibration(activation_bytes=act, input_bytes=act, param_bytes=seg, optimizer_bytes=2 * seg, step_s=1e-4,
                      links=fast)
    p = plan(slots, 8, [cal], schedule=schedule, micro_batch_sizes=[1])
    assert p.P > 1, p.explain()
    for s, st in enumerate(p.stages):
        n = st.end_segment - st.first_segment
        c = stash_bound(schedule, p.P, s, p.micro_batches, st.recompute)
        inputs = c * act   # every boundary (and the data) is `act` bytes here
        # a split backward keeps the gradients recorded between its passes: not measured in this
        # calibration, they are taken as large as the activations
        split = n * act if SCHEDULES[schedule].splits(p.P, s) else 0
        expected = 4 * seg * n + (inputs + n * act + split if st.recompute else inputs + c * (n * act + split))
        assert st.memory_bytes == expected, (s, st)


def _cal(seg: int, act: int):
    fast = {"intra": LinkCost(1e-5, 1e10), "inter": LinkCost(1e-5, 1e10)}
    return calibration(activation_bytes=act, input_bytes=act, param_bytes=seg, optimizer_bytes=2 * seg, step_s=1e-4,
                       links=fast)


def test_the_estimate_counts_the_optimizer_steps_temporaries_where_they_exceed_the_activations():
    """The step runs once the stage's activations are freed: a stage holds its static bytes plus
    the larger of the two; a for-loop step's temporaries are its largest segment's."""
    seg, act = 100 << 20, 1 << 20
    slots = [Slot(f"s{i}", f"h{i}", "cpu", 4 << 30) for i in range(2)]
    for adds in (True, False):
        base = _cal(seg, act)
        cal = dataclasses.replace(base, step_bytes_add=adds,
                                  segments=tuple(dataclasses.replace(s, step_bytes=seg) for s in base.segments))
        p = plan(slots, 8, [cal], micro_batch_sizes=[1])
        for st in p.stages:
            n = st.end_segment - st.first_segment
            assert st.memory_bytes == 4 * seg * n + (n * seg if adds else seg), (adds, st)
    # where the activations are more, they alone are counted
    cal = dataclasses.replace(_cal(seg, 200 << 20), segments=tuple(
        dataclasses.replace(s, step_bytes=1 << 20) for s in _cal(seg, 200 << 20).segments))
    p = plan(slots, 8, [cal], micro_batch_sizes=[1])
    assert [st.memory_bytes for st in p.stages] == [st.memory_bytes for st in plan(
        slots, 8, [_cal(seg, 200 << 20)], micro_batch_sizes=[1]).stages]


def test_status_shows_each_stages_estimate_beside_its_measured_peak():
    facts = {"ranks": [[0, 2], [1, 3]], "stage_memory": [300_000_000, 200_000_000],
             "stage_capacity": [360_000_000, 360_000_000]}
    current = [Progress(job="j", epoch=3, rank=r, step=5, loss=1.0, samples_per_s=1.0, busy_fraction=1.0,
                        peak_bytes=peak) for r, peak in ((0, 310_000_000), (2, 330_000_000), (1, 0))]
    rows = stage_memory(facts, current)
    assert rows == [{"stage": 0, "estimate": 300_000_000, "capacity": 360_000_000, "peak": 330_000_000},
                    {"stage": 1, "estimate": 200_000_000, "capacity": 360_000_000, "peak": None}]
    lines = memory_lines(rows)
    assert lines[0] == "memory    stage 0: estimate 300 MB, measured peak 330 MB, usable 360 MB"
    assert lines[1].endswith("measured peak -, usable 360 MB")
    assert stage_memory({}, current) == []   # a plan from before the estimates were recorded


def test_classification_of_out_of_memory_failures():
    killed = f"rank 2 on vm3 {OOM_WORDS}: step 4 loss 1.0"
    assert classify(killed, None) == "memory" and classify(killed, killed) == "memory"
    assert classify("rank 0 on vm1 exited with code 1: torch.OutOfMemoryError: CUDA out of memory", None) == "memory"
    assert classify("rank 0 on vm1 exited with code 1: ValueError: boom", None) == "retry"
    facts = {"ranks": [[0], [1], [2]], "stage_kinds": ["a100", "a100", "t4"], "stage_memory": [5e9, 5e9, 3e9]}
    b = memory_backoff(killed, facts, {}, {2: 4_000_000_000})
    assert (b.kind, b.stage) == ("t4", 2) and b.scale == pytest.approx(0.75)   # estimate 3 GB, peak 4 GB
    assert memory_backoff(killed, facts, {}, {}).scale == pytest.approx(BACKOFF)   # no peak known
    assert memory_backoff("rank 9 on vm3 killed", facts, {}, {}) is None


