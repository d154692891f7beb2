"""One varunad with its defaults (plaintext, no calibration: the synthetic one plans data-parallel
only) runs a job to the end, and leaves the fleet at once on SIGTERM."""

from __future__ import annotations

import signal
import time

import pytest

from reference import reference_run
from ring import Ring

pytestmark = pytest.mark.slow


def test_one_daemon_runs_a_job_with_the_default_calibration_and_leaves_on_sigterm(tmp_path, etcd, etcd_root):
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo")
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
