"""Epoch-guarded writes (varunad.cluster.fencing) against a real etcd, and measured links in plans (varunad.control.links).

The in-process tests of tests/integration/test_links_fencing.py (tests/README.md).
"""

from __future__ import annotations

import json

import pytest
from support.calibrations import calibration

from trainer.planning.calibration import LinkCost
from varunad.control.links import LinkMeasurement, apply_links


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
