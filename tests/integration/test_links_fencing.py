"""Epoch-guarded writes (varunad.cluster.fencing) against a real etcd, and measured links in plans (varunad.control.links)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from support.waiting import until_async

from varunad.cluster.facts import DaemonMember, PortReservation
from varunad.cluster.fencing import put_for_epoch
from varunad.control.links import LinkProber, LinkSurvey, ProbeRequest, read_links
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


async def test_an_old_epoch_never_overwrites_a_newer_record(etcd, etcd_root):
    key = etcd_root + "progress/j/1"
    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        e = await store.revision()   # epochs are plan revisions: records are written after them
        assert await put_for_epoch(store, key, json.dumps({"epoch": e, "step": 9}).encode(), epoch=e)
        # a rejoining VM flushing what its old epoch had queued
        assert not await put_for_epoch(store, key, json.dumps({"epoch": e - 2, "step": 36}).encode(), epoch=e - 2)
        assert json.loads((await store.get(key)).value) == {"epoch": e, "step": 9}
        assert await put_for_epoch(store, key, json.dumps({"epoch": e, "step": 10}).encode(), epoch=e)
        newer = await store.revision()
        assert await put_for_epoch(store, key, json.dumps({"epoch": newer, "step": 11}).encode(), epoch=newer)
        assert json.loads((await store.get(key)).value)["epoch"] == newer


async def test_a_record_claiming_an_epoch_no_plan_had_yet_does_not_shut_the_writer_out(etcd, etcd_root):
    key = etcd_root + "progress/j/3"
    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        e = await store.revision()
        await store.put(key, json.dumps({"epoch": 10**15, "step": 1}))   # a hand's forged record
        assert await put_for_epoch(store, key, json.dumps({"epoch": e, "step": 2}).encode(), epoch=e)
        assert json.loads((await store.get(key)).value) == {"epoch": e, "step": 2}


async def test_a_writer_that_knows_its_last_revision_skips_the_read_until_someone_else_writes(etcd, etcd_root):
    key = etcd_root + "progress/j/2"

    def record(epoch: int, step: int) -> bytes:
        return json.dumps({"epoch": epoch, "step": step}).encode()

    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        reads = []
        get = store.get
        store.get = lambda *a, **k: (reads.append(a), get(*a, **k))[1]
        first = await put_for_epoch(store, key, record(5, 9), epoch=5)
        assert first and reads   # no revision of its own yet: it reads
        reads.clear()
        second = await put_for_epoch(store, key, record(5, 10), epoch=5, mine=first)
        assert second > first and not reads   # the key is as it left it: one transaction
        await store.put(key, record(8, 11))   # the survivors' newer epoch
        assert await put_for_epoch(store, key, record(5, 12), epoch=5, mine=second) is None
        assert reads and json.loads((await get(key)).value) == {"epoch": 8, "step": 11}


# One side of a probe, as a real process: it binds the ports it was given (the daemon must have
# released them to it), notes that it ran, and prints a result (rank 0) or fails (`fail`).
_FAKE_PROBE = """
import json, socket, sys
spec = json.loads(sys.argv[-1])
mine = [spec["ports"][0], spec["ports"][2]] if spec["rank"] == 0 else [spec["ports"][1]]
for p in mine:
    s = socket.socket(); s.bind(("127.0.0.1", p)); s.listen(1)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(spec) + "\\n")
if sys.argv[2] == "fail":
    sys.exit(3)
if spec["rank"] == 0:
    print(json.dumps({"latency_s": 1e-4, "bandwidth_Bps": 1.25e8, "allreduce_latency_s": 2e-4, "allreduce_Bps": 1e8}))
"""


def _daemon_member(name: str, probe_ports: list[int]) -> DaemonMember:
    i = int(name[-1])
    return DaemonMember(name=name, host=f"127.0.0.{i}", endpoint=f"tcp://127.0.0.{i}:1", slots=1, device_kind="cpu",
                        memory_bytes=2**30, version="0.1.0", started_at=1000.0 + i, worker_ports=(40000 + i,),
                        rendezvous_port=40010 + i, probe_ports=tuple(probe_ports))


class _Side:
    """One daemon's prober (its own etcd client, its own probe ports held), running a fake probe."""

    def __init__(self, endpoint, keys, name, ran, outcome="ok"):
        self.store = EtcdStore(endpoint, timeout=3.0)
        self.reservation = PortReservation("127.0.0.1", count=2)
        self.member = _daemon_member(name, self.reservation.ports)
        self.prober = LinkProber(store=self.store, keys=keys, name=name, member=lambda: self.member,
                                 ports=self.reservation, is_busy=lambda: False, timeout=3.0,
                                 command=[sys.executable, "-c", _FAKE_PROBE, str(ran), outcome])
        self.task = asyncio.get_running_loop().create_task(self.prober.run())

    async def close(self):
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        await self.store.close()
        self.reservation.close()


async def test_a_stale_probe_request_is_deleted_not_run(etcd, etcd_root, tmp_path):
    keys = Keys(etcd_root)
    ran = tmp_path / "ran"
    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        await store.put(keys.leader, b"vm9")
        term = (await store.get(keys.leader)).create_revision
        side = _Side(etcd.endpoint, keys, "vm1", ran)
        key = etcd_root + "links/probe/vm1"
        try:
            me = side.member
            good = ProbeRequest(id="p0", rank=0, pair=("vm1", "vm2"), hosts=("127.0.0.1", "127.0.0.2"),
                                ports=(me.probe_ports[0], 40002, me.probe_ports[1]),
                                started=(me.started_at, 1002.0), term=term)
            stale = {
                "an earlier start of this daemon": ProbeRequest(**{**_fields(good), "id": "p1",
                                                                   "started": (me.started_at - 60, 1002.0)}),
                "an earlier leader": ProbeRequest(**{**_fields(good), "id": "p2", "term": term - 1}),
                # what the probe used to bind: the worker's stream port and the job's rendezvous
                "the workers' ports": ProbeRequest(**{**_fields(good), "id": "p3",
                                                      "ports": (me.worker_ports[0], 40002, me.rendezvous_port)}),
            }
            for why, req in stale.items():
                await store.put(key, req.encode())
                await until_async(lambda: _absent(store, key), f"the request from {why} is deleted", timeout=30.0,
                                  interval=0.1)
            assert not ran.exists(), f"a stale request was run: {ran.read_text()}"
            # the present leader's request for this start of the daemon, on its probe ports, runs
            await store.put(key, good.encode())
            await until_async(lambda: _absent(store, key), "the probe ran and withdrew its request", timeout=30.0, interval=0.1)
            assert [json.loads(line)["ports"] for line in ran.read_text().splitlines()] == [list(good.ports)]
            links = await read_links(store, keys, timeout=3.0)
            assert links[("vm1", "vm2")].bandwidth_Bps == 1.25e8
        finally:
            await side.close()


def _fields(req: ProbeRequest) -> dict:
    return {f: getattr(req, f) for f in req.__dataclass_fields__}


async def _absent(store, key) -> bool:
    return await store.get(key) is None


async def _survey_until(survey, members, predicate, what, timeout=30.0):
    async def done():
        await survey.survey(members, set())
        return predicate()
    await until_async(done, what, timeout, interval=0.1)


@pytest.mark.parametrize("outcome", ["ok", "fail"])
async def test_the_leader_plans_as_soon_as_a_probe_ends_and_leaves_no_request(etcd, etcd_root, tmp_path, outcome):
    """A failed probe is known as soon as a side withdraws its request (not after PROBE_TIMEOUT):
    the job waiting for it is planned with the calibration's link; either way no request is
    left behind for a later start of the daemons to run."""
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        await store.put(keys.leader, b"vm1")
        term = (await store.get(keys.leader)).create_revision
        # an earlier leader's request nobody waits for
        await store.put(etcd_root + "links/probe/vm3", b'{"id": "old"}')
        sides = [_Side(etcd.endpoint, keys, n, tmp_path / "ran", outcome) for n in ("vm1", "vm2")]
        try:
            members = {s.member.name: s.member for s in sides}
            survey = LinkSurvey(store, keys, timeout=3.0, term=lambda: term)
            await survey.survey(members, set())
            assert survey.waiting(["vm1", "vm2"]) == [("vm1", "vm2")]
            assert await store.get(etcd_root + "links/probe/vm3") is None
            await _survey_until(survey, members, lambda: not survey.waiting(["vm1", "vm2"]), "the probe ended")
            # a side ran (the other may have been told to stop before it started: the fake is fast)
            ranks = {json.loads(line)["rank"] for line in (tmp_path / "ran").read_text().splitlines()}
            assert ranks and (outcome == "fail" or 0 in ranks)
            assert len(await store.get_prefix(etcd_root + "links/probe/")) == 0
            if outcome == "ok":
                assert [m.members for m in survey.measured(["vm1", "vm2"])] == [("vm1", "vm2")]
            else:
                assert survey.measured(["vm1", "vm2"]) == [] and ("vm1", "vm2") in survey.failed
                await survey.survey(members, set())   # not asked again at once
                assert survey.waiting(["vm1", "vm2"]) == []
        finally:
            for s in sides:
                await s.close()
