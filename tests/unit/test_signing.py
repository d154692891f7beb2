"""Signed jobs (issue 17, item 3): daemons started with --submit-keys run only jobs signed by a key
they list; the rest are refused with the reason before any worker starts."""

from __future__ import annotations

import os
import stat

import pytest

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


