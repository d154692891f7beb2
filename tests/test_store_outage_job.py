"""A job whose checkpoint store fills up mid-run: real workers (the local launcher, the tiny GPT),
a real full filesystem (a tmpfs another writer fills), the daemon's end of the control socket.

Periodic checkpoints the store refuses are skipped while training goes on; the final one waits in
memory until space comes back; the worker says when the outage began and when it ended; the
losses are the plain PyTorch loop's. The same faults under real daemons are tests/chaos/'s
store scenarios.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "chaos"))

from protocol.messages import WorkerCheckpointed, WorkerProgress, WorkerStoreOutage  # noqa: E402
from reference import reference_run  # noqa: E402
from store_faults import MountRefused, fill, tmpfs_store  # noqa: E402
from test_worker_control import BATCH, STEPS, FakeDaemon, start_launch  # noqa: E402
from trainer.checkpoint.reading import MANIFEST, checkpoint_dir  # noqa: E402
from trainer.checkpoint.store import latest_complete  # noqa: E402

pytestmark = pytest.mark.slow

EVERY = 2


def test_a_store_that_fills_up_mid_run_pauses_checkpoints_and_the_job_finishes(tmp_path):
    said: list[WorkerStoreOutage] = []
    checkpointed: list[WorkerCheckpointed] = []
    with contextlib.ExitStack() as stack:
        try:
            store = str(stack.enter_context(tmpfs_store(tmp_path / "store", "64m")))
        except MountRefused as exc:
            pytest.skip(str(exc))
        daemon = FakeDaemon()
        stack.callback(daemon.close)
        thread, box, out = start_launch(tmp_path, store, {
            "VARUNA_CONTROL": daemon.endpoint, "VARUNA_CHECKPOINT_EVERY": str(EVERY), "VARUNA_STEPS": str(STEPS),
            "VARUNA_KEEP_CHECKPOINTS": "100"}, "full")
        # the store fills up once the first checkpoint is in
        while not checkpointed:
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerCheckpointed):
                checkpointed.append(msg)
        filler = fill(Path(store))
        full_at = checkpointed[0].step
        # training goes on to its last step while every checkpoint after it is refused
        last = -1
        while last < STEPS - 1 or not said:
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerProgress):
                last = max(last, msg.step)
            elif isinstance(msg, WorkerStoreOutage):
                said.append(msg)
            elif isinstance(msg, WorkerCheckpointed) and msg.step > full_at + EVERY:
                raise AssertionError(f"checkpoint {msg.step} reported written into a full store")
        assert thread.is_alive(), box.get("result")   # the final checkpoint is held: the workers wait
        refused = range(full_at + 2 * EVERY, STEPS + 1, EVERY)   # the final one among them
        assert not any((Path(checkpoint_dir(store, s)) / MANIFEST).exists() for s in refused)
        assert latest_complete(store) <= full_at + EVERY   # one write may have been under way when it filled
        filler.unlink()
        while len({m.rank for m in checkpointed if m.step == STEPS}) < 2:   # each says "recovered" first
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerCheckpointed):
                checkpointed.append(msg)
            elif isinstance(msg, WorkerStoreOutage):
                said.append(msg)
        thread.join(120)
        result = box["result"]
        final = latest_complete(store)
    assert result.ok, result.errors
    assert final == STEPS
    failing = [m for m in said if m.failing]
    assert failing and all("No space left on device" in m.error for m in failing)
    assert {m.step for m in failing} <= {full_at + EVERY, full_at + 2 * EVERY}   # since the first refused one
    assert sorted(m.rank for m in said if not m.failing) == sorted({m.rank for m in failing})   # and over
    ref_losses, _ = reference_run(STEPS, BATCH)
    record = json.loads((out / "losses_rank1.json").read_text())["record"]
    assert [r["step"] for r in record] == list(range(STEPS))
    assert [r["loss"] for r in record] == pytest.approx(ref_losses, rel=1e-5)
