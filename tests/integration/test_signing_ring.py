"""Signed jobs (issue 17, item 3): daemons started with --submit-keys run only jobs signed by a key
they list; the rest are refused with the reason before any worker starts.

The tests of tests/unit/test_signing.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import pytest
from support.ring import JOB_SCRIPT, Ring

from varunad.node.signing import generate_submit_key


@pytest.mark.slow
def test_a_fleet_with_submit_keys_runs_only_signed_jobs(tmp_path, etcd_fault):
    alice, alice_pub = generate_submit_key(tmp_path / "keys", "alice")
    mallory, _ = generate_submit_key(tmp_path / "keys", "mallory")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / alice_pub.name).write_bytes(alice_pub.read_bytes())
    ring = Ring(tmp_path / "ring", etcd_fault.endpoint, root="/signed/", ttl=3.0,
                extra=["--submit-keys", str(allowed), "--max-restarts", "0", "--abort-grace", "1"])
    try:
        ring.start("vm1")
        ring.wait_members(["vm1"])
        for job, key in (("unsigned", None), ("foreign", mallory)):
            args = ["--sign-key", str(key)] if key else []
            r = ring.varunactl("submit", "--name", job, "--batch-size", "12", "--steps", "2", "--checkpoint-every",
                               "1", *args, str(JOB_SCRIPT))
            assert r.returncode == 0, r.stderr
            st = ring.wait_state(job, ("done", "failed"), timeout=90)
            assert st["state"] == "failed", st
            why = "is not signed" if key is None else "'mallory', which is not in this fleet's allow-list"
            assert why in (st.get("error") or "") + st.get("reason", ""), st
        # no worker was ever started for them
        logs = list((tmp_path / "ring" / "vm1").glob("logs/*/*.log"))
        assert not logs, logs
        r = ring.varunactl("submit", "--name", "signed", "--batch-size", "12", "--steps", "2", "--checkpoint-every",
                           "1", "--sign-key", str(alice), str(JOB_SCRIPT))
        assert r.returncode == 0 and "signed" in r.stdout, r.stderr
        st = ring.wait_state("signed", ("done", "failed"), timeout=120)
        assert st["state"] == "done", st
        assert "job signed is signed by alice" in ring.daemons["vm1"].log_text()
    finally:
        ring.close()
