"""One varunad runs a job to the end, with the synthetic calibration (data-parallel only) or by
profiling the real script first (the default), and leaves the fleet at once on SIGTERM."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from reference import reference_run
from ring import Ring

pytestmark = pytest.mark.slow


def test_one_daemon_runs_a_job_with_the_synthetic_calibration_and_leaves_on_sigterm(tmp_path, etcd, etcd_root):
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo", "--calibrate", "uniform", "--keep-jobs", "1")
        ring.wait_members(["solo"])
        assert ring.poll(ring.leader, timeout=20, what="a leader") == "solo"
        ring.submit("solo-job", steps=6, every=2)
        st = ring.wait_state("solo-job", ("done", "failed"), timeout=120)
        assert st["state"] == "done", st
        assert (st["plan"]["P"], st["plan"]["D"], st["plan"]["calibrated"]) == (1, 1, False)
        reference = reference_run(6, 12)[0]
        assert [s for s, _ in st["loss_history"]] == list(range(6))
        for step, loss in st["loss_history"]:
            assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step])
        assert "no calibration of solo-job" in d.log_text()
        # --keep-jobs 1: the next job to start here deletes this one's bundle and worker logs
        state = tmp_path / "solo"
        assert sorted(p.name for p in (state / "logs").iterdir()) == ["solo-job"]
        ring.submit("next-job", steps=2, every=2)
        assert ring.wait_state("next-job", ("done", "failed"), timeout=120)["state"] == "done"
        for kind in ("bundles", "logs"):
            assert sorted(p.name for p in (state / kind).iterdir()) == ["next-job"], kind
        r = ring.varunactl("status")
        assert r.returncode == 0 and "leader    solo" in r.stdout and "solo-job: done" in r.stdout, r.stdout
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        left = time.monotonic() - sent
        assert not ring.member_present("solo") and ring.leader() is None, "the lease was not revoked"
        assert left < 10.0, f"leaving took {left:.1f}s with no workers to stop"
    finally:
        ring.close()


def test_the_default_profiles_the_real_script_before_planning(tmp_path, etcd, etcd_root):
    """No calibration in etcd: the daemon runs the job's script once with VARUNA_PROFILE (the
    Varuna object profiles the model and exits), stores the calibration, then plans from it. The
    host has two CPU slots (one thread each), so the profile measures both busy at once, as its
    training workers will run, and the calibration is stored for that kind of slot."""
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo", "--slots", "2")
        ring.wait_members(["solo"])
        member = json.loads(ring.call(ring.store.get(ring.keys.member("solo"))).value)
        assert member["device_kind"] == "cpu-2slots"
        script = Path(__file__).parent.parent / "examples" / "train_gpt.py"
        r = ring.varunactl("submit", "--name", "prof", "--batch-size", "8", "--steps", "3", "--checkpoint-every",
                           "3", str(script), "--", "--preset", "tiny")
        assert r.returncode == 0, r.stderr
        st = ring.wait_state("prof", ("done", "failed"), timeout=240)
        assert st["state"] == "done", st
        assert st["plan"]["calibrated"] is True
        assert "stored the calibration of prof for cpu-2slots" in d.log_text()
        # The profiler itself names what it measured: one slot of a host with two busy at once.
        written = list((tmp_path / "solo" / "calibration").glob("*.json"))
        assert written and {json.loads(f.read_text())["device_kind"] for f in written} == {"cpu-2slots"}
        assert [s for s, _ in st["loss_history"]] == [0, 1, 2]
    finally:
        ring.close()
