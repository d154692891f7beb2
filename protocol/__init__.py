"""Every byte that crosses a process boundary in varunad: messages, tensor frames, CURVE security.

`protocol.messages` (control messages, msgpack), `protocol.frames` (tensors over ZeroMQ),
`protocol.security` (CURVE keys and socket setup), `protocol.errors` (one root: ProtocolError).

The frames names are loaded on first use: they need torch, and the daemon, which imports this
package for messages and security, must start without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from protocol.errors import MessageValueError, ProtocolError, SecurityError
from protocol.messages import (
    MAX_MESSAGE_SIZE,
    PROTOCOL_VERSION,
    CheckpointNow,
    Message,
    Ping,
    PlanChanged,
    Pong,
    StopWorkers,
    WorkerCheckpointed,
    WorkerFailed,
    WorkerProgress,
    WorkerRescuing,
    WorkerStoreOutage,
    decode,
    encode,
    message_types,
)
from protocol.security import Security, SecurityConfig, generate_key_pair, load_key_pair, load_public_key

_LAZY = {name: "protocol.frames" for name in ("DIRECTIONS", "TensorHeader", "recv_tensor", "send_tensor")}

__all__ = [
    "DIRECTIONS",
    "MAX_MESSAGE_SIZE",
    "PROTOCOL_VERSION",
    "CheckpointNow",
    "Message",
    "MessageValueError",
    "Ping",
    "PlanChanged",
    "Pong",
    "ProtocolError",
    "Security",
    "SecurityConfig",
    "SecurityError",
    "StopWorkers",
    "TensorHeader",
    "WorkerCheckpointed",
    "WorkerFailed",
    "WorkerProgress",
    "WorkerRescuing",
    "WorkerStoreOutage",
    "decode",
    "encode",
    "generate_key_pair",
    "load_key_pair",
    "load_public_key",
    "message_types",
    "recv_tensor",
    "send_tensor",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'protocol' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
