"""protocol.security: real CURVE sockets on loopback admit allowed keys only; key files fail clearly."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.asyncio

from protocol.errors import SecurityError
from protocol.frames import recv_tensor, send_tensor
from protocol.security import (
    Security,
    SecurityConfig,
    configure_curve_client,
    configure_curve_server,
    generate_key_pair,
    load_allowed_keys,
    load_key_pair,
    load_public_key,
)

REFUSED_MS = 600      # how long an unauthorised message gets to (not) arrive
ARRIVES_MS = 5000


@pytest.fixture
def keys(tmp_path: Path) -> SimpleNamespace:
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    generate_key_pair(allowed, "server")
    generate_key_pair(allowed, "client")
    generate_key_pair(other, "intruder")
    return SimpleNamespace(
        allowed=allowed, other=other,
        server=allowed / "server.key_secret", client=allowed / "client.key_secret",
        intruder=other / "intruder.key_secret",
        config=SecurityConfig(secret_key_file=str(allowed / "server.key_secret"), allowed_keys_dir=str(allowed)),
    )


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    _KEEP.clear()
    c.destroy(linger=0)


_KEEP: list[zmq.Socket] = []   # a dropped socket would close (linger 0) before its handshake


def _client(ctx: zmq.Context, endpoint: str, key_file: Path | None, server_key: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    _KEEP.append(sock)
    sock.linger = 0
    if key_file is not None:
        public, secret = load_key_pair(key_file)
        configure_curve_client(sock, public, secret, server_key)
    sock.connect(endpoint)
    return sock


def _server(security: Security, ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    security.apply_control_server(sock)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


# --- sockets ---------------------------------------------------------------------------------------

def test_only_allowed_clients_get_through(keys, ctx):
    with Security(keys.config) as security:
        server, endpoint = _server(security, ctx)
        assert server.mechanism == zmq.CURVE
        server_key = security.public_key
        wrong_server_key = load_public_key(keys.client)
        for name, key_file, expect in (("intruder", keys.intruder, server_key),
                                       ("plaintext", None, server_key),
                                       ("wrong-server-key", keys.client, wrong_server_key)):
            _client(ctx, endpoint, key_file, expect).send(name.encode())
            assert server.poll(REFUSED_MS) == 0, f"{name} got through"
        _client(ctx, endpoint, keys.client, server_key).send(b"allowed")
        assert server.poll(ARRIVES_MS)
        assert server.recv() == b"allowed"
        assert server.poll(REFUSED_MS) == 0   # the refused ones never arrive later either


async def test_asyncio_server_admits_only_allowed_clients(keys, ctx):
    actx = zmq.asyncio.Context()
    try:
        with Security(keys.config) as security:
            server = actx.socket(zmq.PULL)
            server.linger = 0
            security.apply_control_server(server)   # starts an AsyncioAuthenticator on this loop
            server.bind("tcp://127.0.0.1:*")
            endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
            _client(ctx, endpoint, keys.intruder, security.public_key).send(b"intruder")
            assert await server.poll(REFUSED_MS) == 0
            _client(ctx, endpoint, keys.client, security.public_key).send(b"allowed")
            assert await server.poll(ARRIVES_MS)
            assert await server.recv() == b"allowed"
            server.close()
    finally:
        actx.destroy(linger=0)


def test_tensor_stream_over_curve_with_the_peer_key_named_after_its_member(keys, ctx):
    client_config = SecurityConfig(secret_key_file=str(keys.client), allowed_keys_dir=str(keys.allowed))
    with Security(keys.config) as receiver, Security(client_config) as sender:
        pull = ctx.socket(zmq.PULL)
        pull.linger = 0
        receiver.apply_stream_server(pull)
        pull.bind("tcp://127.0.0.1:*")
        endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        # Key files are named after members: the worker on member "server" serves `endpoint`.
        sender.add_peer(endpoint, sender.member_public_key("server"))
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        sender.apply_stream_client(push, endpoint)
        assert push.mechanism == zmq.CURVE
        push.connect(endpoint)
        t = torch.randn(3 * (1 << 20) // 4 + 5)
        send_tensor(push, t, job="j", epoch=1, stage=0, micro_batch=0, direction="act")
        assert pull.poll(ARRIVES_MS)
        _, got = recv_tensor(pull)
        assert torch.equal(got, t)


def test_reloading_the_allow_list_admits_a_new_key(keys, ctx):
    with Security(keys.config) as security:
        server, endpoint = _server(security, ctx)
        late_secret = generate_key_pair(keys.other, "late")[1]
        _client(ctx, endpoint, late_secret, security.public_key).send(b"early")
        assert server.poll(REFUSED_MS) == 0
        (keys.allowed / "late.key").write_bytes((keys.other / "late.key").read_bytes())
        security.reload_allowed_keys()
        _client(ctx, endpoint, late_secret, security.public_key).send(b"late")
        assert server.poll(ARRIVES_MS)
        assert server.recv() in (b"late", b"early")   # the first client may retry its handshake too


def test_trusted_network_skips_curve_on_streams_only(keys, ctx):
    config = SecurityConfig(secret_key_file=str(keys.server), allowed_keys_dir=str(keys.allowed), trusted_network=True)
    with Security(config) as security:
        stream, control, client = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        security.apply_stream_server(stream)
        security.apply_stream_client(client, "tcp://10.0.0.9:1")   # no peer key needed
        security.apply_control_server(control)
        assert (stream.mechanism, client.mechanism, control.mechanism) == (zmq.NULL, zmq.NULL, zmq.CURVE)
        for s in (stream, control, client):
            s.close(0)


def test_plaintext_must_be_asked_for_and_then_secures_nothing(ctx):
    with pytest.raises(SecurityError, match="plaintext"):
        SecurityConfig()
    with Security(SecurityConfig(mode="plaintext")) as security:
        sock = ctx.socket(zmq.PULL)
        security.apply_control_server(sock)
        security.apply_control_client(sock, b"x" * 40)
        assert sock.mechanism == zmq.NULL
        assert security.public_key is None
        sock.close(0)


def test_curve_server_refuses_a_context_without_authenticator(keys, ctx):
    public, secret = load_key_pair(keys.server)
    sock = ctx.socket(zmq.PULL)
    with pytest.raises(SecurityError, match="admit any client"):
        configure_curve_server(sock, public, secret)
    sock.close(0)


def test_stream_client_needs_a_known_server_key(keys, ctx):
    with Security(keys.config) as security:
        sock = ctx.socket(zmq.PUSH)
        with pytest.raises(SecurityError, match="add_peer"):
            security.apply_stream_client(sock, "tcp://10.0.0.1:5555")
        with pytest.raises(SecurityError, match="member"):
            security.member_public_key("../etc/passwd")
        with pytest.raises(SecurityError, match="does not exist"):
            security.member_public_key("nobody")
        with pytest.raises(SecurityError, match="CURVE key"):
            security.add_peer("tcp://10.0.0.1:5555", b"short")
        sock.close(0)


# --- key files -------------------------------------------------------------------------------------

def test_generate_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    public, secret = generate_key_pair(tmp_path / "k", "vm-1")
    assert (public.name, secret.name) == ("vm-1.key", "vm-1.key_secret")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public).st_mode) == 0o644
    pair = load_key_pair(secret)
    assert load_public_key(public) == pair[0] and len(pair[1]) == 40
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["vm-1.key", "vm-1.key_secret"]  # no temp left
    with pytest.raises(SecurityError, match="--force"):
        generate_key_pair(tmp_path / "k", "vm-1")
    assert load_key_pair(secret) == pair
    generate_key_pair(tmp_path / "k", "vm-1", force=True)
    assert load_key_pair(secret) != pair
    with pytest.raises(SecurityError, match="no slashes"):
        generate_key_pair(tmp_path / "k", "../evil")


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"),
    ("hello\n", "no public key"),
    ('curve\n    public-key = "tooshort"\n', "not a CURVE key"),
    ('curve\n    public-key = "' + "~" * 40 + '"\n', "not valid Z85|not a CURVE key"),
])
def test_bad_key_files_fail_clearly(tmp_path, content, words):
    path = tmp_path / "x.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SecurityError, match=words) as info:
        load_public_key(path)
    assert str(path) in str(info.value) or "CURVE" in str(info.value)


def test_key_pair_needs_the_secret_file(keys):
    with pytest.raises(SecurityError, match="key_secret"):
        load_key_pair(keys.allowed / "server.key")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key_file(keys):
    os.chmod(keys.server, 0)
    with pytest.raises(SecurityError, match="cannot read"):
        load_key_pair(keys.server)


def test_allow_list_directory(keys, tmp_path):
    allowed = load_allowed_keys(keys.allowed)
    assert allowed == {load_public_key(keys.server), load_public_key(keys.client)}
    with pytest.raises(SecurityError, match="does not exist"):
        load_allowed_keys(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SecurityError, match="no .key files"):
        load_allowed_keys(tmp_path / "empty")
    with pytest.raises(SecurityError, match="does not exist"):
        Security(SecurityConfig(secret_key_file=str(keys.server), allowed_keys_dir=str(tmp_path / "missing")))


def test_config_env_round_trip_never_falls_back_to_plaintext(keys):
    config = SecurityConfig(secret_key_file=str(keys.server), allowed_keys_dir=str(keys.allowed), trusted_network=True)
    assert SecurityConfig.from_env(config.to_env()) == config
    assert SecurityConfig.from_env(SecurityConfig(mode="plaintext").to_env()).mode == "plaintext"
    with pytest.raises(SecurityError, match="secret_key_file"):
        SecurityConfig.from_env({})
    with pytest.raises(SecurityError, match="0 or 1"):
        SecurityConfig.from_env({**config.to_env(), "VARUNA_TRUSTED_NETWORK": "yes"})
    with pytest.raises(SecurityError, match="mode"):
        SecurityConfig(mode="tls")
