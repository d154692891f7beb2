"""Epoch-guarded writes (varunad.cluster.fencing) against a real etcd, and measured links in plans (varunad.control.links).

The in-process tests of tests/integration/test_links_fencing.py (tests/README.md).
"""

from __future__ import annotations

import itertools
import json

import pytest
from support.calibrations import calibration

from trainer.planning.calibration import LinkCost
from varunad.cluster.facts import DaemonMember
from varunad.control.links import (
    MAX_PARALLEL_PROBES,
    RETRY_AFTER,
    LinkMeasurement,
    LinkSurvey,
    ProbeRequest,
    apply_links,
    sample_pairs,
)
from varunad.store.contract import KeyValue, Listing
from varunad.store.keys import Keys


def _m(a, b, bw, ar):
    return LinkMeasurement(members=(a, b), hosts=("10.0.0.1", "10.0.0.2"), started=(1.0, 2.0), latency_s=1e-3,
                           bandwidth_Bps=bw, allreduce_latency_s=2e-3, allreduce_Bps=ar, at=0.0)


def test_plans_use_the_slowest_measured_link_and_keep_the_cpu_overheads():
    link = LinkCost(50e-6, 5e9, 1e-4, 2e-4)
    cal = calibration(2, links={"intra": link, "inter": link})
    out = apply_links({"cpu": cal}, [_m("a", "b", 1e8, 9e7), _m("a", "c", 1.25e6, 2e6)])["cpu"]
    assert out.links["inter"] == LinkCost(1e-3, 1.25e6, 1e-4, 2e-4)
    assert out.allreduce["inter"].bandwidth_Bps == 2e6 and out.allreduce["inter"].latency_s == 2e-3
    assert out.links["intra"] == cal.links["intra"]   # same-host links stay the calibration's
    assert apply_links({"cpu": cal}, [])["cpu"] == cal


def test_a_malformed_link_measurement_is_refused():
    good = _m("a", "b", 1e8, 9e7)
    assert LinkMeasurement.decode(good.encode()) == good
    for bad in (b"[]", b'{"members": ["a"]}', json.dumps({**json.loads(good.encode()), "bandwidth_Bps": 0}).encode()):
        with pytest.raises((ValueError, KeyError)):
            LinkMeasurement.decode(bad)


# --------------------------------------------------------------------------------------- the survey

KEYS = Keys("/t/")


class _Store:
    """The few calls LinkSurvey makes, on a dict; every put is kept in `writes`."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.writes: list[str] = []

    async def get_prefix(self, prefix, *, timeout=None):
        return Listing(0, tuple(KeyValue(k, v, 1, 1, 1, 0) for k, v in sorted(self.data.items())
                                if k.startswith(prefix)))

    async def put(self, key, value, *, timeout=None):
        self.writes.append(key)
        self.data[key] = value
        return 1

    async def delete_if(self, key, *, value, timeout=None):
        return self.data.get(key) == value and self.data.pop(key) is not None


def _member(i: int, *, host: str | None = None, probe: bool = True) -> DaemonMember:
    return DaemonMember(name=f"vm{i:03d}", host=host or f"10.1.{i // 200}.{i % 200 + 1}", endpoint="tcp://x:1",
                        slots=1, device_kind="cpu", memory_bytes=2**30, version="0.1.0", started_at=1000.0 + i,
                        worker_ports=(40000,), rendezvous_port=40001, probe_ports=(40002, 40003) if probe else ())


def _fleet(n: int, **overrides) -> dict[str, DaemonMember]:
    """`overrides`: member number (as "vm<i>") -> _member's keywords for it."""
    return {m.name: m for m in (_member(i, **overrides.get(f"vm{i}", {})) for i in range(n))}


def _survey(store=None, clock=lambda: 0.0) -> LinkSurvey:
    return LinkSurvey(store or _Store(), KEYS, timeout=1.0, term=lambda: 7, clock=clock)


def _result(members, a, b, bw=1e8) -> LinkMeasurement:
    ma, mb = members[a], members[b]
    return LinkMeasurement(members=(a, b), hosts=(ma.host, mb.host), started=(ma.started_at, mb.started_at),
                           latency_s=1e-3, bandwidth_Bps=bw, allreduce_latency_s=2e-3, allreduce_Bps=bw)


def test_the_survey_asks_for_a_linear_sample_of_pairs_that_covers_every_member():
    """Every pair of 300 VMs is 44,850 probes, which never finish: the ring's successor and the
    member halfway round are 300 to 450, and each member is in one (its slow NIC shows)."""
    for n in (300, 301):
        members = _fleet(n)
        needed = _survey()._needed(members)
        assert n <= len(needed) <= -(-3 * n // 2), f"{len(needed)} pairs for {n} members"
        assert len(set(needed)) == len(needed) and all(a < b for a, b in needed)
        assert {name for pair in needed for name in pair} == set(members)
        names = sorted(members)
        assert {tuple(sorted((names[i], names[(i + 1) % n]))) for i in range(n)} <= set(needed)   # the ring
        # and a partner about halfway round, for every member
        far = {name: set() for name in names}
        for a, b in needed:
            d = abs(names.index(a) - names.index(b))
            far[a].add(min(d, n - d))
            far[b].add(min(d, n - d))
        assert all(n // 2 in ds for ds in far.values())
        # the same sample whatever order the members come in
        assert _survey()._needed(dict(reversed(members.items()))) == needed


def test_two_and_three_members_are_paired_once_and_the_old_skips_hold():
    def pairs(n):
        return _survey()._needed(_fleet(n))

    assert pairs(1) == []
    assert pairs(2) == [("vm000", "vm001")]
    assert pairs(3) == [("vm000", "vm001"), ("vm000", "vm002"), ("vm001", "vm002")]
    assert pairs(4) == list(itertools.combinations(sorted(_fleet(4)), 2))
    # 5: the ring's 5, and the chords 0-2, 1-3, 2-4 (each member once, not 0-2 and 3-0 as well)
    assert len(pairs(5)) == 8 and ("vm000", "vm003") not in pairs(5)
    # a member without probe ports is left off the ring: its neighbours are paired instead
    assert _survey()._needed(_fleet(3, vm1={"probe": False})) == [("vm000", "vm002")]
    # two members on one host: not probed
    assert _survey()._needed(_fleet(3, vm1={"host": "10.1.0.1"})) == [("vm000", "vm002"), ("vm001", "vm002")]
    # a pair measured for these addresses and starts is not asked again; a failed one waits
    members = _fleet(3)
    now = [100.0]
    survey = _survey(clock=lambda: now[0])
    survey.results[("vm000", "vm001")] = _result(members, "vm000", "vm001")
    survey.failed[("vm001", "vm002")] = (100.0, survey._ident(("vm001", "vm002"), members))
    assert survey._needed(members) == [("vm000", "vm002")]
    now[0] += RETRY_AFTER + 1
    assert survey._needed(members) == [("vm000", "vm002"), ("vm001", "vm002")]


async def test_disjoint_idle_pairs_are_probed_at_once_up_to_the_cap():
    """A member (a host) in two probes at once would share its link: at most MAX_PARALLEL_PROBES
    probes, no member or host in two, none with a member running workers."""
    # vm002 and vm009 on one host: never probed at once, though the pairs differ
    members = _fleet(16, vm9={"host": "10.1.0.3"})
    busy = {"vm005", "vm012"}
    store = _Store()
    survey = _survey(store)

    def check():
        flying = list(survey.in_flight)
        names = [n for pair in flying for n in pair]
        hosts = [members[n].host for n in names]
        assert len(flying) == MAX_PARALLEL_PROBES, flying
        assert len(set(names)) == len(names) and len(set(hosts)) == len(hosts), flying
        assert not set(names) & busy
        assert set(flying) <= set(sample_pairs(members))
        return flying

    await survey.survey(members, busy)
    first = check()
    # one write per side of each probe, the request naming its pair, rank and the leader's term
    assert sorted(store.writes) == sorted(KEYS.probe(n) for pair in first for n in pair)
    for pair in first:
        for rank, name in enumerate(pair):
            req = ProbeRequest.decode(store.data[KEYS.probe(name)])
            assert (req.pair, req.rank, req.term) == (pair, rank, 7)
    await survey.survey(members, busy)   # nothing ended: nothing more is asked
    assert list(survey.in_flight) == first and len(store.writes) == 2 * len(first)
    # one ends with its result: its requests are deleted and another disjoint pair starts
    done = first[0]
    asked = {n: store.data[KEYS.probe(n)] for n in done}
    store.data[KEYS.link_pair(*done)] = _result(members, *done).encode()
    await survey.survey(members, busy)
    second = check()
    assert done not in second and set(first[1:]) <= set(second)
    assert all(store.data.get(KEYS.probe(n)) != doc for n, doc in asked.items())
    assert len(store.writes) == 2 * (len(first) + 1)


async def test_a_result_outside_the_sample_is_still_used_for_planning():
    """A measurement never goes to waste: one stored for a pair the sample does not ask for (an
    earlier, larger ring's) is read back and planned with."""
    members = _fleet(6)
    outside = ("vm000", "vm002")
    assert outside not in sample_pairs(members)
    store = _Store()
    store.data[KEYS.link_pair(*outside)] = _result(members, *outside, bw=1.25e6).encode()
    survey = _survey(store)
    await survey.survey(members, set())
    assert outside not in survey._needed(members) and outside not in survey.in_flight
    assert [m.members for m in survey.measured(["vm000", "vm002", "vm004"])] == [outside]
    assert outside in [m.members for m in survey.measured(members)]
    link = LinkCost(50e-6, 5e9, 1e-4, 2e-4)
    cal = calibration(2, links={"intra": link, "inter": link})
    planned = apply_links({"cpu": cal}, survey.measured(members))["cpu"]
    assert planned.links["inter"].bandwidth_Bps == 1.25e6


async def test_every_member_is_measured_once_before_any_is_measured_twice():
    """A first plan waits for probes only so long (PROBE_TIMEOUT): the survey measures each member
    against someone before it measures anyone again, so that what the wait gets covers the
    fleet, not its first names only."""
    members = _fleet(40)
    store = _Store()
    survey = _survey(store)
    probes = 0
    while len({n for pair in survey.results for n in pair}) < len(members):
        await survey.survey(members, set())
        assert survey.in_flight, "the survey stopped before every member was measured"
        for pair in list(survey.in_flight):   # every probe in flight ends with its result
            store.data[KEYS.link_pair(*pair)] = _result(members, *pair).encode()
            probes += 1
    assert probes <= len(members) // 2 + MAX_PARALLEL_PROBES, f"{probes} probes to measure each of 40 members once"
    # and the rest of the sample follows
    while True:
        await survey.survey(members, set())
        if not survey.in_flight:
            break
        for pair in list(survey.in_flight):
            store.data[KEYS.link_pair(*pair)] = _result(members, *pair).encode()
    await survey.survey(members, set())
    assert set(survey.results) == set(sample_pairs(members))
