"""Job signatures: a fleet runs only the code of people it trusts, not of whoever can write to etcd.

Whoever can write a job spec and bundle into etcd runs code on every VM. With ``--submit-keys DIR``
a daemon starts workers only for a job whose spec carries an Ed25519 signature by one of the
public keys in ``DIR`` (``*.sign_public``); the spec names the bundle's SHA-256, so the signature
covers the code too. ``varunactl keys submit-key`` makes a key pair and ``varunactl submit
--sign-key FILE`` signs (the signature is written to ``signatures/<job>`` before the spec, so the
leader never sees an unsigned moment). A job that is unsigned, signed by a key not in the
allow-list, or whose spec or bundle changed after signing is refused with the reason, before
any worker starts.

Ed25519 through ``cryptography`` (pyzmq's libsodium exposes no signing; see pyproject.toml).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from varunad.store import schemas

__all__ = ["SigningError", "Signature", "generate_submit_key", "load_signing_key", "sign_spec", "AllowList"]

_NAME_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
SECRET_SUFFIX, PUBLIC_SUFFIX = ".sign_secret", ".sign_public"


class SigningError(ValueError):
    """A key that cannot be used, or a job whose signature does not hold (with what to do)."""


def _ed25519():
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - a dependency; only a broken install lacks it
        raise SigningError("job signatures need the 'cryptography' package (pip install cryptography)") from exc
    return ed25519


@dataclass(frozen=True, slots=True)
class Signature:
    """The value of ``signatures/<job>``: who signed and the signature of the spec's exact bytes."""

    key: str
    signature: str  # hex

    def encode(self) -> bytes:
        return json.dumps({"key": self.key, "signature": self.signature}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Signature:
        try:
            doc = schemas.load_json(data)
            if not (isinstance(doc, dict) and isinstance(doc.get("key"), str) and isinstance(doc.get("signature"), str)):
                raise ValueError("not {key, signature}")
            bytes.fromhex(doc["signature"])
        except ValueError as exc:
            raise SigningError(f"the job's signature is malformed: {exc}") from None
        return cls(doc["key"], doc["signature"])


def generate_submit_key(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write DIR/NAME.sign_secret (0600) and DIR/NAME.sign_public; returns (secret, public)."""
    if not _NAME_RE.fullmatch(name):
        raise SigningError(f"key name {name!r} must be 1..128 letters, digits or . _ - : @")
    ed25519 = _ed25519()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    secret_path, public_path = d / f"{name}{SECRET_SUFFIX}", d / f"{name}{PUBLIC_SUFFIX}"
    if not force and (secret_path.exists() or public_path.exists()):
        raise SigningError(f"{secret_path} exists already; pass --force to replace it")
    key = ed25519.Ed25519PrivateKey.generate()
    from cryptography.hazmat.primitives import serialization as s

    raw = key.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption())
    pub = key.public_key().public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{name} {raw.hex()}\n")
    public_path.write_text(f"{name} {pub.hex()}\n")
    return secret_path, public_path


def _read_key_file(path: str | os.PathLike[str], what: str) -> tuple[str, bytes]:
    try:
        text = Path(path).read_text().split()
    except OSError as exc:
        raise SigningError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    try:
        name, hexkey = text
        raw = bytes.fromhex(hexkey)
        if len(raw) != 32 or not _NAME_RE.fullmatch(name):
            raise ValueError
    except ValueError:
        raise SigningError(f"{path} is no {what} (make one with `varunactl keys submit-key`)") from None
    return name, raw


def load_signing_key(path: str | os.PathLike[str]):
    """(name, private key) from a NAME.sign_secret file."""
    name, raw = _read_key_file(path, "submit key")
    return name, _ed25519().Ed25519PrivateKey.from_private_bytes(raw)


def sign_spec(path: str | os.PathLike[str], spec_bytes: bytes) -> Signature:
    name, key = load_signing_key(path)
    return Signature(name, key.sign(spec_bytes).hex())


class AllowList:
    """The public submit keys a daemon trusts: every ``*.sign_public`` file in a directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        ed25519 = _ed25519()
        self.keys = {}
        try:
            files = sorted(self.directory.glob(f"*{PUBLIC_SUFFIX}"))
        except OSError as exc:
            raise SigningError(f"cannot read --submit-keys {directory}: {exc}") from None
        for f in files:
            name, raw = _read_key_file(f, "public submit key")
            self.keys[name] = ed25519.Ed25519PublicKey.from_public_bytes(raw)
        if not self.keys:
            raise SigningError(f"--submit-keys {directory} holds no *{PUBLIC_SUFFIX} file",
                               ) from None

    def verify(self, job: str, spec_bytes: bytes, signature: bytes | None) -> str:
        """The signer's name, or SigningError saying why job ``job`` may not run here."""
        if signature is None:
            raise SigningError(f"job {job} is not signed, and this fleet runs only jobs signed by a key in "
                               f"{self.directory} (submit it with `varunactl submit --sign-key FILE`)")
        sig = Signature.decode(signature)
        key = self.keys.get(sig.key)
        if key is None:
            raise SigningError(f"job {job} is signed by {sig.key!r}, which is not in this fleet's allow-list "
                               f"{self.directory} ({', '.join(sorted(self.keys))})")
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(bytes.fromhex(sig.signature), spec_bytes)
        except InvalidSignature:
            raise SigningError(f"job {job}'s signature by {sig.key!r} does not match its spec: the spec or its "
                               "bundle was changed after it was signed") from None
        return sig.key
