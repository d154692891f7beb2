"""The links between VMs are measured, and the plan follows them.

Two namespaces, one one-thread slot each (two workers on two cores: the network's share is not
blurred by oversubscription), the wide job (activations large for its compute). Under 1 Gbit/s
and 10 Mbit/s caps: the measured links differ by the caps' ratio (+-30%: a tc cap is a physical
limit, not a timing of our code) and a plan that crosses the link at 1 Gbit/s changes or costs
more at 10 Mbit/s. (On an idle machine the planner may keep both VMs' work on one at both speeds,
1x1: then only the ratio and a non-decreasing estimate are checked here.) How close the estimate
comes to the measured step is a timing on a shared machine, so benchmarks/network.py reports it
(`max_error`) rather than this test asserting it; the table printed here shows it too.
"""

from __future__ import annotations

import pytest
from support.fabric import Fabric, unavailable_reason
from support.linkrun import FabricRing, run_once, table

pytestmark = pytest.mark.slow

_WHY = unavailable_reason()
if _WHY is not None:
    pytest.skip(f"network-namespace tests skipped: {_WHY}", allow_module_level=True)


def test_measured_links_follow_the_caps_and_the_plan_follows_the_links(tmp_path):
    fabric = Fabric(2, tmp_path / "netns")
    fabric.up()
    ring = None
    try:
        ring = FabricRing(fabric, "/links/")
        fast = run_once(fabric, ring, "1gbit")
        slow = run_once(fabric, ring, "10mbit")
        table([fast, slow])
        ratio = fast.bandwidth_Bps / slow.bandwidth_Bps
        assert 100 / 1.3 <= ratio <= 100 * 1.3, f"1 Gbit / 10 Mbit measured as {ratio:.1f}x, not 100x +-30%"
        assert slow.estimated_s >= fast.estimated_s * (1 - 1e-9), "a 100x slower link made the plan look faster"
        if fast.shape != "1x1":
            # the plan crossed the link at 1 Gbit/s: at 10 Mbit/s it must change or cost more
            assert (fast.shape, fast.micro_batch) != (slow.shape, slow.micro_batch) or \
                slow.estimated_s > 1.5 * fast.estimated_s, "the plan ignored a 100x slower link"
    finally:
        if ring is not None:
            ring.close()
        fabric.close()
