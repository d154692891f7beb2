"""Where a daemon and its workers talk: a Unix socket in a private directory, secret identities.

The control socket carries progress (which becomes the job's step, loss and history) and the
daemon's stop and checkpoint requests. Over TCP on 127.0.0.1 any local process could connect,
report a step 10000 with loss 123.456, or take over ``rank-N`` with ROUTER_HANDOVER. Here:

* the socket is ``ipc://<dir>/control`` where ``<dir>`` is made by ``mkdtemp`` (mode 0700, owned
  by the daemon's user) in its state directory, so other users cannot even reach it;
* each worker gets a fresh random token in its environment (``VARUNA_CONTROL_TOKEN``, readable
  only by its own user) and uses ``rank-<r>-<token>`` as its ZeroMQ identity; the daemon's end
  (``WorkerLine``) takes a report only from the identity of the current epoch's worker of that rank.

``WorkerLine`` is the daemon's end of the line: it drops what a worker may not say (counted and
logged, throttled), keeps a request it could not send for the worker's next message, and repeats
a stop until the worker exits; what a report means is the supervisor's (``varunad.node.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.asyncio

from protocol.errors import ProtocolError
from protocol.messages import WorkerCheckpointed, WorkerProgress, WorkerRescuing, WorkerStoreOutage, decode, encode
from trainer.engine.control import TOKEN_ENV, control_identity
from varunad.node.metrics import DaemonMetrics

__all__ = ["ControlChannel", "WorkerLine", "TOKEN_ENV", "control_identity", "new_token"]

log = logging.getLogger("varunad.node.supervisor")   # the supervisor's log: its lines keep their logger name


def new_token() -> str:
    return secrets.token_hex(16)


_PREFIX = "varunad-ctl-"
_MAX_PATH = 100  # a Unix socket path holds at most 107 bytes


class ControlChannel:
    """A private directory for one daemon's control socket; ``close()`` removes it.

    Under ``parent`` (the daemon's state dir) when the socket path fits there, so that a daemon
    killed with -9 leaves nothing elsewhere (and the next start removes what it left); else under
    the temp dir."""

    def __init__(self, parent: str | os.PathLike[str] | None = None) -> None:
        if parent is not None:
            for old in Path(parent).glob(f"{_PREFIX}*"):  # left by an earlier incarnation killed with -9
                shutil.rmtree(old, ignore_errors=True)
            if len(os.path.join(os.fspath(parent), _PREFIX + "x" * 8, "control")) > _MAX_PATH:
                parent = None
        # mkdtemp: 0700 and owned by us, atomically (no window in which another user could enter
        # or pre-create it).
        self.directory = tempfile.mkdtemp(prefix=_PREFIX, dir=parent)
        st = os.stat(self.directory)
        if stat.S_IMODE(st.st_mode) != 0o700 or st.st_uid != os.getuid():
            raise OSError(f"{self.directory} is not a private directory (mode {stat.S_IMODE(st.st_mode):o})")
        self.path = os.path.join(self.directory, "control")
        self.endpoint = f"ipc://{self.path}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)


class _LineEnd(Protocol):
    """What the line keeps of each worker (``varunad.node.supervisor._SupervisedWorker`` is one)."""

    job: str
    epoch: int
    rank: int
    connected: bool
    pending: list[bytes]
    stop_request: bytes | None

    @property
    def identity(self) -> bytes: ...

    @property
    def alive(self) -> bool: ...


class WorkerLine:
    """The daemon's ROUTER on its private control socket, and what it sends and hears there."""

    def __init__(self, ctx: zmq.asyncio.Context, state_dir: str, *, name: str, metrics: DaemonMetrics) -> None:
        self.name = name
        self.metrics = metrics
        # Private to this daemon and its workers: a Unix socket in a directory only this user may
        # enter (no TCP port any local process could reach), and each worker names itself by a
        # secret drawn for it alone (ControlChannel); there is no ROUTER_HANDOVER, so nobody can
        # take over a connected worker's identity either.
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.channel = ControlChannel(state_dir)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        self.sock.bind(self.channel.endpoint)
        self.endpoint = self.channel.endpoint
        self.dropped = 0

    def deliver(self, w: _LineEnd, msg: Any) -> None:
        data = msg if isinstance(msg, bytes) else encode(msg)
        if not w.connected:
            w.pending.append(data)  # sent when the worker first speaks (after its first step)
            return
        self._send(w, data)

    def _send(self, w: _LineEnd, data: bytes) -> None:
        # An asyncio socket reports a failed send in the returned future, never by raising here
        # (an `except zmq.ZMQError` around it never fired): look at the future, and keep a message
        # that could not go for the worker's next message.
        try:
            fut = self.sock.send_multipart([w.identity, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self._undelivered(w, data)
            return

        def sent(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                self._undelivered(w, data)

        fut.add_done_callback(sent)

    def _undelivered(self, w: _LineEnd, data: bytes) -> None:
        if w.alive and data not in w.pending:
            log.debug("%s: a request to rank %d was not delivered; sending it with the next reply", self.name, w.rank)
            w.connected = False
            w.pending.append(data)

    async def serve(self, worker: Callable[[int], _LineEnd | None], heard: Callable[[Any, Any], None]) -> None:
        """Hear the workers: ``heard(w, msg)`` for each message of the current epoch's worker
        ``worker(rank)`` under its own identity, after sending it what waited for it."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self._drop(f"{len(frames)} frames instead of [identity, message]")
                continue
            identity, data = frames
            try:
                msg = decode(data)
            except ProtocolError as exc:
                self._drop(str(exc))
                continue
            if not isinstance(msg, (WorkerProgress, WorkerCheckpointed, WorkerRescuing, WorkerStoreOutage)):
                self._drop(f"unexpected {type(msg).__name__} from a worker")
                continue
            w = worker(msg.rank)
            if w is None or not w.alive or w.job != msg.job or w.epoch != msg.epoch or identity != w.identity:
                # Only the current epoch's worker of that rank knows its identity: anything else is
                # a stale worker or a forgery, and must not move the job's progress or history.
                self._drop(f"{type(msg).__name__} for {msg.job} epoch {msg.epoch} rank {msg.rank} not from "
                           "that rank's current worker")
                continue
            if not w.connected:
                w.connected = True
                pending, w.pending = w.pending, []
                for item in pending:
                    self._send(w, item)
            elif w.stop_request is not None:
                self._send(w, w.stop_request)  # idempotent; confirmed only by the worker's exit
            heard(w, msg)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        self.metrics.dropped_messages.inc()
        if self.dropped <= 20 or self.dropped % 1000 == 0:
            log.warning("%s: dropped a malformed message on the worker socket (%d so far): %s",
                        self.name, self.dropped, why)

    def close(self) -> None:
        self.sock.close(0)
        self.channel.close()
