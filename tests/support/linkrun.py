"""One run of the link experiment (tests/integration/netns/test_netns_links.py and benchmarks/network.py):
two namespaces, one one-thread slot each, links capped at a rate, the wide job
(tests/integration/netns/wide_job.py) submitted; what the leader measured, planned and estimated, and the
step time the job then took."""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from dataclasses import dataclass

from support import TESTS
from support.fabric import Fabric
from support.ring import Ring

WIDE_JOB = TESTS / "integration" / "netns" / "wide_job.py"
# No spare workers: a run is one epoch of a dozen short steps, which their imports would overlap
# (the measured steady step would be the import's, which no plan models).
DAEMON_FLAGS = ("--slots", "1", "--threads", "1", "--ttl", "4", "--calibrate", "profile", "--plaintext",
                "--progress-interval", "0.5", "--debounce", "0.3", "--max-restarts", "1", "--no-spare-workers")


@dataclass
class LinkRun:
    rate: str | None
    bandwidth_Bps: float
    allreduce_Bps: float
    shape: str
    micro_batch: int
    estimated_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return abs(self.estimated_s - self.measured_s) / self.measured_s


class FabricRing(Ring):
    """tests/support/ring.py's helpers (status, polls, submit) over a Fabric's etcd and daemons."""

    def __init__(self, fabric: Fabric, root: str, ttl: float = 4.0) -> None:
        assert fabric.etcd is not None
        super().__init__(fabric.base / root.strip("/"), fabric.etcd.endpoint, root=root, ttl=ttl)
        self.fabric = fabric
        self.daemons = fabric.daemons

    def tails(self, lines: int = 25) -> str:
        return self.fabric.tails(lines)

    def close(self) -> None:
        self.fabric.stop_daemons()
        self.call(self.store.close())
        self.loop.close()


def run_once(fabric: Fabric, ring: FabricRing, rate: str | None, *, steps: int = 12, batch: int = 16,
             job_args: tuple[str, ...] = ()) -> LinkRun:
    """Cap both links at `rate`, (re)start both daemons (a restart is a new VM: its links are
    measured again), run the wide job, stop the daemons."""
    fabric.stop_daemons()
    fabric.cap_all(rate)
    for i in (1, 2):
        fabric.start_daemon(i, "--root", ring.root, "--store", str(ring.store_dir), *DAEMON_FLAGS)
    ring.wait_members(["vm1", "vm2"], timeout=120)
    job = f"wide-{rate or 'uncapped'}-{int(time.time() * 1000) % 100000}"
    r = ring.varunactl("submit", "--name", job, "--batch-size", str(batch), "--chunk-size", "auto", "--steps",
                       str(steps), "--checkpoint-every", str(10 * steps), str(WIDE_JOB), "--", *job_args)
    assert r.returncode == 0, r.stderr
    st = ring.wait_state(job, ("done", "failed"), timeout=400)
    assert st["state"] == "done", f"{st.get('reason')}\n{ring.tails()}"
    links = ring.call(ring.store.get_prefix(ring.root + "links/pair/"))
    assert len(links) == 1, f"expected the one measured link vm1 <-> vm2, got {[kv.key for kv in links]}"
    link = json.loads(links.items[0].value)
    plan = st["plan"]
    measured = steady_step_s(fabric, job, st["epoch"])
    fabric.stop_daemons()
    return LinkRun(rate=rate, bandwidth_Bps=link["bandwidth_Bps"], allreduce_Bps=link["allreduce_Bps"],
                   shape=f"{plan['P']}x{plan['D']}", micro_batch=plan["micro_batch_size"],
                   estimated_s=plan["estimated_s"], measured_s=measured)


# Steps whose time is not the steady state the plan estimates: the first ones after the
# workers start (connections, the allocator's first growth, caches) run slower.
WARMUP_STEPS = 2
_STEP_LINE = re.compile(r"^step (\d+) loss \S+ t=([0-9.]+)$", re.M)


def steady_step_s(fabric: Fabric, job: str, epoch: int) -> float:
    """The median step of the job's epoch after WARMUP_STEPS: the intervals between the ends of
    consecutive steps as rank 0 printed them (tests/integration/netns/wide_job.py), like the simulator
    benchmark's measured side (benchmarks/simulator.py), not the epoch's mean, which the slow
    first steps pull up. The last step is left out too: it ends in the job's final checkpoint."""
    logs = sorted(fabric.base.glob(f"vm*/logs/{job}/e{epoch}-r0.log"))
    assert len(logs) == 1, f"expected one rank-0 log of {job} epoch {epoch}, found {logs}"
    ends = {int(s): float(t) for s, t in _STEP_LINE.findall(logs[0].read_text())}
    steps = sorted(ends)
    assert len(steps) >= WARMUP_STEPS + 4 and steps == list(range(steps[0], steps[-1] + 1)), steps
    times = [ends[s] - ends[s - 1] for s in steps[WARMUP_STEPS + 1:-1]]
    return statistics.median(times)


def table(runs: list[LinkRun], out=sys.stdout) -> None:
    print(f"{'link':>9} {'measured MB/s':>13} {'allreduce MB/s':>14} {'plan':>5} {'mb':>3} {'estimated_s':>11} "
          f"{'measured_s':>10} {'error':>6}", file=out)
    for r in runs:
        print(f"{r.rate or 'uncapped':>9} {r.bandwidth_Bps / 1e6:13.3f} {r.allreduce_Bps / 1e6:14.3f} {r.shape:>5} "
              f"{r.micro_batch:3d} {r.estimated_s:11.4f} {r.measured_s:10.4f} {r.error:6.2f}", file=out)
