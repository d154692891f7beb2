"""etcd restored from an older copy of its data: real etcd, one real varunad, real workers.

Plan epochs are etcd revisions; a restore without a revision bump takes them back, and the
daemons refused every plan after it (older than the epoch they applied), so the fleet stood still
until each daemon was restarted. Here the copy is taken cold (etcd stopped, its data directory
copied), a morph follows it, and the copy is put back while the job trains
(varunad.cluster.revision_floor, varunad.control.decide's history-went-back rule).
"""

from __future__ import annotations

import shutil

import psutil
import pytest
from support.etcd_server import EtcdServer
from support.reference import reference_run
from support.ring import Ring

pytestmark = pytest.mark.slow

STEPS = 40


def _kill_worker(ring: Ring, job: str) -> None:
    """SIGKILL the job's training worker (not a spare that imports its script)."""
    killed = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        script = [c for c in cmd if c.startswith(str(ring.base)) and c.endswith("train_job.py") and f"/{job}/" in c]
        if script and "--imports-of" not in cmd:
            p.kill()
            killed += 1
    assert killed == 1, f"expected one worker of {job}, killed {killed}"


def test_a_job_trains_on_after_etcd_is_restored_from_an_older_copy(tmp_path):
    server = EtcdServer()
    server.start()
    ring = Ring(tmp_path / "ring", server.endpoint, root="/restored/", ttl=6.0,
                extra=["--calibrate", "uniform", "--max-restarts", "3", "--abort-grace", "2",
                       "--progress-interval", "0.5", "--debounce", "0.2"])
    try:
        ring.start("r1")
        ring.wait_members(["r1"])
        ring.submit("rb", steps=STEPS, every=3, script_args=("--step-sleep", "0.3"))
        ring.wait_step("rb", 4)
        server.stop()
        copy = tmp_path / "etcd-copy"
        shutil.copytree(server.data_dir, copy)
        server.start()
        ring.wait_step("rb", 8)
        _kill_worker(ring, "rb")   # a restart: an epoch (a plan's revision) the copy does not hold
        ring.poll(lambda: (s := ring.status("rb"))["restarts"] == 1 and s["state"] == "running", timeout=60,
                  what="the restart after the kill")
        restarted = ring.status("rb")["epoch"]
        ring.wait_step("rb", ring.status("rb")["step"] + 3)
        server.stop()
        shutil.rmtree(server.data_dir)
        shutil.copytree(copy, server.data_dir)
        server.start()
        assert ring.status("rb")["epoch"] < restarted   # etcd's history went back
        st = ring.wait_state("rb", ("done", "failed"), timeout=180)
        assert st["state"] == "done" and st["step"] == STEPS, st
        # the restart's epoch was stopped with a checkpoint and planned again above it
        ran = {int(e): r for e, r in st["epochs"].items()}
        newest = max(ran)
        assert newest > restarted and ran[newest][1] == STEPS - 1, ran
        log = ring.daemons["r1"].log_text()
        assert "etcd's history went back" in log and "moving etcd's revision" in log, ring.tails()
        reference = reference_run(STEPS, 12)[0]
        history = dict(st["loss_history"])
        assert set(range(ran[newest][0], STEPS)) <= set(history), history
        for step, loss in history.items():
            assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    finally:
        ring.close()
        server.close()
