"""The errors `protocol/` raises. One root, `ProtocolError`, so callers can catch every wire fault at once.

- `ProtocolError`: bytes from a peer (or a socket) that cannot be trusted: malformed, truncated,
  oversized, wrong version, unknown type, out-of-range value. `decode` and `recv_tensor` raise
  nothing else for bad input.
- `MessageValueError`: a message or header built locally with bad values. It is also a `ValueError`,
  because that is what it is to the code that built it.
- `SecurityError`: a key file or security setting that cannot be used; the text says which file and
  how to make one (`varunactl keys generate`).
"""

from __future__ import annotations

__all__ = ["MessageValueError", "ProtocolError", "SecurityError"]


class ProtocolError(Exception):
    """Bytes on the wire that varunad refuses; `reason` says what was wrong, in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MessageValueError(ProtocolError, ValueError):
    """A message, header or value object given a value outside its contract."""


class SecurityError(ProtocolError, ValueError):
    """Keys or security settings that cannot be used (missing, unreadable, malformed, contradictory).
    A ValueError too: it is raised by the SecurityConfig value object for bad settings."""
