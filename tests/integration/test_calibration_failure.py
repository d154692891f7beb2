"""A calibration run that fails the way a worker would fails its job at once, with the script's own
error: it is the job's own script, so planning data-parallel without a calibration would only start
workers that fail the same way, later and in other words."""

from __future__ import annotations

import pytest
from support import REPO
from support.ring import Ring

pytestmark = pytest.mark.slow

GPT_SCRIPT = REPO / "examples" / "train_gpt.py"


def test_a_failed_calibration_run_fails_the_job_with_the_scripts_error(tmp_path, etcd, etcd_root):
    """An argparse error (exit code 2), an ImportError and an exception, each in a calibration run (the default
    --calibrate profile): the job is failed with the script's words, no training plan was ever
    written for it, and the daemon never planned without a calibration."""
    broken = tmp_path / "broken.py"
    broken.write_text("import definitely_not_a_module_of_this_job\n")
    raises = tmp_path / "raises.py"
    raises.write_text("import torch\nraise RuntimeError('the token file tokens.bin is empty')\n")
    untrained = tmp_path / "untrained.py"   # exits 0 having never built Varuna: no calibration written
    untrained.write_text("print('hello from a script that never trains')\n")
    ring = Ring(tmp_path / "ring", etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo")
        ring.wait_members(["solo"])
        for job, script, args in (("typo", GPT_SCRIPT, ["--preset", "tiny", "--stpes", "3"]),
                                  ("noimport", broken, []), ("raises", raises, []), ("untrained", untrained, [])):
            # --no-import-check: the import is missing on the VMs only
            r = ring.varunactl("submit", "--name", job, "--batch-size", "8", "--steps", "3", "--checkpoint-every", "3",
                               "--no-import-check", str(script), "--", *args)
            assert r.returncode == 0, r.stderr
            st = ring.wait_state(job, ("done", "failed"), timeout=120)
            assert st["state"] == "failed", st
            assert st["epoch"] == 0 and not st["epochs"], st  # no plan ever ran it: no worker trained
            assert f"the calibration run of {job} on solo failed" in st["reason"], st["reason"]
            assert "fix the script or its arguments" in st["reason"]
            status = ring.varunactl("status", job)
            assert status.returncode == 0 and "calibration run" in status.stdout, status.stdout
        assert "unrecognized arguments: --stpes" in ring.status("typo")["reason"]
        assert "No module named 'definitely_not_a_module_of_this_job'" in ring.status("noimport")["reason"]
        assert "RuntimeError: the token file tokens.bin is empty" in ring.status("raises")["reason"]
        assert "the script exited (code 0) without training: it never built Varuna(model, ...)" in \
            ring.status("untrained")["reason"], ring.status("untrained")["reason"]
        logs = ring.varunactl("logs", "raises")
        assert "Traceback" in logs.stdout and "tokens.bin is empty" in logs.stdout, logs.stdout + logs.stderr
        assert "without a measured calibration" not in d.log_text()
        assert "synthetic" not in d.log_text()
    finally:
        ring.close()


_SLOW_FIRST_CALIBRATION = """
import os, sys, time
from pathlib import Path
# the first calibration run waits to be killed; the next runs the example as it is
marker = Path(sys.argv[1])
if os.environ.get("VARUNA_PROFILE") and not marker.exists():
    marker.write_text(str(os.getpid()))
    time.sleep(120)
sys.argv = [sys.argv[0], *sys.argv[2:]]
exec(compile(Path({script!r}).read_text(), {script!r}, "exec"))
"""


def test_a_calibration_run_killed_from_outside_is_run_again_as_a_restart(tmp_path, etcd, etcd_root):
    """kill -9 of the calibration run's process (not the script's doing, nor the daemon's death):
    the job used to fail for good, blaming the script ("fix the script or its arguments"); it now
    calibrates again, counted against --max-restarts as a killed training worker is, and trains."""
    import os
    import signal
    import time

    script = tmp_path / "slow_first.py"
    script.write_text(_SLOW_FIRST_CALIBRATION.replace("{script!r}", repr(str(GPT_SCRIPT))))
    marker = tmp_path / "calibrating.pid"
    ring = Ring(tmp_path / "ring", etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo")
        ring.wait_members(["solo"])
        r = ring.varunactl("submit", "--name", "k", "--batch-size", "8", "--steps", "3", "--checkpoint-every", "3",
                           str(script), "--", str(marker), "--preset", "tiny")
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), d.log_text()[-3000:]
        time.sleep(0.2)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        st = ring.wait_state("k", ("done", "failed"), timeout=180)
        assert st["state"] == "done" and st["restarts"] == 1, st
        assert "the calibration run of k on solo was killed by a signal: calibrating again (restart 1" in d.log_text()
    finally:
        ring.close()
