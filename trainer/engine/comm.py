"""Activations and gradients between neighbour stages, over ZeroMQ with protocol/ tensor frames.

Each worker binds one PULL socket at its own endpoint and connects a PUSH socket to each
neighbour, and to each worker it exchanges step statistics with (`stats_peers`; one socket per
endpoint, shared with the neighbour's when it is the same worker). Sends return at once
(ZeroMQ's I/O thread moves the bytes, so compute never waits for the network); receives block
until the wanted micro-batch arrives, keeping frames that arrive early (a neighbour already in
the next step) in per-key FIFOs. A frame of another job or epoch is dropped and logged: after
a morph, stragglers of the old plan cannot leak in.

A receive is a blocking ZeroMQ recv with a receive timeout (RCVTIMEO, at most `_WAKE_MS`, so the
peer timeout is checked that often): no poller is built per message. At each such wake it also
looks at its sockets' monitors: ZeroMQ reconnects silently, so a neighbour whose process died
(its connection reset) would otherwise be waited for until the peer timeout; a dropped
connection to a worker this one waits on ends the wait at once with a WorkerError.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Mapping

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.errors import ProtocolError
from protocol.frames import recv_tensor, send_tensor
from trainer.engine.zmq_exit import terminate
from trainer.errors import WorkerError

__all__ = ["PeerChannel"]

log = logging.getLogger("varuna.comm")

_DEFAULT_TIMEOUT_S = float(os.environ.get("VARUNA_PEER_TIMEOUT", "600"))
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
_WAKE_MS = 250    # longest single blocking recv: how often the peer timeout and connections are checked
# A peer that sends its last message and closes (a step's statistics, then the end of its loop)
# drops the connection this worker sends on while that message may still be on its way over the
# one this worker receives on: a broken connection counts once this long has passed without the
# awaited message, and not before.
_BROKEN_GRACE_S = 0.1
# What a closing worker still owes is a step's statistics (a few bytes); a peer that is gone would
# hold the close this long.
_CLOSE_LINGER_MS = 500


class PeerChannel:
    def __init__(self, *, bind: str, prev: str | None, nxt: str | None, job: str, epoch: int, stage: int,
                 timeout_s: float = _DEFAULT_TIMEOUT_S, security=None, rank: int = 0,
                 stats_peers: Mapping[int, str] | None = None) -> None:
        self.job, self.epoch, self.stage, self.rank = job, epoch, stage, rank
        self.timeout_s = timeout_s
        # a context of its own, terminated at close (trainer.engine.zmq_exit): a step's last
        # statistics reach the children of a worker that exits right after
        self._ctx = zmq.Context()
        self._security = security
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._wake_ms = max(1, min(_WAKE_MS, math.ceil(timeout_s * 1000)))
        self._rcvtimeo = self._wake_ms
        self._pull.setsockopt(zmq.RCVTIMEO, self._rcvtimeo)
        if security is not None:
            security.apply_stream_server(self._pull)
        self._pull.bind(bind)
        self._by_endpoint: dict[str, zmq.Socket] = {}
        # one monitor per connection: a disconnect means the worker at that endpoint is gone
        self._monitors: dict[str, zmq.Socket] = {}
        self._push: dict[str, zmq.Socket] = {}
        for direction, endpoint in (("act", nxt), ("grad", prev)):
            if endpoint is not None:
                self._push[direction] = self._connect(endpoint)
        self._stats_to = {r: self._connect(ep) for r, ep in (stats_peers or {}).items()}
        self._connected: set[str] = set()   # endpoints whose handshake succeeded
        self._broken: tuple[str, float] | None = None   # (endpoint, when) of the first connection that dropped
        self._early: dict[tuple[str, int], deque] = defaultdict(deque)
        self.wait_s = 0.0   # time spent blocked in recv, for the busy fraction

    def _connect(self, endpoint: str) -> zmq.Socket:
        sock = self._by_endpoint.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)   # its linger is set at close
            if self._security is not None:
                self._security.apply_stream_client(sock, endpoint)
            # watched before it connects: a peer already listening completes the handshake at
            # once, and a monitor attached after it would never see the connection up (nor down)
            self._monitors[endpoint] = sock.get_monitor_socket(_WATCHED)
            sock.connect(endpoint)
            self._by_endpoint[endpoint] = sock
        return sock

    def send_stats(self, to_rank: int, tensor: torch.Tensor) -> None:
        """Step statistics to `to_rank` (one of `stats_peers`); frames carry the sender's rank."""
        send_tensor(self._stats_to[to_rank], tensor, job=self.job, epoch=self.epoch, stage=self.stage,
                    micro_batch=self.rank, direction="stats")

    def recv_stats(self, from_rank: int) -> torch.Tensor:
        return self.recv("stats", from_rank)

    def send(self, direction: str, micro_batch: int, tensor: torch.Tensor) -> None:
        send_tensor(self._push[direction], tensor, job=self.job, epoch=self.epoch,
                    stage=self.stage, micro_batch=micro_batch, direction=direction)

    def recv(self, direction: str, micro_batch: int) -> torch.Tensor:
        key = (direction, micro_batch)
        early = self._early.get(key)
        if early:
            return early.popleft()
        start = time.perf_counter()
        deadline = start + self.timeout_s
        try:
            while True:
                try:
                    got = self._accept()
                except zmq.Again:   # nothing within RCVTIMEO
                    self._wait_less(deadline - time.perf_counter(), direction, micro_batch)
                    continue
                if got is None:   # dropped; a flood of those must not outlast the timeout either
                    self._wait_less(deadline - time.perf_counter(), direction, micro_batch)
                    continue
                if got[0] == key:
                    return got[1]
                self._early[got[0]].append(got[1])
        finally:
            self.wait_s += time.perf_counter() - start
            if self._rcvtimeo != self._wake_ms:
                self._rcvtimeo = self._wake_ms
                self._pull.setsockopt(zmq.RCVTIMEO, self._wake_ms)

    def _wait_less(self, remaining: float, direction: str, micro_batch: int) -> None:
        """Raise WorkerError once the peer timeout has passed or a peer's connection dropped;
        shorten the next wait to the timeout."""
        self._check_connections()
        wanted_ms = self._wake_ms
        if self._broken is not None:
            endpoint, since = self._broken
            left = _BROKEN_GRACE_S - (time.perf_counter() - since)
            if left <= 0:
                raise WorkerError(
                    f"stage {self.stage}: the connection to the worker at {endpoint} broke: it probably died",
                    hint="the daemon re-plans when a member is lost; locally, check the other workers' output")
            wanted_ms = max(1, math.ceil(left * 1000))
        if remaining <= 0:
            if direction == "stats":
                what = f"no step statistics from rank {micro_batch}"
            else:
                peer = self.stage - 1 if direction == "act" else self.stage + 1
                what = f"no {direction} for micro-batch {micro_batch} from stage {peer}"
            raise WorkerError(
                f"stage {self.stage} got {what} within {self.timeout_s:.0f}s: the peer probably died",
                hint="the daemon re-plans when a member is lost; locally, check the other workers' output",
            )
        wanted = max(1, min(wanted_ms, math.ceil(remaining * 1000)))
        if wanted != self._rcvtimeo:
            self._rcvtimeo = wanted
            self._pull.setsockopt(zmq.RCVTIMEO, wanted)

    def _check_connections(self) -> None:
        for endpoint, monitor in self._monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected.add(endpoint)
                elif event == zmq.EVENT_DISCONNECTED and endpoint in self._connected and self._broken is None:
                    self._broken = (endpoint, time.perf_counter())   # `_wait_less` decides, after a grace
                elif event & _HANDSHAKE_FAILED:
                    why = ("its keys do not allow this worker" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                           else "a protocol or security mismatch")
                    raise WorkerError(
                        f"stage {self.stage}: the worker at {endpoint} refused the stream handshake ({why})",
                        hint="every VM needs the fleet's public keys (varunactl keys); check VARUNA_SECURITY on both")

    def _accept(self) -> tuple[tuple[str, int], torch.Tensor] | None:
        try:
            header, tensor = recv_tensor(self._pull)
        except ProtocolError as exc:
            log.warning("stage %d dropped a malformed frame: %s", self.stage, exc)
            return None
        if header.job != self.job or header.epoch != self.epoch:
            log.info("stage %d dropped a frame of job %s epoch %d (now %s epoch %d)",
                     self.stage, header.job, header.epoch, self.job, self.epoch)
            return None
        # statistics come from any worker of the job, named by the rank in micro_batch
        expected_sender = {"act": self.stage - 1, "grad": self.stage + 1}.get(header.direction, header.stage)
        if header.stage != expected_sender:
            log.warning("stage %d dropped a %s frame from stage %d", self.stage, header.direction, header.stage)
            return None
        return (header.direction, header.micro_batch), tensor

    def close(self) -> None:
        for endpoint, sock in self._by_endpoint.items():
            sock.disable_monitor()
            self._monitors[endpoint].close(linger=0)
        for sock in self._by_endpoint.values():
            sock.close(linger=_CLOSE_LINGER_MS)
        self._pull.close(linger=0)
        if self._security is not None:
            self._security.close()
        terminate(self._ctx)   # waits for the closed sockets' queues, each within its linger
