"""Bad values in etcd are rejected by type, in one place, and never stop a reader (issue 17).

Against a real etcd where the reader needs one: the plan's history, the leader key, the member key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import pytest
from support.fleet import fleet, make_member, one_leader
from support.waiting import until_async

from varunad.cluster.membership import Member, Membership
from varunad.control.fleet import read_plan
from varunad.control.jobs import JobSpecError, JobState
from varunad.control.plans import PlanDoc
from varunad.control.records import Progress, WorkerReport
from varunad.store import schemas
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

# The values the chaos run wrote (issue 17, item 1), and more of the same kind.
BAD_PLANS = [
    b'{"kind":"idle","reason":12345}',
    b'{"kind":"stop","reason":"x","job":"j","stop_epoch":"abc","checkpoint":true}',
    b'{"kind":"stop","reason":"x","job":"j","stop_epoch":3,"checkpoint":"yes"}',
    b'{"kind":"run","reason":"x","job":"j","slots":[{"rank":"0"}]}',
    b'{"kind":"run","reason":"x","job":"j","incarnations":{"vm1":"lease"}}',
    b'{"kind":"idle"}',
    b'{"kind":7,"reason":"x"}',
    b'[1,2]', b'null', b'\xff\xfe', b'',
]


@pytest.mark.parametrize("value", BAD_PLANS)
def test_a_plan_of_wrong_types_is_refused_by_name(value):
    with pytest.raises(ValueError, match="plan is malformed"):
        PlanDoc.decode(value)


def test_the_error_names_the_field_and_what_it_should_be():
    with pytest.raises(ValueError, match=r"'reason': expected a string, got 12345"):
        PlanDoc.decode(BAD_PLANS[0])
    with pytest.raises(ValueError, match=r"'stop_epoch': expected an integer, got 'abc'"):
        PlanDoc.decode(BAD_PLANS[1])


def test_every_document_kind_checks_types():
    with pytest.raises(ValueError, match="'epoch': expected an integer"):
        WorkerReport.decode(json.dumps({"member": "a", "epoch": "x"}).encode())
    with pytest.raises(ValueError, match="'outcome': expected a string"):
        WorkerReport.decode(json.dumps({"member": "a", "workers": [{"rank": 0, "slot": 0, "outcome": 1}]}).encode())
    with pytest.raises(ValueError, match="'loss': expected a number"):
        Progress.decode(json.dumps({"job": "j", "epoch": 1, "rank": 0, "step": 1, "loss": "x", "samples_per_s": 1,
                                    "busy_fraction": 1}).encode())
    with pytest.raises(JobSpecError, match="'restarts': expected an integer"):
        JobState.decode(json.dumps({"job": "j", "restarts": "many"}).encode())
    good = make_member("a")
    doc = json.loads(good.encode())
    doc["started_at"] = "yesterday"
    with pytest.raises(ValueError, match="'started_at': expected a number"):
        Member.decode(json.dumps(doc).encode())
    assert Member.decode(good.encode()) == good


def test_good_documents_still_round_trip():
    for doc in (PlanDoc.idle("x"), PlanDoc.stop("j", 5, checkpoint=True, reason="r")):
        assert PlanDoc.decode(doc.encode()) == doc
    assert JobState.decode(JobState(job="j", epochs=(3, 4)).encode()).epochs == (3, 4)


def test_rejections_are_counted_and_logged_once(caplog):
    seen = []
    schemas.on_reject(seen.append)
    before = schemas.rejected().get("plan", 0)
    with caplog.at_level(logging.WARNING, logger="varunad.store.schemas"):
        for _ in range(50):
            schemas.reject("plan", "/t/plan@99", "plan is malformed: x")
    assert schemas.rejected()["plan"] == before + 50
    assert seen.count("plan") == 50
    assert sum("ignored plan key /t/plan@99" in r.getMessage() for r in caplog.records) == 1


async def test_a_garbage_plan_leaves_the_previous_one_in_force(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with fleet(etcd.endpoint, keys, ["a"]) as nodes, EtcdStore(etcd.endpoint) as store:
        leader = await one_leader(nodes, timeout=10.0)
        good = PlanDoc.stop("j", 7, checkpoint=True, reason="a real one")
        rev = await leader.election.write_plan(good.encode())
        for value in BAD_PLANS[:3]:
            await store.put(keys.plan, value)
        doc, epoch = await read_plan(store, keys, timeout=3.0)
        assert (doc, epoch) == (good, rev)
        later = await leader.election.write_plan(PlanDoc.idle("next").encode())
        assert await read_plan(store, keys, timeout=3.0) == (PlanDoc.idle("next"), later)


async def test_a_leader_key_without_a_lease_is_removed_and_someone_leads(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.leader, "ghost")   # etcdctl put /varunad/leader ghost
        async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes:
            leader = await one_leader(nodes, timeout=10.0)
            kv = await store.get(keys.leader)
            assert kv.value.decode() == leader.membership.name and kv.lease == leader.membership.lease.id


async def test_a_leader_key_on_a_stranger_lease_is_removed(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        stranger = await store.grant(30)
        await store.put(keys.leader, "nobody", lease=stranger)
        try:
            async with fleet(etcd.endpoint, keys, ["a", "b"]) as nodes:
                leader = await one_leader(nodes, timeout=10.0)
                assert leader.membership.name in ("a", "b")
        finally:
            await store.revoke(stranger)


@pytest.mark.parametrize("how", ["overwrite", "delete"])
async def test_a_member_whose_key_is_overwritten_or_deleted_registers_again(etcd, etcd_root, how):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store, EtcdStore(etcd.endpoint) as mine:
        m = Membership(mine, keys, make_member("vm1"), ttl=2.0)
        await m.join()
        guard = asyncio.create_task(m.guard_key())
        try:
            if how == "overwrite":
                await store.put(keys.member("vm1"), b"junk")
            else:
                await store.delete(keys.member("vm1"))

            async def restored():
                kv = await store.get(keys.member("vm1"))
                return kv is not None and kv.lease == m.lease.id and Member.decode(kv.value) == m.member

            await until_async(restored, timeout=5.0, what="vm1's key written again under its lease")
        finally:
            guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await guard
            await m.leave()


def test_json_nested_past_the_parsers_depth_is_a_value_error_for_every_reader():
    # json.loads raises RecursionError on it, which no reader caught: one such value in etcd
    # would have ended whatever loop read it.
    from varunad.cluster.fencing import stored_epoch
    from varunad.control.jobs import JobSpec
    from varunad.control.records import decode_history
    from varunad.node.signing import Signature

    deep = b"[" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        schemas.load_json(deep)
    for decode in (PlanDoc.decode, Member.decode, JobSpec.decode, JobState.decode, decode_history,
                   Signature.decode, lambda d: schemas.decode(Progress, d, "progress")):
        with pytest.raises(ValueError):
            decode(deep)
    assert stored_epoch(deep) is None
