"""The leader's pings of a stopping epoch's members (varunad.node.peers): a member whose port is
refused is silent at once; one that is alive but does not answer (busy, stopped) is judged only by
the ping's timeout. In-process sockets on loopback: a listening socket that never accepts stands
for a daemon starved of CPU or stopped (SIGSTOP), whose kernel still completes connections."""

from __future__ import annotations

import asyncio
import socket
import time

import zmq.asyncio

from protocol.security import Security, SecurityConfig
from varunad.node.peers import PeerClients, PeerServer, refused


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    return port


def _listening_never_accepting() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)   # the kernel completes handshakes; nobody ever calls accept()
    return s


def test_refused_only_where_nothing_listens():
    busy = _listening_never_accepting()
    try:
        assert asyncio.run(refused(f"tcp://127.0.0.1:{_closed_port()}", 5.0))
        assert not asyncio.run(refused(f"tcp://127.0.0.1:{busy.getsockname()[1]}", 5.0))
        assert not asyncio.run(refused("tcp://not a host:x", 1.0))   # unparseable: never "refused"
    finally:
        busy.close()


def test_a_refused_member_is_silent_without_the_timeout_and_a_busy_one_waits_it():
    async def main():
        ctx = zmq.asyncio.Context()
        security = Security(SecurityConfig(mode="plaintext"))
        server = PeerServer(ctx, security, name="alive", bind_host="127.0.0.1", port=0)
        busy = _listening_never_accepting()
        clients = PeerClients(ctx, security, name="leader")
        try:
            async def serve():
                async for _ in server.messages():
                    pass
            serving = asyncio.ensure_future(serve())
            members = [("alive", f"tcp://127.0.0.1:{server.port}"), ("gone", f"tcp://127.0.0.1:{_closed_port()}")]
            started = time.monotonic()
            answered = await clients.ping(members, 60.0, refused_is_silent=True)
            took = time.monotonic() - started
            assert answered == {"alive"}
            assert took < 30, f"waited {took:.1f}s of the 60 s timeout for a member whose port is refused"
            # alive but not answering: not refused, so only the timeout says it is silent
            started = time.monotonic()
            answered = await clients.ping([("busy", f"tcp://127.0.0.1:{busy.getsockname()[1]}")], 1.0,
                                          refused_is_silent=True)
            assert answered == set() and time.monotonic() - started >= 0.95
            serving.cancel()
        finally:
            clients.close()
            server.close()
            busy.close()
            security.close()
            ctx.term()

    asyncio.run(main())


class _CountingClients:
    """PeerClients' ping, answered by the members named in `alive`, recording who was asked."""

    def __init__(self, alive: set[str]) -> None:
        self.alive, self.asked = alive, []

    async def ping(self, members, timeout, *, refused_is_silent=False):
        names = [m for m, _ in members]
        self.asked.append(sorted(names))
        return {m for m in names if m in self.alive}


def _snap(leases: dict[str, int]):
    from types import SimpleNamespace
    return SimpleNamespace(members={m: (SimpleNamespace(endpoint=f"tcp://127.0.0.1:{i + 1}"), lease)
                                    for i, (m, lease) in enumerate(leases.items())})


def test_a_morphs_phases_do_not_ping_again_a_member_that_just_answered():
    from varunad.node.peers import SilentMembers

    async def main():
        clients = _CountingClients({"a", "b"})
        silent = SilentMembers(clients, ttl=10.0)
        snap = _snap({"a": 1, "b": 2, "c": 3})
        # the stop's wait asks everyone, even those that answered lately
        assert await silent.answering(snap, ["a", "b", "c"], mark=True, again=True) == {"a", "b"}
        assert await silent.answering(snap, ["a", "b", "c"], mark=True, again=True) == {"a", "b"}
        assert clients.asked == [["a", "b", "c"], ["a", "b"]]   # c is known silent in this morph
        # the next phases take a's and b's answers as they are
        assert await silent.answering(snap, ["a", "b", "c"], mark=False) == {"a", "b"}
        assert clients.asked[2:] == [[]]
        # a member that registered again (a new lease) is asked again, and so is everyone once it is stale
        assert await silent.answering(_snap({"a": 1, "b": 7, "c": 3}), ["a", "b"], mark=False) == {"a", "b"}
        assert clients.asked[3] == ["b"]
        silent._answered["a"] = (1, time.monotonic() - 2 * SilentMembers.FRESH_S)
        await silent.answering(snap, ["a"], mark=False)
        assert clients.asked[4] == ["a"]
        # a written plan ends the morph: its answers are forgotten
        silent.clear()
        await silent.answering(snap, ["a", "b", "c"], mark=False)
        assert clients.asked[5] == ["a", "b", "c"]

    asyncio.run(main())
