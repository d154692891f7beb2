"""Tensor streams between real workers under CURVE: the right keys train, a peer whose key is
not on the allow-list delivers nothing."""

import json

import pytest
from support import TESTS

from protocol.security import generate_key_pair, load_public_key
from trainer.launch import launch

WORKER = TESTS / "workers" / "train_check.py"

pytestmark = pytest.mark.slow


def curve_env(tmp_path, *, allow_self: bool):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    public, secret = generate_key_pair(keys, "node0")
    if allow_self:
        (allowed / "node0.key").write_bytes(public.read_bytes())
    else:   # someone else's key is allowed, not ours
        other, _ = generate_key_pair(keys, "stranger")
        (allowed / "stranger.key").write_bytes(other.read_bytes())
    return {"VARUNA_SECURITY": "curve", "VARUNA_SECRET_KEY_FILE": str(secret),
            "VARUNA_ALLOWED_KEYS_DIR": str(allowed), "VARUNA_TRUSTED_NETWORK": "0",
            "VARUNA_PEER_KEYS": json.dumps({"*": load_public_key(public).decode()}),
            "VARUNA_PEER_TIMEOUT": "5"}


def test_curve_streams_train(tmp_path):
    out = tmp_path / "out"
    result = launch(WORKER, ["--out", str(out), "--steps", "2"], stages=2, replicas=1, timeout=180,
                    env=curve_env(tmp_path, allow_self=True))
    assert result.ok, result.errors
    assert json.loads((out / "losses_rank1.json").read_text())["record"][1]["step"] == 1


def test_unallowed_key_delivers_nothing(tmp_path):
    result = launch(WORKER, ["--out", str(tmp_path / "out"), "--steps", "2"], stages=2, replicas=1,
                    timeout=180, env=curve_env(tmp_path, allow_self=False))
    assert not result.ok
    # refused at the handshake, and said so at once (not a peer timeout later)
    assert "refused the stream handshake (its keys do not allow this worker)" in "".join(result.errors), result.errors
