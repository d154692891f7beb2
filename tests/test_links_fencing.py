"""Epoch-guarded writes (varunad.fencing) against a real etcd, and measured links in plans (varunad.links)."""

from __future__ import annotations

import json

import pytest

from trainer.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile
from varunad.fencing import put_for_epoch
from varunad.links import LinkMeasurement, apply_links
from varunad.store import EtcdStore


async def test_an_old_epoch_never_overwrites_a_newer_record(etcd, etcd_root):
    key = etcd_root + "progress/j/1"
    async with EtcdStore(etcd.endpoint, timeout=3.0) as store:
        assert await put_for_epoch(store, key, json.dumps({"epoch": 5, "step": 9}).encode(), epoch=5)
        # a rejoining VM flushing what its old epoch had queued
        assert not await put_for_epoch(store, key, json.dumps({"epoch": 3, "step": 36}).encode(), epoch=3)
        assert json.loads((await store.get(key)).value) == {"epoch": 5, "step": 9}
        assert await put_for_epoch(store, key, json.dumps({"epoch": 5, "step": 10}).encode(), epoch=5)
        assert await put_for_epoch(store, key, json.dumps({"epoch": 8, "step": 11}).encode(), epoch=8)
        assert json.loads((await store.get(key)).value)["epoch"] == 8


def _cal() -> Calibration:
    links = {"intra": LinkCost(50e-6, 5e9, 1e-4, 2e-4), "inter": LinkCost(50e-6, 5e9, 1e-4, 2e-4)}
    costs = (SegmentCost(1e-3, 2e-3, 1e-3, 1000, 1000),)
    return Calibration(model="m", device_kind="cpu", micro_batch_sizes=(1,), input_bytes=(100,),
                       segments=(SegmentProfile(1000, 1000, 0.0, costs),) * 2, links=links, allreduce=links)


def _m(a, b, bw, ar):
    return LinkMeasurement(members=(a, b), hosts=("10.0.0.1", "10.0.0.2"), started=(1.0, 2.0), latency_s=1e-3,
                           bandwidth_Bps=bw, allreduce_latency_s=2e-3, allreduce_Bps=ar, at=0.0)


def test_plans_use_the_slowest_measured_link_and_keep_the_cpu_overheads():
    cal = _cal()
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
