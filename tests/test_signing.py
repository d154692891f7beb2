"""Signed jobs (issue 17, item 3): daemons started with --submit-keys run only jobs signed by a key
they list; the rest are refused with the reason before any worker starts."""

from __future__ import annotations

import os
import stat

import pytest
from support.ring import JOB_SCRIPT, Ring

from varunad.control.jobs import JobSpec
from varunad.node.signing import AllowList, Signature, SigningError, generate_submit_key, sign_spec

SPEC = JobSpec(job="j", script="train.py", batch_size=4, steps=2, checkpoint_every=1, bundle_digest="a" * 64,
               bundle_bytes=10)


def test_a_signed_spec_verifies_and_names_its_signer(tmp_path):
    secret, public = generate_submit_key(tmp_path / "alice", "alice")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / public.name).write_bytes(public.read_bytes())
    sig = sign_spec(secret, SPEC.encode()).encode()
    assert AllowList(allowed).verify("j", SPEC.encode(), sig) == "alice"


def test_unsigned_foreign_and_tampered_jobs_are_refused_with_the_reason(tmp_path):
    alice, alice_pub = generate_submit_key(tmp_path / "keys", "alice")
    mallory, _ = generate_submit_key(tmp_path / "keys", "mallory")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / alice_pub.name).write_bytes(alice_pub.read_bytes())
    keys = AllowList(allowed)
    with pytest.raises(SigningError, match="is not signed"):
        keys.verify("j", SPEC.encode(), None)
    with pytest.raises(SigningError, match="signed by 'mallory', which is not in this fleet's allow-list"):
        keys.verify("j", SPEC.encode(), sign_spec(mallory, SPEC.encode()).encode())
    # the bundle digest changed after signing (another bundle put under the same spec)
    other = JobSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__dataclass_fields__}, "bundle_digest": "b" * 64})
    with pytest.raises(SigningError, match="does not match its spec"):
        keys.verify("j", other.encode(), sign_spec(alice, SPEC.encode()).encode())
    # a forged signature under alice's name
    forged = Signature("alice", "00" * 64).encode()
    with pytest.raises(SigningError, match="does not match"):
        keys.verify("j", SPEC.encode(), forged)
    with pytest.raises(SigningError, match="malformed"):
        keys.verify("j", SPEC.encode(), b"junk")


def test_an_empty_allow_list_is_a_startup_error(tmp_path):
    with pytest.raises(SigningError, match="holds no"):
        AllowList(tmp_path)


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
