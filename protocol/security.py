"""Who may talk to whom: CURVE keys, the allow-list, and configuring ZeroMQ sockets with them.

Every daemon has one CURVE key pair, written by `varunactl keys generate --dir DIR --name NAME` as
`NAME.key` (public, shareable) and `NAME.key_secret` (public + secret, mode 0600); name it after the
daemon's member name. The allow-list is a directory of `.key` files: the public keys of every daemon
(and operator) of the fleet. A server socket admits a client only if the client proves it holds the
secret of an allowed public key; a client connects only to a server proving it holds the secret of
the public key the client expects. Traffic is then encrypted.

Two kinds of sockets:

- control (plan-changed notices, progress, stop): always CURVE unless the mode is "plaintext";
- stream (tensor frames between pipeline neighbours): CURVE too, unless `trusted_network` says the
  network between workers is private, in which case they skip the encryption cost.

"plaintext" turns everything off and exists for local development only; it has to be asked for.

A CURVE server only checks the allow-list while a ZAP authenticator runs in its ZeroMQ context;
without one, libzmq admits any client. `configure_curve_server` therefore refuses a context that has
no authenticator started by `start_authenticator` (threads, sync sockets) or
`start_async_authenticator` (asyncio sockets, called from inside the running loop). `Security` does
all of this for a process, from one `SecurityConfig`.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from protocol.errors import SecurityError

__all__ = [
    "MODES",
    "Security",
    "SecurityConfig",
    "configure_curve_client",
    "configure_curve_server",
    "generate_key_pair",
    "load_allowed_keys",
    "load_key_pair",
    "load_public_key",
    "start_async_authenticator",
    "start_authenticator",
    "stop_authenticator",
]

MODES = ("curve", "plaintext")
_NAME_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_HOW_TO_MAKE = "create a key pair with `varunactl keys generate --dir DIR --name NAME`"
_ENV = {
    "mode": "VARUNA_SECURITY",
    "secret_key_file": "VARUNA_SECRET_KEY_FILE",
    "allowed_keys_dir": "VARUNA_ALLOWED_KEYS_DIR",
    "trusted_network": "VARUNA_TRUSTED_NETWORK",
}


# --- key files ------------------------------------------------------------------------------------

def _check_z85_key(key: Any, where: str) -> bytes:
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != 40:
        raise SecurityError(f"{where} is not a CURVE key (40 characters of Z85); {_HOW_TO_MAKE}")
    try:
        z85.decode(key)
    except Exception:
        raise SecurityError(f"{where} is not valid Z85; {_HOW_TO_MAKE}") from None
    return key


def _read_certificate(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise SecurityError(f"key file {path} does not exist (or is not a file); {_HOW_TO_MAKE}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise SecurityError(f"cannot read key file {path}: {exc.strerror or exc}; check its owner and mode") from None
    except ValueError:
        raise SecurityError(f"{path} holds no public key, so it is not a ZeroMQ certificate; {_HOW_TO_MAKE}") from None
    public = _check_z85_key(public, f"the public key in {path}")
    if secret is not None:
        secret = _check_z85_key(secret, f"the secret key in {path}")
    return public, secret


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key (40 bytes) of a `.key` or `.key_secret` file."""
    return _read_certificate(path)[0]


def load_key_pair(secret_path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a `NAME.key_secret` file."""
    public, secret = _read_certificate(secret_path)
    if secret is None:
        raise SecurityError(f"{secret_path} has no secret key; pass the NAME.key_secret file, not NAME.key")
    return public, secret


def load_allowed_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys of every `*.key` file in `directory` (secret files are not read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SecurityError(
            f"allow-list directory {directory} does not exist; put the public .key files of the fleet there")
    keys = frozenset(load_public_key(p) for p in sorted(directory.glob("*.key")))
    if not keys:
        raise SecurityError(
            f"allow-list directory {directory} holds no .key files, so no peer could connect; "
            "copy the public keys of the fleet's daemons there")
    return keys


def generate_key_pair(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write `NAME.key` and `NAME.key_secret` (mode 0600) in `directory`; returns their paths.

    Refuses to replace existing files unless `force`. The files are written in a private temporary
    directory and moved into place, so the secret is never readable by others, not even briefly.
    """
    if not _NAME_RE.fullmatch(name):
        raise SecurityError(f"key name {name!r} must be 1..128 letters, digits or . _ - : @ (no slashes)")
    directory = Path(directory)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise SecurityError(f"{path} already exists; pass --force to replace it (peers that allow the old public key will then refuse this daemon)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".keys-") as tmp:
            made_public, made_secret = zmq.auth.create_certificates(tmp, name)
            os.chmod(made_secret, 0o600)
            os.chmod(made_public, 0o644)
            os.replace(made_secret, secret_path)
            os.replace(made_public, public_path)
    except OSError as exc:
        raise SecurityError(f"cannot write keys in {directory}: {exc.strerror or exc}") from None
    return public_path, secret_path


# --- sockets and authenticators -------------------------------------------------------------------

class _AllowList:
    """ZAP credentials provider: admits exactly the public keys it holds (Z85 bytes)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# id(context) -> (context, authenticator, allow-list). Holding the context keeps the id unique.
_AUTHENTICATORS: dict[int, tuple[zmq.Context, Any, _AllowList]] = {}


def _start(ctx: zmq.Context, auth: Any, keys: frozenset[bytes]) -> Any:
    if id(ctx) in _AUTHENTICATORS:
        raise SecurityError("an authenticator already runs in this context; stop_authenticator(ctx) first")
    allow = _AllowList(keys)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=allow)
    _AUTHENTICATORS[id(ctx)] = (ctx, auth, allow)
    return auth


def start_authenticator(ctx: zmq.Context, allowed_keys: frozenset[bytes]) -> ThreadAuthenticator:
    """Start a ZAP thread in `ctx` admitting only `allowed_keys`, for sync sockets."""
    return _start(ctx, ThreadAuthenticator(ctx), allowed_keys)


def start_async_authenticator(ctx: zmq.asyncio.Context, allowed_keys: frozenset[bytes]) -> AsyncioAuthenticator:
    """Start a ZAP task in `ctx` admitting only `allowed_keys`. Call it from inside the running loop."""
    return _start(ctx, AsyncioAuthenticator(ctx), allowed_keys)


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the authenticator of `ctx`, if any. CURVE servers in `ctx` then admit nobody new."""
    entry = _AUTHENTICATORS.pop(id(ctx), None)
    if entry is not None:
        entry[1].stop()


def _set_allowed(ctx: zmq.Context, keys: frozenset[bytes]) -> None:
    entry = _AUTHENTICATORS.get(id(ctx))
    if entry is not None:
        entry[2].keys = keys


def configure_curve_server(sock: zmq.Socket, public_key: bytes, secret_key: bytes) -> None:
    """Make `sock` a CURVE server with this key pair. Call before bind/connect."""
    if id(sock.context) not in _AUTHENTICATORS:
        raise SecurityError(
            "no authenticator runs in this socket's context, so CURVE would admit any client; "
            "call start_authenticator(ctx, keys) (or start_async_authenticator) first")
    sock.curve_secretkey = _check_z85_key(secret_key, "the server secret key")
    sock.curve_publickey = _check_z85_key(public_key, "the server public key")
    sock.curve_server = True


def configure_curve_client(sock: zmq.Socket, public_key: bytes, secret_key: bytes, server_public_key: bytes) -> None:
    """Make `sock` a CURVE client with this key pair, accepting only the server holding
    `server_public_key`. Call before connect."""
    sock.curve_secretkey = _check_z85_key(secret_key, "the client secret key")
    sock.curve_publickey = _check_z85_key(public_key, "the client public key")
    sock.curve_serverkey = _check_z85_key(server_public_key, "the server public key")


# --- one process's security ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class SecurityConfig:
    """How a process secures its sockets.

    mode: "curve" (default) or "plaintext" (local development only: no authentication at all).
    secret_key_file: this daemon's `NAME.key_secret`; required for "curve".
    allowed_keys_dir: directory of the `.key` files of everyone admitted; required for "curve".
    trusted_network: tensor streams skip CURVE (the network between workers is private); control
        sockets still use it.
    """

    mode: Literal["curve", "plaintext"] = "curve"
    secret_key_file: str | None = None
    allowed_keys_dir: str | None = None
    trusted_network: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SecurityError(f"security mode {self.mode!r} is not one of {MODES}")
        if not isinstance(self.trusted_network, bool):
            raise SecurityError("trusted_network must be true or false")
        if self.mode == "curve" and not (self.secret_key_file and self.allowed_keys_dir):
            raise SecurityError(
                "CURVE security needs secret_key_file and allowed_keys_dir; "
                f"{_HOW_TO_MAKE}, or ask for mode='plaintext' explicitly on a development machine")

    def to_env(self) -> dict[str, str]:
        """Environment variables that `from_env` reads back (to hand the config to a worker)."""
        env = {_ENV["mode"]: self.mode, _ENV["trusted_network"]: "1" if self.trusted_network else "0"}
        if self.secret_key_file:
            env[_ENV["secret_key_file"]] = self.secret_key_file
        if self.allowed_keys_dir:
            env[_ENV["allowed_keys_dir"]] = self.allowed_keys_dir
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SecurityConfig:
        """The config `to_env` wrote. Without VARUNA_SECURITY the mode is "curve", never plaintext."""
        trusted = env.get(_ENV["trusted_network"], "0")
        if trusted not in ("0", "1"):
            raise SecurityError(f"{_ENV['trusted_network']} must be 0 or 1, got {trusted!r}")
        return cls(mode=env.get(_ENV["mode"], "curve"),  # type: ignore[arg-type]
                   secret_key_file=env.get(_ENV["secret_key_file"]) or None,
                   allowed_keys_dir=env.get(_ENV["allowed_keys_dir"]) or None,
                   trusted_network=trusted == "1")


class Security:
    """The keys of one process and the authenticators of its ZeroMQ contexts.

    Servers: `apply_control_server(sock)` / `apply_stream_server(sock)` before bind; they start the
    context's authenticator on first use (a thread for sync sockets, a task for asyncio sockets, so
    call them from inside the loop there). Clients: `apply_control_client(sock, server_key)`, or
    `apply_stream_client(sock, endpoint)` for an endpoint registered with `add_peer` (a daemon's
    worker's key is `member_public_key(member)`). `close()` stops the authenticators.
    """

    def __init__(self, config: SecurityConfig, *, peers: Mapping[str, bytes | str] | None = None) -> None:
        self.config = config
        self.public_key: bytes | None = None
        self._secret_key: bytes | None = None
        self._allowed: frozenset[bytes] = frozenset()
        self._contexts: list[zmq.Context] = []
        self._peers: dict[str, bytes] = {}
        if config.mode == "curve":
            self.public_key, self._secret_key = load_key_pair(config.secret_key_file)  # type: ignore[arg-type]
            self._allowed = load_allowed_keys(config.allowed_keys_dir)  # type: ignore[arg-type]
        for endpoint, key in (peers or {}).items():
            self.add_peer(endpoint, key)

    @property
    def curve_control(self) -> bool:
        return self.config.mode == "curve"

    @property
    def curve_streams(self) -> bool:
        return self.config.mode == "curve" and not self.config.trusted_network

    # servers
    def apply_control_server(self, sock: zmq.Socket) -> None:
        if self.curve_control:
            self._serve(sock)

    def apply_stream_server(self, sock: zmq.Socket) -> None:
        if self.curve_streams:
            self._serve(sock)

    def _serve(self, sock: zmq.Socket) -> None:
        ctx = sock.context
        if id(ctx) not in _AUTHENTICATORS:
            if isinstance(sock, zmq.asyncio.Socket):
                start_async_authenticator(ctx, self._allowed)
            else:
                start_authenticator(ctx, self._allowed)
            self._contexts.append(ctx)
        configure_curve_server(sock, self.public_key, self._secret_key)  # type: ignore[arg-type]

    # clients
    def apply_control_client(self, sock: zmq.Socket, server_public_key: bytes | str) -> None:
        if self.curve_control:
            configure_curve_client(sock, self.public_key, self._secret_key, server_public_key)  # type: ignore[arg-type]

    def apply_stream_client(self, sock: zmq.Socket, endpoint: str) -> None:
        if not self.curve_streams:
            return
        key = self._peers.get(endpoint)
        if key is None:
            raise SecurityError(
                f"no server key known for stream endpoint {endpoint}; register it with add_peer(endpoint, key)")
        configure_curve_client(sock, self.public_key, self._secret_key, key)  # type: ignore[arg-type]

    def add_peer(self, endpoint: str, server_public_key: bytes | str) -> None:
        """Expect the stream server at `endpoint` to hold the secret of `server_public_key`."""
        self._peers[endpoint] = _check_z85_key(server_public_key, f"the server key of {endpoint}")

    def member_public_key(self, member: str) -> bytes:
        """The public key of daemon `member`: the file `<allowed_keys_dir>/<member>.key`."""
        if not self.config.allowed_keys_dir or not _NAME_RE.fullmatch(member):
            raise SecurityError(f"no key file can be named after member {member!r}")
        return load_public_key(Path(self.config.allowed_keys_dir) / f"{member}.key")

    def reload_allowed_keys(self) -> None:
        """Re-read the allow-list directory; new connections are checked against the new set."""
        if self.curve_control:
            self._allowed = load_allowed_keys(self.config.allowed_keys_dir)  # type: ignore[arg-type]
            for ctx in self._contexts:
                _set_allowed(ctx, self._allowed)

    def close(self) -> None:
        for ctx in self._contexts:
            stop_authenticator(ctx)
        self._contexts.clear()

    def __enter__(self) -> Security:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
