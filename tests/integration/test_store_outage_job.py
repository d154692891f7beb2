"""Jobs through a checkpoint store that refuses writes, on real filesystems (a tmpfs another writer
fills, a read-only bind mount) with real workers.

Under the local launcher with the daemon's end of the control socket: periodic checkpoints the
store refuses are skipped while training goes on, the final one waits in memory until space comes
back, and the worker says when the outage began and when it ended. Under one real daemon: a
worker that died of an outage anyway is started again without using up a restart. Either way the
losses are the plain PyTorch loop's. More faults under a ring of daemons: tests/integration/chaos/'s store
scenarios.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from support.fake_daemon import BATCH, STEPS, FakeDaemon, start_launch
from support.reference import reference_run
from support.store_faults import MountRefused, fill, read_only, tmpfs_store

from protocol.messages import WorkerCheckpointed, WorkerProgress, WorkerStoreOutage
from trainer.checkpoint.reading import MANIFEST, checkpoint_dir
from trainer.checkpoint.store import latest_complete

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
        full_at = checkpointed[0].step
        filler = fill(Path(store), leave=300_000)   # a layer file fits, a whole checkpoint does not
        while not said:   # the first refused checkpoint
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerStoreOutage):
                said.append(msg)
        # a checkpoint under way when the store filled gave its files back: fill it up again
        fill(Path(store), leave=300_000)
        base = latest_complete(store)
        # training goes on to its last step while every checkpoint after it is refused
        last = -1
        while last < STEPS - 1:
            _, msg = daemon.next_message()
            if isinstance(msg, WorkerProgress):
                last = max(last, msg.step)
            elif isinstance(msg, WorkerStoreOutage):
                said.append(msg)
            elif isinstance(msg, WorkerCheckpointed) and msg.step > base:
                raise AssertionError(f"checkpoint {msg.step} reported written into a full store")
        assert thread.is_alive(), box.get("result")   # the final checkpoint is held: the workers wait
        assert latest_complete(store) == base and not (Path(checkpoint_dir(store, STEPS)) / MANIFEST).exists()
        # and what a refused periodic checkpoint had written is gone again: the full store needs the space
        given_up = [d for d in Path(store).glob("varuna_ckpt_*") if not (d / MANIFEST).exists()
                    and d.name != Path(checkpoint_dir(store, STEPS)).name]   # the final one: still being tried
        assert given_up and not [f"{d.name}/{f.name}" for d in given_up for f in d.glob("*.pt")]
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
    assert min(m.step for m in failing) > full_at   # since the first refused one
    # and over: every rank that said so says it recovered, last. The refill above can end the
    # outage for a moment (a loaded host saw each rank fail, recover, fail and recover again).
    assert {m.rank for m in said if not m.failing} == {m.rank for m in failing}
    assert not any({m.rank: m.failing for m in said}.values())
    ref_losses, _ = reference_run(STEPS, BATCH)
    record = json.loads((out / "losses_rank1.json").read_text())["record"]
    assert [r["step"] for r in record] == list(range(STEPS))
    assert [r["loss"] for r in record] == pytest.approx(ref_losses, rel=1e-5)


def test_a_worker_that_dies_of_a_store_outage_restarts_without_using_up_a_restart(tmp_path, etcd, etcd_root):
    """One daemon allowed no restart at all; the script saves a checkpoint itself (no retry there)
    while the store is read-only, and dies of it. The leader starts it again uncounted; the new
    epoch's fence waits for the store; once it is writable the job finishes with the plain loop's
    losses."""
    from support.ring import Ring

    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        ring.start("solo", "--calibrate", "uniform", "--max-restarts", "0", "--progress-interval", "0.3")
        ring.wait_members(["solo"])
        ring.store_dir.mkdir(parents=True, exist_ok=True)
        ring.submit("ro", steps=10, every=4, script_args=("--save-at", "6", "--step-sleep", "0.3"))
        first = ring.wait_step("ro", 2)["epoch"]
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(read_only(ring.store_dir))
            except MountRefused as exc:
                pytest.skip(str(exc))
            held = ring.poll(lambda: (s := ring.status("ro"))["epoch"] != first and s["store_failing"] and s,
                             timeout=120, what="the restarted epoch held by the read-only store")
        st = ring.wait_state("ro", ("done", "failed"), timeout=180)
    finally:
        ring.close()
    assert "Read-only file system" in held["store_failing"] and held["state"] in ("running", "morphing")
    assert st["state"] == "done", (st["state"], st["reason"])
    assert st["restarts"] == 0
    restart = [m for m in st["morphs"] if m["restart"]]
    assert len(restart) == 1 and restart[0]["cause"] == "the checkpoint store refused a write"
    assert "not counted as a restart" in restart[0]["reason"]
    reference = reference_run(10, BATCH)[0]
    assert [s for s, _ in st["loss_history"]] == list(range(10))
    assert all(abs(loss - reference[s]) <= 1e-4 * abs(reference[s]) for s, loss in st["loss_history"])


def test_a_daemons_staging_directory_read_only_for_a_while_pauses_its_checkpoints_not_the_job(
        tmp_path, etcd, etcd_root):
    """Two daemons, 1x2; the first one's staging directory (STATE_DIR/staging: checkpoints wait
    there on their way to the store) turns read-only for a few checkpoints. That worker's save
    was given up while its peer's went through; at the next checkpoint the peer entered the
    comparison of shares, a collective the first one skipped, and the job hung for good, also
    after the directory was writable again (an outside probe's read-only --state-dir)."""
    from support.ring import Ring

    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    steps = 16
    try:
        for name in ("s1", "s2"):
            ring.start(name, "--calibrate", "uniform", "--progress-interval", "0.3")
        ring.wait_members(["s1", "s2"])
        ring.submit("staged", steps=steps, every=EVERY, script_args=("--cheap-allreduce", "--step-sleep", "0.3"))
        st = ring.wait_step("staged", 3)
        assert (st["plan"]["P"], st["plan"]["D"]) == (1, 2), st["plan"]
        staging = ring.base / "s1" / "staging"
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(read_only(staging))
            except MountRefused as exc:
                pytest.skip(str(exc))
            held = ring.poll(lambda: (s := ring.status("staged"))["store_failing"] and s, timeout=60,
                             what="a checkpoint the read-only staging directory refused")
            ring.wait_step("staged", held["step"] + 2 * EVERY, timeout=60)   # training goes on meanwhile
        done = ring.wait_state("staged", ("done", "failed"), timeout=120)
    finally:
        ring.close()
    assert "Read-only file system" in held["store_failing"] and "/staging/" in held["store_failing"]
    assert done["state"] == "done", (done["state"], done["reason"])
    assert done["restarts"] == 0 and done["epoch"] == st["epoch"], done["morphs"]
    reference = reference_run(steps, BATCH)[0]
    assert [s for s, _ in done["loss_history"]] == list(range(steps))
    assert all(abs(loss - reference[s]) <= 1e-4 * abs(reference[s]) for s, loss in done["loss_history"])
