"""Memory measured beside the planner's estimate, and a slot that runs out: the worker's peak
meter, the per-stage rows of `varunactl status`, the classification of an out-of-memory failure
and the leader's smaller memory share, with real workers (one raising MemoryError, one killed by
the kernel's OOM killer under a cgroup v1 memory limit, under a real daemon)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import REPO, TESTS
from support.calibrations import calibration

from trainer.engine.memory import PeakMemory, StageOutOfMemoryError
from trainer.planning.calibration import LinkCost
from trainer.planning.plan import Slot
from trainer.planning.planner import plan
from trainer.planning.schedule import stash_bound
from varunad.control.decide import error_summary
from varunad.control.failures import BACKOFF, classify, memory_backoff
from varunad.control.jobs import JobState
from varunad.control.records import Progress
from varunad.control.status import memory_lines, stage_memory
from varunad.node.oom import OOM_WORDS, kernel_oom_kills

JOB = TESTS / "memory_job" / "mlp_job.py"


def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    t.fill_(1.0)   # resident only once written
    return t


def test_the_peak_counts_the_stage_and_what_it_grew_by_not_the_build():
    if kernel_oom_kills() is None or not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    build = _touch(300 << 20)   # what a model's build touched and freed before the stage trains
    del build
    meter = PeakMemory(torch.device("cpu"), stage_bytes=10 << 20)
    assert meter.peak_bytes() < (10 << 20) + (100 << 20)
    work = _touch(160 << 20)
    del work
    peak = meter.peak_bytes()
    assert (10 << 20) + (150 << 20) <= peak < (10 << 20) + (300 << 20)
    assert meter.peak_bytes() >= peak   # a high-water mark: freeing does not lower it


@pytest.mark.parametrize("schedule", ["varuna", "gpipe", "1f1b"])
def test_the_estimate_counts_the_micro_batches_in_flight_and_recompute(schedule):
    """Each stage's memory is its weights, gradients and optimizer state plus, for the micro-batches
    the schedule keeps in flight on it, their inputs (recomputing) or their whole activations."""
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
        expected = 4 * seg * n + (inputs + n * act if st.recompute else inputs + c * n * act)
        assert st.memory_bytes == expected, (s, st)


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


def _run_job(*args: str, P: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.launch", "-P", str(P), str(JOB), *args],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))


@pytest.mark.slow
def test_workers_measure_their_stage_and_a_memory_error_names_the_stage_and_its_peak():
    ok = _run_job("--width", "512", "--depth", "4", "--memory-error-at", "99")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    rows = [json.loads(m) for m in re.findall(r"MEMORY (\{.*\})", ok.stdout + ok.stderr)]
    assert sorted(r["stage"] for r in rows) == [0, 1]
    for r in rows:
        # its weights, gradients and Adam's two moments at the least
        assert r["peak"] >= 4 * r["param_bytes"], r

    failed = _run_job("--width", "512", "--depth", "4", "--memory-error-at", "1")
    assert failed.returncode != 0
    out = failed.stdout + failed.stderr
    assert f"{StageOutOfMemoryError.__module__}.StageOutOfMemoryError: stage 0 of 2 ran out of memory on cpu" in out
    # what the daemon's leader reads of it: the supervisor's first line, then the worker's output
    text = "rank 0 on vm1 exited with code 1; last output:\n" + "\n".join(
        ln for ln in out.splitlines() if "[s0r0]" in ln or "rank0" in ln)
    summary = error_summary(text)
    assert "StageOutOfMemoryError: stage 0 of 2" in summary and classify(summary, None) == "memory"
    peak_mb = float(re.search(r"measured peak ([\d.]+) MB", summary).group(1))
    assert peak_mb > 0
    estimate = int(peak_mb * 1e6 / 2)
    facts = {"ranks": [[0], [1]], "stage_kinds": ["cpu", "cpu"], "stage_memory": [estimate, estimate],
             "stage_capacity": [9_000_000, 9_000_000]}
    backoff = memory_backoff(summary, facts, {"cpu": 0.9}, {})
    assert backoff is not None and backoff.kind == "cpu" and backoff.stage == 0
    # the peak was twice the estimate: the share drops by their ratio, more than the default step
    assert backoff.scale == pytest.approx(0.9 * estimate / (peak_mb * 1e6), rel=1e-3)
    said = f"stage 0 (cpu) ran out of memory: the plan estimated {estimate / 1e6:.0f} MB of 9 MB usable"
    assert said in backoff.words, backoff.words


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


def _memory_cgroup() -> Path | None:
    """A fresh child of this process's cgroup v1 memory controller, or None."""
    try:
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.split(":")[1] == "memory")
    except (OSError, StopIteration, IndexError):
        return None
    parent = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    child = parent / f"varunad-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "memory.limit_in_bytes").write_text(str(1 << 40))
    except OSError:
        return None
    return child


@pytest.mark.slow
def test_a_worker_the_oom_killer_ends_makes_the_leader_plan_with_less_memory(tmp_path, etcd, etcd_root):
    """One daemon whose slot promises 1 GB (900 MB usable) to a model of 12 x 2048 (201 MB of
    weights, 806 MB with gradients and Adam's state, 840 MB with the step's temporaries): the
    planner runs it 1x1. A first job calibrates it and trains a step; then the daemon is moved
    into a cgroup v1 memory limit of the planner's own estimate for that stage. The estimate
    counts the stage's tensors only, and the worker holds the interpreter and torch besides, so
    its first step cannot fit, however glibc or the allocator behaves: a limit set from a
    measured run left a margin of a few percent, within the run-to-run spread of the worker's
    peak, and the worker sometimes trained under it. The next job's worker is OOM-killed at its
    first step; the job says so, and the leader re-plans with 80% of a cpu slot's memory, where
    1x1 no longer fits."""
    from support.ring import Ring

    group = _memory_cgroup()
    if group is None or kernel_oom_kills() is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    model = ("--width", "2048", "--depth", "12")

    def submit(job: str, steps: int) -> None:
        r = ring.varunactl("submit", "--name", job, "--batch-size", "8", "--chunk-size", "auto", "--steps",
                           str(steps), "--checkpoint-every", str(steps), str(JOB), "--", *model)
        assert r.returncode == 0, r.stderr

    try:
        # no spare workers: a spare started before the move would run the next job outside the limit
        d = ring.start("solo", "--memory", str(1_000_000_000), "--no-spare-workers")
        ring.wait_members(["solo"])
        submit("fits", 1)   # the same script and arguments: its calibration serves the next job too
        # a calibration and a worker of 201 MB of weights: on two cores shared with other runs (load 10 to 17)
        # this test took 245 to 275 s where it takes 50 s alone
        st = ring.wait_state("fits", ("done", "failed"), timeout=480)
        assert st["state"] == "done" and (st["plan"]["P"], st["plan"]["D"]) == (1, 1), st
        estimate = st["stages"][0]["estimate"]
        assert 806_000_000 < estimate < 900_000_000, st["stages"]   # the tensors and the step's temporaries
        (group / "memory.limit_in_bytes").write_text(str(estimate))
        (group / "cgroup.procs").write_text(str(d.proc.pid))
        submit("big", 3)
        st = ring.poll(lambda: ("waiting for a plan" in (s := ring.status("big"))["reason"] or s["state"] in
                                ("done", "failed")) and s, timeout=480, what="big waiting for a plan")
        assert "fits the model's memory" in st["reason"], st["reason"]
        assert "(counting 80% of a cpu slot's memory: a stage of this job ran out)" in st["reason"], st["reason"]
        assert OOM_WORDS in (st["error"] or ""), st["error"]
        state = JobState.decode(ring.call(ring.store.get(ring.keys.state("big"))).value)
        assert state.memory_scale == {"cpu": pytest.approx(BACKOFF)} and state.restarts == 1
        assert "stage 0 (cpu) ran out of memory: the plan estimated" in d.log_text()
        assert int((group / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0]) >= 1
    finally:
        ring.close()
        for pid in (group / "cgroup.procs").read_text().split():
            subprocess.run(["kill", "-9", pid], check=False)
        try:
            group.rmdir()
        except OSError:
            pass
