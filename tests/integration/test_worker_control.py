"""The worker side of the daemon contract: progress out; checkpoint/stop requests honoured at one
step boundary agreed by every worker; SIGTERM means checkpoint-then-stop; resume needs no code.

The daemon's end is a real ZeroMQ ROUTER socket in the test; the workers are real processes.
"""

import json
import os
import signal

import psutil
import pytest
from support.fake_daemon import BATCH, STEPS, WORKER, FakeDaemon, start_launch
from support.reference import reference_run

from protocol.messages import StopWorkers, WorkerCheckpointed, WorkerProgress, encode
from trainer.checkpoint.reading import verify
from trainer.checkpoint.store import latest_complete
from trainer.engine.control import STOPPED_EXIT_CODE
from trainer.launch import launch

pytestmark = pytest.mark.slow


def test_stop_request_checkpoints_every_worker_at_one_step_and_resume_continues(tmp_path):
    store = tmp_path / "store"
    daemon = FakeDaemon()
    try:
        thread, box, _ = start_launch(tmp_path, store, {"VARUNA_CONTROL": daemon.endpoint}, "first",
                                      job="j1")
        seen_steps = set()
        while True:
            identity, msg = daemon.next_message()
            assert isinstance(msg, WorkerProgress) and msg.job == "j1"
            assert 0.0 <= msg.busy_fraction <= 1.0 and msg.samples_per_s > 0
            seen_steps.add(msg.step)
            if msg.step == 2:
                # ask only rank 0: rank 1 must stop at the very same step all the same
                daemon.sock.send_multipart([identity, encode(
                    StopWorkers(job="j1", epoch=0, reason="test morph", checkpoint=True))])
                break
        checkpointed = {}
        while len(checkpointed) < 2:
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerCheckpointed):
                checkpointed[msg.rank] = msg.step
        thread.join(120)
        result = box["result"]
    finally:
        daemon.close()
    assert result.returncode == STOPPED_EXIT_CODE, result.errors
    stop_step = checkpointed[0]
    assert checkpointed[1] == stop_step and 3 <= stop_step < STEPS
    assert latest_complete(str(store)) == stop_step
    verify(str(store / f"varuna_ckpt_{stop_step}"))

    # A new epoch under another plan resumes by itself (the script has no resume code).
    out = tmp_path / "second"
    result = launch(WORKER, ["--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH)],
                    stages=1, replicas=2, timeout=240,
                    env={"VARUNA_STORE": str(store), "VARUNA_RESUME": "latest"})
    assert result.ok, result.errors
    record = json.loads((out / "losses_rank0.json").read_text())["record"]
    assert [r["step"] for r in record] == list(range(stop_step, STEPS))
    ref_losses, _ = reference_run(STEPS, BATCH)
    assert [r["loss"] for r in record] == pytest.approx(ref_losses[stop_step:], rel=1e-5)


def test_sigterm_to_one_worker_checkpoints_all_and_stops(tmp_path):
    store = tmp_path / "store"
    daemon = FakeDaemon()
    try:
        thread, box, _ = start_launch(tmp_path, store, {"VARUNA_CONTROL": daemon.endpoint}, "sig")
        while True:   # the first step's progress: training is under way, handlers installed
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerProgress):
                break
        workers = [p for p in psutil.Process().children(recursive=True)
                   if "train_check.py" in " ".join(p.cmdline())]
        assert len(workers) == 2
        os.kill(workers[-1].pid, signal.SIGTERM)   # the preemption notice reaches one VM
        thread.join(120)
        result = box["result"]
    finally:
        daemon.close()
    assert result.returncode == STOPPED_EXIT_CODE, result.errors
    step = latest_complete(str(store))
    assert step is not None and 1 <= step < STEPS


def test_periodic_checkpoints_staged_locally_reach_the_store_and_are_reported(tmp_path):
    """VARUNA_CHECKPOINT_TMPDIR: every 4th step is written locally and copied into the store in the
    background; each worker reports its share once it is in place, with the time training stood
    still for it, and the last one (step 12, copied while the script ends) is complete too."""
    store, staging = tmp_path / "store", tmp_path / "staging"
    daemon = FakeDaemon()
    notes = []
    try:
        thread, box, _ = start_launch(tmp_path, store, {
            "VARUNA_CONTROL": daemon.endpoint, "VARUNA_CHECKPOINT_EVERY": "4",
            "VARUNA_CHECKPOINT_TMPDIR": str(staging)}, "staged")
        while len(notes) < 6:
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerCheckpointed):
                notes.append(msg)
        thread.join(120)
        result = box["result"]
    finally:
        daemon.close()
    assert result.ok, result.errors
    assert sorted((m.step, m.rank) for m in notes) == [(s, r) for s in (4, 8, 12) for r in (0, 1)]
    assert all(m.path == str(store / f"varuna_ckpt_{m.step}") and m.stalled_s > 0 for m in notes)
    for step in (4, 8, 12):
        verify(str(store / f"varuna_ckpt_{step}"))
    assert latest_complete(str(store)) == 12
    assert [p for p in staging.rglob("*") if p.is_file()] == []
