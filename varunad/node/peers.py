"""ZeroMQ between daemons: each daemon's control server, and the leader's clients to every daemon.

Wire: ``protocol.messages`` frames only. The server is a ROUTER (CURVE server unless the daemon
runs --plaintext) that yields decoded messages; anything that is not exactly one valid message
(garbage bytes, another protocol version, extra frames) is logged and dropped, and the daemon
carries on. The leader holds one DEALER per member (CURVE client expecting that member's public
key) to push plan-changed notices and stop requests, and to ping: a member that does not answer a Ping
within the timeout is left out of the next plan; one of a stopping epoch that does not answer
is remembered as silent (`SilentMembers`), so that a morph waits the ping timeout for it once, and
one whose host refuses a connection to its port is silent at once (`refused`: a process killed on a
host that stays, which breaks its peers' connections at the same moment).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from protocol.errors import ProtocolError, SecurityError
from protocol.messages import Message, Ping, Pong, decode, encode
from protocol.security import Security

if TYPE_CHECKING:
    from varunad.control.fleet import FleetSnapshot

__all__ = ["PeerServer", "PeerClients", "SilentMembers", "drop_reason", "refused"]

log = logging.getLogger(__name__)

_MAX_LOGGED = 20  # malformed messages logged per minute at most, so a flood cannot fill the disk


class _RateLimitedLog:
    def __init__(self) -> None:
        self._window = 0.0
        self._count = 0

    def warning(self, fmt: str, *args: object) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._window > 60:
            if self._count > _MAX_LOGGED:
                log.warning("... and %d more malformed messages dropped in the last minute", self._count - _MAX_LOGGED)
            self._window, self._count = now, 0
        self._count += 1
        if self._count <= _MAX_LOGGED:
            log.warning(fmt, *args)


def drop_reason(frames: list[bytes]) -> tuple[bytes, Message | None, str]:
    """(identity, message or None, why it was dropped) for a ROUTER's multipart."""
    if len(frames) != 2:
        return (frames[0] if frames else b""), None, f"{len(frames)} frames instead of [identity, message]"
    identity, data = frames
    try:
        return identity, decode(data), ""
    except ProtocolError as exc:
        return identity, None, str(exc)


class PeerServer:
    """The daemon's control socket. ``messages()`` yields (identity, message); Pings are answered here."""

    def __init__(self, ctx: zmq.asyncio.Context, security: Security, *, name: str, bind_host: str, port: int) -> None:
        self.name = name
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)  # libzmq drops the connection of bigger senders
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        security.apply_control_server(self.sock)
        if port:
            self.sock.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self._log = _RateLimitedLog()
        self.dropped = 0

    async def messages(self) -> AsyncIterator[tuple[bytes, Message]]:
        while True:
            frames = await self.sock.recv_multipart()
            identity, msg, why = drop_reason(frames)
            if msg is None:
                self.dropped += 1
                self._log.warning("%s: dropped a malformed control message: %s", self.name, why)
                continue
            if isinstance(msg, Ping):
                await self.reply(identity, Pong(sender=self.name, nonce=msg.nonce))
                continue
            yield identity, msg

    async def reply(self, identity: bytes, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self.sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(0)


class PeerClients:
    """The leader's DEALER sockets, one per (member, endpoint)."""

    def __init__(self, ctx: zmq.asyncio.Context, security: Security, *, name: str) -> None:
        self.ctx = ctx
        self.security = security
        self.name = name
        self._socks: dict[str, tuple[str, zmq.asyncio.Socket]] = {}

    def _sock(self, member: str, endpoint: str) -> zmq.asyncio.Socket | None:
        known = self._socks.get(member)
        if known is not None and known[0] == endpoint:
            return known[1]
        if known is not None:
            known[1].close(0)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100)
        try:
            if self.security.curve_control:
                self.security.apply_control_client(sock, self.security.member_public_key(member))
        except SecurityError as exc:
            log.warning("cannot reach %s securely: %s", member, exc)
            sock.close(0)
            return None
        sock.connect(endpoint)
        self._socks[member] = (endpoint, sock)
        return sock

    async def send(self, member: str, endpoint: str, msg: Message) -> bool:
        return await self.send_all([(member, endpoint)], msg) == 1

    async def send_all(self, members: Iterable[tuple[str, str]], msg: Message) -> int:
        """Queue ``msg`` for each (member, endpoint), encoded once; how many took it."""
        data, queued = encode(msg), 0
        for member, endpoint in members:
            sock = self._sock(member, endpoint)
            if sock is None:
                continue
            try:
                await sock.send(data, flags=zmq.NOBLOCK)
                queued += 1
            except zmq.Again:
                log.info("could not queue %s for %s (its queue is full)", type(msg).__name__, member)
        return queued

    async def ping(self, members: Iterable[tuple[str, str]], timeout: float, *,
                   refused_is_silent: bool = False) -> set[str]:
        """The members (name, endpoint) that answer a Ping within ``timeout`` seconds.
        ``refused_is_silent``: a member whose host refuses a TCP connection to its endpoint is
        counted silent at once instead of after the timeout (`refused`)."""
        async def one(member: str, endpoint: str) -> str | None:
            sock = self._sock(member, endpoint)
            if sock is None:
                return None
            nonce = secrets.randbits(63)
            try:
                await sock.send(encode(Ping(sender=self.name, nonce=nonce)), flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (left := deadline - loop.time()) > 0:
                if not await sock.poll(left * 1000, zmq.POLLIN):
                    break
                try:
                    msg = decode(await sock.recv())
                except ProtocolError as exc:
                    log.warning("%s answered a ping with a malformed message: %s", member, exc)
                    continue
                if isinstance(msg, Pong) and msg.nonce == nonce:
                    return member
            return None

        async def either(member: str, endpoint: str) -> str | None:
            answer = asyncio.ensure_future(one(member, endpoint))
            probe = asyncio.ensure_future(refused(endpoint, timeout))
            try:
                done, _ = await asyncio.wait({answer, probe}, return_when=asyncio.FIRST_COMPLETED)
                if answer in done or not probe.result():
                    return await answer
                log.info("%s: nothing listens on %s any more (connection refused): not waiting for its ping",
                         member, endpoint)
                return None
            finally:
                for task in (answer, probe):
                    task.cancel()

        found = await asyncio.gather(*((either if refused_is_silent else one)(m, e) for m, e in members))
        return {m for m in found if m is not None}

    def close(self) -> None:
        for _, sock in self._socks.values():
            sock.close(0)
        self._socks.clear()


async def refused(endpoint: str, timeout: float) -> bool:
    """Whether the host of ``endpoint`` ("tcp://host:port") refuses a TCP connection to it within
    ``timeout``: it runs, and no socket listens on the port, so the daemon that did is gone.

    Why this never takes a busy daemon for a lost one: the kernel completes a connection to a
    listening socket by itself (the accept queue), whatever the process is doing, so a daemon that
    is alive, however starved of CPU or stopped, is never refused; with its accept queue full,
    Linux drops the handshake rather than refusing it (unless net.ipv4.tcp_abort_on_overflow is
    set), which this reads as no answer. A host that does not answer at all (a VM that vanished,
    a cut link) is not refused either: that one is left to the ping's timeout."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class SilentMembers:
    """The leader's pings, remembering who stayed silent.

    member -> (lease, when) of a member of a stopping epoch that did not answer a ping while
    its lease still stood: a vanished VM. Not pinged again in the same morph, so each of its
    phases does not wait the ping timeout for it once more; forgotten once the morph's plan
    is written (`clear`), or when the member registers again (a new lease).

    A member that answered under its lease within ``FRESH_S`` is not pinged again either: a
    morph's phases (the stop, who was lost, the candidates of the plan) follow each other within
    a second, and at 300 VMs each round of pings was a tenth of a second of the leader's
    (benchmarks/fleet_scale.py). A member that vanishes inside that second breaks the new epoch
    as one that vanishes just after the plan would."""

    FRESH_S = 1.0

    def __init__(self, clients: PeerClients, *, ttl: float) -> None:
        self.clients = clients
        self.ttl = ttl
        self._silent: dict[str, tuple[int, float]] = {}
        self._answered: dict[str, tuple[int, float]] = {}   # member -> (lease, monotonic time of its answer)

    def clear(self) -> None:
        self._silent.clear()
        self._answered.clear()

    def _ping_timeout(self) -> float:
        return max(0.5, min(2.0, self.ttl / 4))

    def _mark_silent(self, snap: FleetSnapshot, names: set[str]) -> None:
        now = time.time()
        for m in names:
            if m in snap.members:
                self._silent[m] = (snap.members[m][1], now)

    def known_silent(self, snap: FleetSnapshot, name: str) -> bool:
        """Whether `name` went silent under the lease it still holds (within two TTLs)."""
        seen = self._silent.get(name)
        if seen is None or name not in snap.members:
            return False
        lease, when = seen
        if snap.members[name][1] != lease or time.time() - when > 2 * self.ttl:
            del self._silent[name]
            return False
        return True

    def _answered_lately(self, snap: FleetSnapshot, name: str) -> bool:
        """Whether `name` answered a ping within FRESH_S, under the lease it still holds."""
        seen = self._answered.get(name)
        return (seen is not None and name in snap.members and snap.members[name][1] == seen[0]
                and time.monotonic() - seen[1] <= self.FRESH_S)

    async def answering(self, snap: FleetSnapshot, names, *, mark: bool, again: bool = False) -> set[str]:
        """The members of `names` that answer a ping, not waiting again for one known silent in
        this morph; `mark`: remember those that do not (a member of the stopped epoch: not one
        that may have just joined, whose socket may not answer yet); `again`: ping those that
        answered lately too (a stop's wait asks every second whether its members still live)."""
        known = set() if again else {m for m in names if self._answered_lately(snap, m)}
        ask = [(m, snap.members[m][0].endpoint) for m in names
               if m in snap.members and m not in known and not self.known_silent(snap, m)]
        answered = await self.clients.ping(ask, self._ping_timeout(), refused_is_silent=mark)
        if mark:
            self._mark_silent(snap, {m for m, _ in ask} - answered)
        now = time.monotonic()
        for m in answered:
            self._answered[m] = (snap.members[m][1], now)
        return answered | known
