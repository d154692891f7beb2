"""The 3-VM ring of the network-namespace tests (test_netns_fleet, test_netns_curve): ``N`` daemons,
one per namespace, started with ``DAEMON_FLAGS``; ``NetRing`` (a FabricRing whose tests share its
daemons) and ``run_job``, which trains the tiny GPT across them and checks the reference losses."""

from __future__ import annotations

import time

from support.fabric import Fabric
from support.linkrun import FabricRing

TTL = 4.0
STEPS, BATCH, EVERY = 12, 12, 3
N = 3
DAEMON_FLAGS = ("--slots", "1", "--threads", "1", "--ttl", str(TTL), "--calibrate", "profile", "--memory",
                str(2**30), "--stop-grace", "30", "--abort-grace", "2", "--max-restarts", "1",
                "--progress-interval", "0.5", "--debounce", "0.3")


class NetRing(FabricRing):
    """A FabricRing whose tests share its daemons, started with `daemon_args`."""

    def __init__(self, fabric: Fabric, root: str, daemon_args: tuple[str, ...]) -> None:
        super().__init__(fabric, root, ttl=TTL)
        self.daemon_args = daemon_args

    def start_vm(self, i: int):
        """VM i's daemon, started unless it runs already (the module's tests share one ring)."""
        d = self.fabric.daemons.get(f"vm{i}")
        if d is not None and d.alive:
            return d
        # each namespace plays a VM of its own machine: these tests are about networks, and their
        # jobs' shapes (a pipeline across VMs) must not shrink to what this host's two cores take
        return self.fabric.start_daemon(i, "--root", self.root, "--store", str(self.store_dir),
                                        "--machine-id", f"netns-vm{i}", *self.daemon_args)


def run_job(ring: NetRing, job: str, reference: list[float]) -> dict:
    names = [f"vm{i}" for i in range(1, N + 1)]
    for i in range(1, N + 1):
        ring.start_vm(i)
    ring.wait_members(names, timeout=60)
    members = ring.call(ring.store.get_prefix(ring.keys.members))
    hosts = sorted(__import__("json").loads(kv.value)["host"] for kv in members)
    assert hosts == sorted(ring.fabric.address(i) for i in range(1, N + 1)), \
        "each daemon must advertise its namespace's address (the route to etcd), not loopback"
    started = time.monotonic()
    ring.submit(job, steps=STEPS, batch=BATCH, every=EVERY)
    st = ring.wait_state(job, ("done", "failed"), timeout=240)
    took = time.monotonic() - started
    assert st["state"] == "done", f"{st.get('reason')}\n{ring.tails()}"
    assert st["restarts"] == 0, st
    print(f"\n{job}: {st['plan']['P']}x{st['plan']['D']} on {st['plan']['members']} in {took:.1f}s")
    assert st["plan"]["P"] >= 2, "the calibration should make the planner pipeline the model across VMs"
    assert len(set(st["plan"]["members"])) >= 2
    history = st["loss_history"]
    assert [s for s, _ in history] == list(range(STEPS))
    for step, loss in history:
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    return st
