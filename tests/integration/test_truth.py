"""The product tells the truth about a job: real etcd, one real varunad, real workers.

A job is done only when its workers trained its last step (and its checkpoint is complete); a
script that ends early fails the job saying where; a script that cannot compile is refused at
submit; an error that cannot go away by starting again (a ConfigError) fails the job after one
attempt, not after every restart. One daemon (one slot, the synthetic calibration: every job runs
1x1, no calibration run) serves every scenario in turn.
"""

from __future__ import annotations

import pytest
from support.etcd_server import EtcdServer
from support.ring import Ring

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    server = EtcdServer()
    server.start()
    r = Ring(tmp_path_factory.mktemp("truth"), server.endpoint, root="/truth/", ttl=6.0,
             extra=["--calibrate", "uniform", "--max-restarts", "3", "--abort-grace", "2",
                    "--progress-interval", "0.5", "--debounce", "0.2", "--stall-timeout", "12"])
    try:
        r.start("t1")
        r.wait_members(["t1"])
        yield r
    finally:
        r.close()
        server.close()


def test_a_script_that_stops_early_fails_the_job_with_the_step_it_reached(ring, tmp_path):
    ring.submit("early", steps=6, every=2, script_args=("--stop-at", "3"))
    st = ring.wait_state("early", ("done", "failed"), timeout=120)
    assert st["state"] == "failed", st
    assert st["reason"].startswith("the script ended at step 3 of 6"), st["reason"]
    assert st["step"] == 3 and [s for s, _ in st["loss_history"]] == [0, 1, 2]
    # a script that never trains at all (it only prints) is not done either, and trained nothing
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "hi.py").write_text("print('hi')\n")
    r = ring.varunactl("submit", "--name", "plain", "--batch-size", "8", "--steps", "10", "--checkpoint-every", "5",
                       str(plain / "hi.py"))
    assert r.returncode == 0, r.stderr
    st = ring.wait_state("plain", ("done", "failed"), timeout=60)
    assert st["state"] == "failed" and st["reason"].startswith("the script ended at step 0 of 10"), st
    assert st["step"] == 0


def test_a_script_that_does_not_compile_or_import_is_refused_at_submit(ring, tmp_path):
    (tmp_path / "broken.py").write_text("import os\nprint('unclosed'\n")
    r = ring.varunactl("submit", "--name", "broken", "--batch-size", "8", "--steps", "4", "--checkpoint-every", "2",
                       str(tmp_path / "broken.py"))
    assert r.returncode == 1 and "broken.py line 2: SyntaxError" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "broken.py").write_text("import os\nimport no_such_module_here\n")
    r = ring.varunactl("submit", "--name", "broken", "--batch-size", "8", "--steps", "4", "--checkpoint-every", "2",
                       str(tmp_path / "broken.py"))
    assert r.returncode == 1 and "imports no_such_module_here" in r.stderr and "--no-import-check" in r.stderr
    assert ring.call(ring.store.get(ring.keys.job("broken"))) is None   # nothing reached etcd
    # a file that is not Python at all, named like no Python file (an outside test submitted /etc/passwd)
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    r = ring.varunactl("submit", "--name", "broken", "--batch-size", "8", "--steps", "4", "--checkpoint-every", "2",
                       str(tmp_path / "passwd"))
    assert r.returncode == 1 and "passwd is not a Python script (line 1: " in r.stderr, r.stderr
    assert "pass its data files as the script's arguments after --" in r.stderr
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01binary")
    r = ring.varunactl("submit", "--name", "broken", "--batch-size", "8", "--steps", "4", "--checkpoint-every", "2",
                       str(tmp_path / "weights.bin"))
    assert r.returncode == 1 and "weights.bin is not a Python script" in r.stderr, r.stderr
    assert ring.call(ring.store.get(ring.keys.job("broken"))) is None


def test_a_config_error_fails_the_job_after_one_attempt_with_its_first_line(ring):
    ring.submit("mismatch", steps=4, every=2, batch=12, script_args=("--script-batch", "6"))
    st = ring.wait_state("mismatch", ("done", "failed"), timeout=120)
    assert st["state"] == "failed", st
    assert st["restarts"] == 0 and st["morphs"] == [], st   # not retried, and no "morph 1x1 -> 1x1"
    assert st["reason"].startswith("ConfigError: the job was submitted with global batch 12"), st["reason"]
    assert "not retried" in st["reason"] and "rank 0 on t1" in st["reason"]
    r = ring.varunactl("status", "mismatch")
    assert r.returncode == 0 and "morphs    none" in r.stdout and "restarts  0" in r.stdout, r.stdout


def test_a_job_that_trains_every_step_is_done_and_its_plan_explained(ring):
    ring.submit("whole", steps=3, every=2)
    st = ring.wait_state("whole", ("done", "failed"), timeout=120)
    assert st["state"] == "done" and st["step"] == 3, st
    r = ring.varunactl("status", "whole")
    assert r.returncode == 0, r.stderr
    why = [ln for ln in r.stdout.splitlines() if ln.startswith("why ")]
    assert why and "1x1, micro-batch" in why[0] and "estimated" in why[0], r.stdout


def test_a_worker_killed_after_the_last_checkpoint_leaves_the_job_done_not_restarted(ring, tmp_path):
    """Its job was trained and its last checkpoint complete when the worker died (a VM lost as the
    job ends): nothing is left to train, so no epoch starts to train 0 steps, counted as a restart."""
    import os
    import signal

    marker = tmp_path / "lingering.pid"
    ring.submit("lastgasp", steps=4, every=2, script_args=("--linger-file", str(marker)))
    ring.poll(lambda: marker.exists(), timeout=120, what="the worker lingering after its job")
    os.kill(int(marker.read_text()), signal.SIGKILL)
    st = ring.wait_state("lastgasp", ("done", "failed"), timeout=120)
    assert st["state"] == "done" and st["step"] == 4, st
    assert "the checkpoint of the last one is complete" in st["reason"], st["reason"]
    assert st["restarts"] == 0 and st["morphs"] == [], st


def test_a_job_whose_loss_diverged_reports_every_step_and_is_not_taken_for_stuck(ring):
    """From its second step the loss is NaN and every step is skipped by agreement, as a plain loop
    would go on: its workers dropped those steps' progress, so after --stall-timeout (12 s here)
    the leader restarted the epoch as stuck, every time, and gave up after 3 restarts."""
    import math

    ring.submit("diverged", steps=8, every=4, script_args=("--lr", "1e30", "--step-sleep", "2.5"))
    st = ring.wait_state("diverged", ("done", "failed"), timeout=240)
    assert st["state"] == "done" and st["step"] == 8 and st["restarts"] == 0, st
    losses = dict(st["loss_history"])
    assert sorted(losses) == list(range(8)) and math.isfinite(losses[0]), losses
    assert all(math.isnan(losses[s]) for s in range(2, 8)), losses
    r = ring.varunactl("status", "diverged", "--json")
    assert r.returncode == 0 and "NaN" not in r.stdout, r.stdout   # JSON every parser reads


def test_one_rank_whose_script_ends_early_fails_the_job_in_its_own_words_at_once(tmp_path):
    """Rank 1 leaves its loop at step 3 of 6 and exits 0 while rank 0 trains on; rank 0 then fails
    on a broken connection. The job fails at once, for rank 1's early end, not rank 0's connection:
    starting again from the last checkpoint would end the same way."""
    server = EtcdServer()
    server.start()
    two = Ring(tmp_path / "two", server.endpoint, root="/truth-two/", ttl=6.0,
               extra=["--calibrate", "uniform", "--max-restarts", "3", "--abort-grace", "2",
                      "--progress-interval", "0.5", "--debounce", "0.2", "--slots", "2"])
    try:
        two.start("u1")
        two.wait_members(["u1"])
        two.submit("onerank", steps=6, every=2, script_args=("--stop-at", "3", "--stop-rank", "1"))
        st = two.wait_state("onerank", ("done", "failed"), timeout=180)
        assert st["state"] == "failed", st
        assert "the script ended at step 3 of 6" in st["reason"] and "rank 1 on u1" in st["reason"], st["reason"]
        assert "not retried" in st["reason"] and st["restarts"] == 0, st
    finally:
        two.close()
        server.close()
