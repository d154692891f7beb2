"""The links between VMs, measured: the leader has pairs of idle members probe each other.

A calibration measures one VM (its compute, its loopback); the network between VMs is the
fleet's own, and a plan that assumes loopback speed is wrong by the cap's ratio on a 10 Mbit/s
link. So:

* ``LinkSurvey`` (the leader) measures a sample of the pairs, ``sample_pairs``: the members with
  probe ports on a ring ordered by name, each paired with its successor and with one about
  halfway round. That is N to 1.5N pairs for N members (rounded up; 1 for 2 members), not
  N(N-1)/2: the 45,000 pairs of 300 VMs would never finish, and every member is still measured
  against at least one other, so a slow NIC on any member shows in some measurement. For each
  sampled pair on two hosts without a result for their current addresses (new members, an
  address that changed), both idle (no worker of a running plan on either, none alive in their
  reports: a probe never competes with a step), it writes a request to each side,
  ``links/probe/<member>``, guarded by its leadership and naming its term. Pairs that share no
  member (nor host) are probed at once, ``MAX_PARALLEL_PROBES`` at most: a probe measures a
  host's link, and two on one host would share it. A probe ends when its result is stored, when
  a side withdraws its request without one (it failed, or refused), or after ``PROBE_TIMEOUT``;
  the leader then deletes both requests, and a failed pair waits ``RETRY_AFTER`` before another
  try. It also deletes every request no probe of its own waits for (an earlier leader's, a
  timed-out one). A result stored for a pair the sample no longer asks for (the ring changed as
  members came and went) stays, and is used like any other.
* ``LinkProber`` (every daemon): follows its request key and runs one side of the probe,
  ``python -m trainer.linkprobe`` bound to its advertised address on the member's two *probe*
  ports (``DaemonMember.probe_ports``: never a worker's stream or rendezvous port, so a probe
  that fails or outlives its welcome cannot take a port a job's worker is about to bind), over
  ZeroMQ and gloo, the transports of training. Rank 0's daemon stores the result in
  ``links/pair/<a>/<b>`` (names sorted), with the addresses it was measured between. A stale
  request is deleted, not run: made for an earlier start of this daemon or for other ports, by a
  leader that no longer leads, or no longer in its key. A running probe is ended when its
  request is withdrawn or replaced, and when this daemon starts workers.
* Planning (``apply_links`` of ``measured``): the calibration's "inter" link and all-reduce
  cost become the slowest measured pair among the plan's candidates, both members among them
  (the pipeline runs at its slowest hop; the CPU overheads per message stay the calibration's).
  Every other pair between candidates, not sampled or its probe failed, is assumed as fast as
  that slowest measured one; when no pair between the candidates is measured, every link is the
  calibration's. So a candidate whose measured pairs all lead outside the candidates counts as
  no slower than the others: its own link is not seen in that plan. A job's first plan waits
  for the probes in flight among its candidates (``waiting``: bounded by the probes' end, a
  failure included, and as a whole by ``PROBE_TIMEOUT``, since the survey starts more meanwhile);
  a job that already ran (a morph, a restart) never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.planning.calibration import Calibration, LinkCost
from varunad.cluster.facts import PortReservation
from varunad.store import schemas
from varunad.store.contract import Store, StoreError
from varunad.store.keys import Keys

__all__ = ["LinkMeasurement", "LinkProber", "LinkSurvey", "MAX_PARALLEL_PROBES", "PROBE_TIMEOUT", "ProbeRequest",
           "apply_links", "read_links", "sample_pairs"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 90.0   # a probe starts two Python processes with torch: seconds on a busy host
RETRY_AFTER = 60.0
# probes of disjoint pairs in flight at once: a few, so a big fleet's survey ends in reasonable time
# while the leader still reads and writes a handful of keys per probe
MAX_PARALLEL_PROBES = 4


def sample_pairs(names: Iterable[str]) -> list[tuple[str, str]]:
    """The pairs the survey measures among `names`: on the ring of the names sorted, each with its
    successor and with one about halfway round; each pair once, names sorted within it.

    O(N) probes where every pair is N(N-1)/2 (45,000 at 300 VMs, which never finish), and every
    member is measured against at least one other, so a slow NIC on any member shows in some
    measurement. The chord halfway round measures each member against one far from it in name
    order (a fleet named by rack or zone is measured across them), and a member's second partner
    tells a slow link of its own from a slow neighbour's."""
    ring = sorted(set(names))
    n = len(ring)
    pairs = {(ring[i], ring[(i + 1) % n]) for i in range(n)}
    # i and i + n//2 for the first half (rounded up) only: every member once for odd n too, not twice
    pairs |= {(ring[i], ring[(i + n // 2) % n]) for i in range((n + 1) // 2)}
    return sorted({tuple(sorted(p)) for p in pairs if p[0] != p[1]})


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkMeasurement:
    """One pair's link, as measured; ``hosts`` are the addresses it was measured between."""

    members: tuple[str, str]
    hosts: tuple[str, str]
    # the members' start times: a restarted VM (it may have moved) is measured again
    started: tuple[float, float] = (0.0, 0.0)
    latency_s: float
    bandwidth_Bps: float
    allreduce_latency_s: float
    allreduce_Bps: float
    at: float = 0.0

    def __post_init__(self) -> None:
        _as_tuples(self, "members", "hosts", "started")
        if len(self.members) != 2 or self.members[0] == self.members[1]:
            raise ValueError(f"a link measurement is between two members, not {list(self.members)}")
        # a latency of -1 or a NaN bandwidth here made every plan fail in LinkCost: the leader
        # restarted its loop once a second and no job started again
        times = {"latency_s": self.latency_s, "allreduce_latency_s": self.allreduce_latency_s}
        rates = {"bandwidth_Bps": self.bandwidth_Bps, "allreduce_Bps": self.allreduce_Bps}
        if not all(math.isfinite(v) and v >= 0 for v in times.values()) or \
                not all(math.isfinite(v) and v > 0 for v in rates.values()):
            raise ValueError(f"a link measurement needs finite latencies >= 0 and bandwidths > 0: {times | rates}")

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LinkMeasurement:
        return schemas.decode(cls, data, "link measurement")


def _as_tuples(doc, *names: str) -> None:
    """JSON gives lists where the dataclass says tuples: hashable, and equal to what was written."""
    for name in names:
        object.__setattr__(doc, name, tuple(getattr(doc, name)))


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """One side's part of a probe, as the leader writes it to ``links/probe/<member>``.

    ``ports``: [rank 0's stream port, rank 1's stream port, rank 0's rendezvous port], all of
    them the members' probe ports; ``started``: the members' start times the leader saw (a
    request for an earlier start of a daemon is stale); ``term``: the leader's term (the leader
    key's create revision) when it asked."""

    id: str
    rank: int
    pair: tuple[str, str]
    hosts: tuple[str, str]
    ports: tuple[int, int, int]
    started: tuple[float, float]
    term: int

    def __post_init__(self) -> None:
        _as_tuples(self, "pair", "hosts", "ports", "started")
        if self.rank not in (0, 1) or any(not 0 < p < 65536 for p in self.ports):
            raise ValueError(f"rank {self.rank} is not 0 or 1, or one of the ports {list(self.ports)} is out of range")

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> ProbeRequest:
        return schemas.decode(cls, data, "link probe request")

    @property
    def mine(self) -> tuple[int, ...]:
        """The ports this side binds: its stream port, and the rendezvous on rank 0."""
        return (self.ports[0], self.ports[2]) if self.rank == 0 else (self.ports[1],)

    @property
    def peer(self) -> str:
        return self.pair[1 - self.rank]


async def read_links(store: Store, keys: Keys, *, timeout: float) -> dict[tuple[str, str], LinkMeasurement]:
    """Every stored pair measurement (malformed ones are skipped and logged)."""
    out = {}
    for kv in await store.get_prefix(keys.link_pairs, timeout=timeout):
        try:
            m = schemas.decoded(kv.key, kv.value, LinkMeasurement.decode)
            if kv.key != keys.link_pair(*m.members):   # a pair is kept at its own key, nowhere else
                raise ValueError(f"it measures {' and '.join(m.members)}, whose key is another")
        except ValueError as exc:
            schemas.reject("link measurement", kv.key, exc)
            continue
        out[tuple(sorted(m.members))] = m
    return out


def apply_links(cals: Mapping[str, Calibration], links: Iterable[LinkMeasurement]) -> dict[str, Calibration]:
    """The calibrations with their "inter" link and all-reduce replaced by the slowest of `links`."""
    links = list(links)
    if not links:
        return dict(cals)
    slow = min(links, key=lambda m: m.bandwidth_Bps)
    slow_ar = min(links, key=lambda m: m.allreduce_Bps)
    out = {}
    for kind, cal in cals.items():
        old = cal.links.get("inter") or LinkCost(0.0, slow.bandwidth_Bps)
        inter = LinkCost(slow.latency_s, slow.bandwidth_Bps, old.send_overhead_s, old.recv_overhead_s)
        old_ar = cal.allreduce.get("inter") or LinkCost(0.0, slow_ar.allreduce_Bps)
        ar = LinkCost(slow_ar.allreduce_latency_s, slow_ar.allreduce_Bps, old_ar.send_overhead_s,
                      old_ar.recv_overhead_s)
        out[kind] = dataclasses.replace(cal, links={**cal.links, "inter": inter},
                                        allreduce={**cal.allreduce, "inter": ar})
    return out


# --------------------------------------------------------------------------------------- leader side

@dataclass
class _Probe:
    id: str
    since: float
    ident: tuple                  # (hosts, started): what its result must be measured for
    requests: dict[str, bytes]    # key -> the request written there


class LinkSurvey:
    """What the leader knows of the links between members, and the probes it has asked for.

    ``put`` writes a request (the leader's guarded write: a deposed leader asks for nothing);
    ``term`` is the leader's term, named in each request so a member can tell an earlier
    leader's request from the present one's."""

    def __init__(self, store: Store, keys: Keys, *, timeout: float,
                 put: Callable[[str, bytes], Awaitable[Any]] | None = None,
                 term: Callable[[], int | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.keys, self.t, self.clock = store, keys, timeout, clock
        self.put = put or (lambda key, value: store.put(key, value, timeout=timeout))
        self.term = term
        self.results: dict[tuple[str, str], LinkMeasurement] = {}
        self.in_flight: dict[tuple[str, str], _Probe] = {}
        self.failed: dict[tuple[str, str], tuple[float, tuple]] = {}   # pair -> (when, ident)

    def _current(self, pair: tuple[str, str], ident: tuple) -> bool:
        m = self.results.get(pair)
        return m is not None and (tuple(m.hosts), tuple(m.started)) == ident

    async def survey(self, members: Mapping[str, Any], busy: set[str]) -> None:
        """Read results; end probes; delete stale requests; start probes for sampled pairs that
        need one (both idle, neither in a probe in flight; ``MAX_PARALLEL_PROBES`` at most).
        `members`: name -> DaemonMember of the usable members; `busy`: names running workers."""
        # The requests first: rank 0's daemon stores a result before it deletes its request, and
        # rank 1's deletes its own only when it measured nothing, so a request gone here with no
        # result read after it is a probe that failed.
        held = {kv.key: kv.value for kv in await self.store.get_prefix(self.keys.probes, timeout=self.t)}
        self.results = await read_links(self.store, self.keys, timeout=self.t)
        now = self.clock()
        for pair, probe in list(self.in_flight.items()):
            gone = [key.rsplit("/", 1)[1] for key, doc in probe.requests.items() if held.get(key) != doc]
            if self._current(pair, probe.ident):
                m = self.results[pair]
                log.info("leader: link %s <-> %s measured: %.3g ms, %.3g MB/s; all-reduce %.3g MB/s", *pair,
                         1e3 * m.latency_s, m.bandwidth_Bps / 1e6, m.allreduce_Bps / 1e6)
                why = None
            elif not set(pair) <= set(members):
                why = "a member left"
            elif now - probe.since > PROBE_TIMEOUT:
                why = f"no result within {PROBE_TIMEOUT:.0f}s"
            elif gone:
                why = f"{' and '.join(gone)} ended it without a result (the daemon's log says why)"
            else:
                continue
            del self.in_flight[pair]
            if why is not None:
                log.warning("leader: the link probe %s <-> %s failed: %s; planning with the calibration's link "
                            "for it (retry in %.0fs)", *pair, why, RETRY_AFTER)
                self.failed[pair] = (now, probe.ident)
        # Every request no probe of ours waits for: an earlier leader's, an ended probe's.
        wanted = {key: doc for probe in self.in_flight.values() for key, doc in probe.requests.items()}
        for key, value in held.items():
            if wanted.get(key) != value:
                with contextlib.suppress(StoreError):
                    await self.store.delete_if(key, value=value, timeout=self.t)
        # A member (a host) in two probes at once would share, and mismeasure, its link: only
        # disjoint pairs run together.
        taken = set(busy) | {n for pair in self.in_flight for n in pair}
        hosts = {h for probe in self.in_flight.values() for h in probe.ident[0]}
        # Pairs with a member measured against nobody yet first: a first plan waits for probes at
        # most PROBE_TIMEOUT (the sample of 300 VMs is 450 probes), and the planner sees a slow
        # NIC only where its member was measured; in name order, the last names came last.
        measured = {n for pair in self.results for n in pair} | {n for pair in self.in_flight for n in pair}
        for pair in sorted(self._needed(members), key=lambda p: len(measured & set(p))):
            if len(self.in_flight) >= MAX_PARALLEL_PROBES:
                break
            ident = self._ident(pair, members)
            if set(pair) & taken or set(ident[0]) & hosts:
                continue
            await self._request(pair, members)
            taken |= set(pair)
            hosts |= set(ident[0])

    def _ident(self, pair: tuple[str, str], members: Mapping[str, Any]) -> tuple:
        """What a measurement is valid for: both addresses and both members' start times."""
        a, b = members[pair[0]], members[pair[1]]
        return ((a.host, b.host), (float(a.started_at), float(b.started_at)))

    def _needed(self, members: Mapping[str, Any]) -> list[tuple[str, str]]:
        """The sampled pairs (``sample_pairs``) without a current result or a recent failure."""
        # a daemon of an older release has no probe ports (its ports are all its workers'): it is
        # left off the ring, so its place does not cost its neighbours their measurement
        probed = [n for n, m in members.items() if m.probe_ports]
        out = []
        for pair in sample_pairs(probed):
            ident = self._ident(pair, members)
            if ident[0][0] == ident[0][1] or self._current(pair, ident):
                continue
            failed = self.failed.get(pair)
            if failed is not None and failed[1] == ident and self.clock() - failed[0] < RETRY_AFTER:
                continue
            out.append(pair)
        return out

    async def _request(self, pair: tuple[str, str], members: Mapping[str, Any]) -> None:
        term = self.term()
        a, b = (members[n] for n in pair)
        pid = uuid.uuid4().hex[:12]
        ident = self._ident(pair, members)
        hosts, started = ident
        ports = (a.probe_ports[0], b.probe_ports[0], a.probe_ports[1])
        requests = {self.keys.probe(name): ProbeRequest(id=pid, rank=rank, pair=pair, hosts=hosts, ports=ports,
                                                              started=started, term=term or 0).encode()
                    for rank, name in enumerate(pair)}
        self.in_flight[pair] = _Probe(pid, self.clock(), ident, requests)
        for key, doc in requests.items():
            await self.put(key, doc)
        log.info("leader: measuring the link %s (%s) <-> %s (%s)", pair[0], hosts[0], pair[1], hosts[1])

    def waiting(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """Pairs among `names` whose probe is in flight (a job's first plan waits for them)."""
        names = set(names)
        return [p for p in self.in_flight if set(p) <= names]

    def measured(self, names: Iterable[str]) -> list[LinkMeasurement]:
        names = set(names)
        return [m for p, m in self.results.items() if set(p) <= names]


# --------------------------------------------------------------------------------------- member side

class LinkProber:
    """Runs this daemon's side of the probes the leader asks for, on the member's probe ports.

    ``member()`` is this daemon's registered DaemonMember (its start time and probe ports);
    ``ports`` the daemon's PortReservation, of which only the probe ports are released to a
    probe; ``command`` the probe's command line (the spec JSON is appended)."""

    def __init__(self, *, store: Store, keys: Keys, name: str, member: Callable[[], Any],
                 ports: PortReservation, is_busy: Callable[[], bool], timeout: float,
                 env: Mapping[str, str] | None = None, command: Iterable[str] | None = None) -> None:
        self.store, self.keys, self.name = store, keys, name
        self.member = member
        self.ports = ports
        self.is_busy = is_busy
        self.t = timeout
        self.env = dict(os.environ if env is None else env)
        self.command = list(command) if command is not None else [sys.executable, "-m", "trainer.linkprobe"]
        self.key = keys.probe(name)
        self._done: set[str] = set()
        self._task: asyncio.Task | None = None
        self._value: bytes | None = None   # the request the running task serves

    async def run(self) -> None:
        try:
            while True:
                watch = self.store.watch(self.key)
                try:
                    await watch.start(timeout=self.t)
                    kv = await self.store.get(self.key, timeout=self.t)
                    await self._follow(kv.value if kv is not None else None)
                    while True:
                        event = await watch.next(timeout=None)
                        if event is not None:
                            await self._follow(event.value if event.kind == "put" else None)
                except StoreError as exc:
                    log.debug("%s: link probe watch broke (%s); watching again", self.name, exc)
                    await asyncio.sleep(1.0)
                finally:
                    await watch.cancel()
        finally:
            await self.stop()

    async def _follow(self, value: bytes | None) -> None:
        """The request key now holds `value` (None: deleted): a probe for another request ends,
        and a new request is taken up."""
        if self._task is not None and not self._task.done() and value == self._value:
            return
        await self.stop("its request was withdrawn or replaced")
        if value is not None:
            self._value = value
            self._task = asyncio.get_running_loop().create_task(self._handle(value), name="link-probe")

    async def stop(self, why: str | None = None) -> None:
        """End the running probe, if any (its process is killed): workers are about to start,
        or its request is gone."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        if why:
            log.info("%s: ending the link probe in progress: %s", self.name, why)
        task.cancel()
        # asyncio.wait, not `await task`: the probe's CancelledError must not be confused with
        # (and swallow) a cancellation of the caller, which would then wait on for ever
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s: the link probe task failed: %r", self.name, task.exception())

    async def _handle(self, value: bytes) -> None:
        try:
            req = ProbeRequest.decode(value)
            if req.pair[req.rank] != self.name:
                raise ValueError(f"a request for {req.pair[req.rank]}, not {self.name}")
        except ValueError as exc:
            log.warning("%s: deleted a malformed link probe request: %s", self.name, exc)
            await self._withdraw(value)
            return
        measured = False
        try:
            if req.id in self._done:
                return
            self._done.add(req.id)
            try:
                why = await self._stale(req, value)
            except StoreError as exc:
                why = f"etcd could not confirm it: {exc}"
            if why is not None:
                log.info("%s: deleted a stale link probe request (%s <-> %s): %s", self.name, *req.pair, why)
                return
            if self.is_busy():
                log.info("%s: not probing the link to %s: workers are running", self.name, req.peer)
                return
            out = await self._probe(req)
            measured = out is not None
            if measured and req.rank == 0:
                await self._store(req, out)
        finally:
            # The leader reads a request gone without a result as the probe's failure. Rank 1's
            # request stays when it measured: rank 0's daemon may not have stored the result yet.
            if req.rank == 0 or not measured:
                await self._withdraw(value)

    async def _stale(self, req: ProbeRequest, value: bytes) -> str | None:
        """Why `req` must not run (None: it may)."""
        me = self.member()
        if float(me.started_at) != req.started[req.rank]:
            return "it was made for an earlier start of this daemon"
        own = tuple(me.probe_ports)
        if len(own) != 2 or req.mine != ((own[0], own[1]) if req.rank == 0 else (own[0],)):
            return f"it names ports {list(req.mine)}, not this daemon's probe ports {list(own)}"
        kv = await self.store.get(self.key, timeout=self.t)
        if kv is None or kv.value != value:
            return "the leader withdrew or replaced it"
        leader = await self.store.get(self.keys.leader, timeout=self.t)
        if leader is None or leader.create_revision != req.term:
            return f"it was made in leader term {req.term}, and that leadership has ended"
        return None

    async def _withdraw(self, value: bytes) -> None:
        if self._value is value:
            self._value = None   # the deletion's watch event is this task's own doing, no reason to end it
        with contextlib.suppress(StoreError):
            await self.store.delete_if(self.key, value=value, timeout=self.t)

    async def _probe(self, req: ProbeRequest) -> bytes | None:
        """Run this side; rank 0's output (None when the probe failed or timed out)."""
        spec = json.dumps({"rank": req.rank, "hosts": list(req.hosts), "ports": list(req.ports),
                           "timeout_s": PROBE_TIMEOUT / 2})
        for p in req.mine:
            self.ports.release(p)
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, spec, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT)
        except TimeoutError:
            log.warning("%s: the link probe to %s did not finish within %.0fs", self.name, req.peer, PROBE_TIMEOUT)
            return None
        except OSError as exc:
            log.warning("%s: could not start the link probe to %s: %s", self.name, req.peer, exc)
            return None
        finally:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.shield(proc.wait())
            for p in req.mine:
                self.ports.reacquire(p)
        if proc.returncode != 0:
            log.warning("%s: the link probe to %s failed (exit %s): %s", self.name, req.peer, proc.returncode,
                        err.decode(errors="replace")[-500:])
            return None
        return out

    async def _store(self, req: ProbeRequest, out: bytes) -> None:
        try:
            res = json.loads(out.decode().strip().splitlines()[-1])
            m = LinkMeasurement(members=req.pair, hosts=req.hosts, started=req.started,
                                latency_s=float(res["latency_s"]), bandwidth_Bps=float(res["bandwidth_Bps"]),
                                allreduce_latency_s=float(res["allreduce_latency_s"]),
                                allreduce_Bps=float(res["allreduce_Bps"]), at=time.time())
            await self.store.put(self.keys.link_pair(*req.pair), m.encode(), timeout=self.t)
            log.info("%s: link to %s: %.3g ms, %.3g MB/s; all-reduce %.3g MB/s", self.name, req.pair[1],
                     1e3 * m.latency_s, m.bandwidth_Bps / 1e6, m.allreduce_Bps / 1e6)
        except (ValueError, KeyError, IndexError, StoreError) as exc:
            log.warning("%s: could not store the link to %s: %s", self.name, req.pair[1], exc)
