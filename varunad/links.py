"""The links between VMs, measured: the leader has pairs of idle members probe each other.

A calibration measures one VM (its compute, its loopback); the network between VMs is the
fleet's own, and a plan that assumes loopback speed is wrong by the cap's ratio on a 10 Mbit/s
link. So:

* ``LinkSurvey`` (the leader): for every pair of members without a result for their current
  addresses (new members, an address that changed), both idle (no worker of a running plan on
  either: a probe never competes with a step), one probe at a time, it writes a request to
  each side: ``links/probe/<member>``. A probe that has no result after ``PROBE_TIMEOUT`` fails,
  and the pair waits ``RETRY_AFTER`` before another try.
* ``LinkProber`` (every daemon): follows its request key and runs one side of the probe,
  ``python -m trainer.linkprobe`` bound to its advertised address on its own reserved ports
  (ZeroMQ echo and gloo all-reduce, the transports of training); rank 0's daemon stores the
  result in ``links/pair/<a>/<b>`` (names sorted), with the addresses it was measured between.
* Planning (``apply``): the calibration's "inter" link and all-reduce cost become the slowest
  measured pair among the plan's candidates (the pipeline runs at its slowest hop; the CPU
  overheads per message stay the calibration's). A job waits for probes in flight among its
  candidates before it is planned (``waiting``), bounded by the probe timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.calibration import Calibration, LinkCost

from varunad.fleetkeys import FleetKeys
from varunad.store import Store, StoreError

__all__ = ["LinkMeasurement", "LinkProber", "LinkSurvey", "PROBE_TIMEOUT", "apply_links", "read_links"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 90.0   # a probe starts two Python processes with torch: seconds on a busy host
RETRY_AFTER = 60.0


def _probe_key(keys: FleetKeys, member: str) -> str:
    return f"{keys.root}links/probe/{member}"


def _pair_prefix(keys: FleetKeys) -> str:
    return f"{keys.root}links/pair/"


def _pair_key(keys: FleetKeys, a: str, b: str) -> str:
    a, b = sorted((a, b))
    return f"{_pair_prefix(keys)}{a}/{b}"


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """One pair's link, as measured; ``hosts`` are the addresses it was measured between."""

    members: tuple[str, str]
    hosts: tuple[str, str]
    started: tuple[float, float]   # the members' start times: a restarted VM (it may have moved) is measured again
    latency_s: float
    bandwidth_Bps: float
    allreduce_latency_s: float
    allreduce_Bps: float
    at: float

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LinkMeasurement:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a link measurement is a JSON object")
        m = cls(members=tuple(raw["members"]), hosts=tuple(raw["hosts"]),
                started=tuple(float(x) for x in raw.get("started", (0.0, 0.0))), latency_s=float(raw["latency_s"]),
                bandwidth_Bps=float(raw["bandwidth_Bps"]), allreduce_latency_s=float(raw["allreduce_latency_s"]),
                allreduce_Bps=float(raw["allreduce_Bps"]), at=float(raw.get("at", 0.0)))
        if len(m.members) != 2 or len(m.hosts) != 2 or m.bandwidth_Bps <= 0 or m.allreduce_Bps <= 0:
            raise ValueError(f"a link measurement needs two members, two hosts and positive bandwidths: {raw}")
        return m


async def read_links(store: Store, keys: FleetKeys, *, timeout: float) -> dict[tuple[str, str], LinkMeasurement]:
    """Every stored pair measurement (malformed ones are skipped and logged)."""
    out = {}
    for kv in await store.get_prefix(_pair_prefix(keys), timeout=timeout):
        try:
            m = LinkMeasurement.decode(kv.value)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring link measurement %s: %s", kv.key, exc)
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

class LinkSurvey:
    """What the leader knows of the links between members, and the probes it has asked for."""

    def __init__(self, store: Store, keys: FleetKeys, *, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.keys, self.t, self.clock = store, keys, timeout, clock
        self.results: dict[tuple[str, str], LinkMeasurement] = {}
        self.in_flight: dict[tuple[str, str], tuple[str, float, tuple[str, str]]] = {}  # pair -> (id, since, hosts)
        self.failed: dict[tuple[str, str], tuple[float, tuple[str, str]]] = {}   # pair -> (when, hosts)

    def _current(self, pair: tuple[str, str], ident: tuple) -> bool:
        m = self.results.get(pair)
        return m is not None and (tuple(m.hosts), tuple(m.started)) == ident

    async def survey(self, members: Mapping[str, Any], busy: set[str]) -> None:
        """Read results; expire probes; start one for a pair that needs it (both idle).
        `members`: name -> DaemonMember of the usable members; `busy`: names running workers."""
        self.results = await read_links(self.store, self.keys, timeout=self.t)
        now = self.clock()
        for pair, (pid, since, hosts) in list(self.in_flight.items()):
            if self._current(pair, hosts):
                m = self.results[pair]
                log.info("leader: link %s <-> %s measured: %.3g ms, %.3g MB/s; all-reduce %.3g MB/s", *pair,
                         1e3 * m.latency_s, m.bandwidth_Bps / 1e6, m.allreduce_Bps / 1e6)
                del self.in_flight[pair]
            elif now - since > PROBE_TIMEOUT or not set(pair) <= set(members):
                log.warning("leader: the link probe %s <-> %s gave no result within %.0fs; planning with the "
                            "calibration's link for it (retry in %.0fs)", *pair, PROBE_TIMEOUT, RETRY_AFTER)
                del self.in_flight[pair]
                self.failed[pair] = (now, hosts)
                for name in pair:
                    with contextlib.suppress(StoreError):
                        await self.store.delete(_probe_key(self.keys, name), timeout=self.t)
        if self.in_flight:
            return   # one probe at a time: two would share (and mismeasure) a host's link
        for pair in self._needed(members):
            if set(pair) & busy:
                continue
            await self._request(pair, members)
            return

    def _hosts(self, pair: tuple[str, str], members: Mapping[str, Any]) -> tuple:
        """What a measurement is valid for: both addresses and both members' start times."""
        a, b = members[pair[0]], members[pair[1]]
        return ((a.host, b.host), (float(a.started_at), float(b.started_at)))

    def _needed(self, members: Mapping[str, Any]) -> list[tuple[str, str]]:
        out = []
        for pair in itertools.combinations(sorted(members), 2):
            hosts = self._hosts(pair, members)
            if hosts[0][0] == hosts[0][1] or self._current(pair, hosts):
                continue
            failed = self.failed.get(pair)
            if failed is not None and failed[1] == hosts and self.clock() - failed[0] < RETRY_AFTER:
                continue
            out.append(pair)
        return out

    async def _request(self, pair: tuple[str, str], members: Mapping[str, Any]) -> None:
        a, b = (members[n] for n in pair)
        if not a.worker_ports or not b.worker_ports:
            return
        pid = uuid.uuid4().hex[:12]
        ident = self._hosts(pair, members)
        hosts = ident[0]
        ports = [a.worker_ports[0], b.worker_ports[0], a.rendezvous_port]
        for rank, name in enumerate(pair):
            doc = {"id": pid, "rank": rank, "pair": list(pair), "hosts": list(hosts), "ports": ports,
                   "started": list(ident[1])}
            await self.store.put(_probe_key(self.keys, name), json.dumps(doc).encode(), timeout=self.t)
        self.in_flight[pair] = (pid, self.clock(), ident)
        log.info("leader: measuring the link %s (%s) <-> %s (%s)", pair[0], hosts[0], pair[1], hosts[1])

    def waiting(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """Pairs among `names` whose probe is in flight (a plan should wait for them)."""
        names = set(names)
        return [p for p in self.in_flight if set(p) <= names]

    def measured(self, names: Iterable[str]) -> list[LinkMeasurement]:
        names = set(names)
        return [m for p, m in self.results.items() if set(p) <= names]


# --------------------------------------------------------------------------------------- member side

class LinkProber:
    """Runs this daemon's side of the probes the leader asks for."""

    def __init__(self, *, store: Store, keys: FleetKeys, name: str, host: str, ports, is_busy: Callable[[], bool],
                 timeout: float, env: Mapping[str, str] | None = None) -> None:
        self.store, self.keys, self.name, self.host = store, keys, name, host
        self.ports = ports   # varunad.facts.PortReservation: the probe's ports are released to it
        self.is_busy = is_busy
        self.t = timeout
        self.env = dict(os.environ if env is None else env)
        self._done: set[str] = set()

    async def run(self) -> None:
        key = _probe_key(self.keys, self.name)
        while True:
            watch = self.store.watch(key)
            try:
                await watch.start(timeout=self.t)
                kv = await self.store.get(key, timeout=self.t)
                if kv is not None:
                    await self._handle(kv.value)
                while True:
                    event = await watch.next(timeout=None)
                    if event is not None and event.kind == "put":
                        await self._handle(event.value)
            except StoreError as exc:
                log.debug("%s: link probe watch broke (%s); watching again", self.name, exc)
                await asyncio.sleep(1.0)
            finally:
                await watch.cancel()

    async def _handle(self, value: bytes) -> None:
        try:
            doc = json.loads(value)
            pid, rank, pair, hosts, ports = doc["id"], int(doc["rank"]), doc["pair"], doc["hosts"], doc["ports"]
            if rank not in (0, 1) or len(hosts) != 2 or len(ports) != 3 or pair[rank] != self.name:
                raise ValueError(f"not a probe for {self.name}: {doc}")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s: dropped a malformed link probe request: %s", self.name, exc)
            return
        if pid in self._done:
            return
        self._done.add(pid)
        if self.is_busy():
            log.info("%s: not probing the link to %s: workers are running", self.name, pair[1 - rank])
            return
        mine = [int(ports[rank])] + ([int(ports[2])] if rank == 0 else [])
        spec = json.dumps({"rank": rank, "hosts": hosts, "ports": [int(p) for p in ports],
                           "timeout_s": PROBE_TIMEOUT / 2})
        for p in mine:
            self.ports.release(p)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainer.linkprobe", spec, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                log.warning("%s: the link probe to %s did not finish within %.0fs", self.name, pair[1 - rank],
                            PROBE_TIMEOUT)
                return
        finally:
            for p in mine:
                self.ports.reacquire(p)
        if proc.returncode != 0:
            log.warning("%s: the link probe to %s failed (exit %s): %s", self.name, pair[1 - rank], proc.returncode,
                        err.decode(errors="replace")[-500:])
            return
        if rank != 0:
            return
        try:
            res = json.loads(out.decode().strip().splitlines()[-1])
            m = LinkMeasurement(members=tuple(pair), hosts=tuple(hosts),
                                started=tuple(float(x) for x in doc.get("started", (0.0, 0.0))),
                                latency_s=float(res["latency_s"]),
                                bandwidth_Bps=float(res["bandwidth_Bps"]),
                                allreduce_latency_s=float(res["allreduce_latency_s"]),
                                allreduce_Bps=float(res["allreduce_Bps"]), at=time.time())
            await self.store.put(_pair_key(self.keys, *pair), m.encode(), timeout=self.t)
            log.info("%s: link to %s: %.3g ms, %.3g MB/s; all-reduce %.3g MB/s", self.name, pair[1],
                     1e3 * m.latency_s, m.bandwidth_Bps / 1e6, m.allreduce_Bps / 1e6)
        except (ValueError, KeyError, IndexError, StoreError) as exc:
            log.warning("%s: could not store the link to %s: %s", self.name, pair[1], exc)
