"""The 3-VM pipeline across network namespaces with CURVE streams (see test_netns_fleet.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO
from support.fabric import Fabric, unavailable_reason
from support.netns_ring import BATCH, DAEMON_FLAGS, STEPS, N, NetRing, run_job
from support.reference import reference_run

pytestmark = pytest.mark.slow

_WHY = unavailable_reason()
if _WHY is not None:
    pytest.skip(f"network-namespace tests skipped: {_WHY}", allow_module_level=True)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for name in [f"vm{i}" for i in range(1, N + 1)]:
        r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "keys", "generate", "--dir", str(d), "--name", name],
                           capture_output=True, text=True, cwd=str(REPO))
        assert r.returncode == 0, r.stderr
    return d



def test_a_pipeline_across_namespaces_finishes_with_the_reference_losses_curve(tmp_path, curve_keys):
    fabric = Fabric(N, tmp_path / "netns")
    fabric.up()
    ring = None
    try:
        ring = NetRing(fabric, "/curve/", (*DAEMON_FLAGS, "--curve-keys", str(curve_keys)))
        run_job(ring, "curve", reference_run(STEPS, BATCH)[0])
    finally:
        if ring is not None:
            ring.close()
        fabric.close()
