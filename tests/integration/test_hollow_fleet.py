"""Hollow VMs (tests/support/hollow.py, the scale benchmark's harness) against a real etcd: the
real daemons plan, morph and record a job as they do with real workers, so that what
benchmarks/fleet_scale.py measures at 300 VMs is the control plane real fleets run.

Each hollow VM here is a process of its own (so it can be killed alone) on an address of its own
in 127.0.0.0/8. Each plan is the one the planner makes from what etcd holds for those VMs (their facts, the
stored calibration, the measured links), as with real workers. The morph records are held to
what tests/integration/test_daemon_ring.py holds real workers' to: the lost VM named as the
cause, the survivors' memory as the source when every stage kept a replica, the new epoch
starting at the step the rescue saved."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.etcd_server import die_with_parent
from support.hollow import hollow_loss
from support.waiting import until

from varunad.control import status as ctl
from varunad.control.fleet import read_fleet
from varunad.control.jobs import script_fingerprint
from varunad.control.links import apply_links, read_links
from varunad.control.plans import calibrations_for, make_plan
from varunad.control.resume import complete_manifest
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

REPO = Path(__file__).resolve().parents[2]
HOLLOW = REPO / "tests" / "support" / "hollow.py"


class HollowVMs:
    """Hollow VMs, one process each, and a connection to their etcd for what they wrote."""

    def __init__(self, base: Path, etcd: str, root: str) -> None:
        self.base, self.etcd, self.root = base, etcd, root
        self.keys = Keys(root)
        self.procs: dict[str, subprocess.Popen] = {}
        self.loop = asyncio.new_event_loop()
        self.store = EtcdStore(etcd, timeout=3.0)
        self.call(self.store.connect())

    def call(self, aw):
        return self.loop.run_until_complete(aw)

    def start(self, name: str, host: str) -> None:
        log = open(self.base / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [*die_with_parent(), sys.executable, str(HOLLOW), "--names", name, "--hosts", host,
             "--state-base", str(self.base / "vms"), "--log-level", "INFO", "--step-max", "0.2",
             "--etcd", self.etcd, "--root", self.root, "--ttl", "3", "--slots", "1", "--memory", str(5 << 30),
             "--device-kind", "hollow", "--store", str(self.base / "store"), "--plaintext",
             "--straggler-threshold", "0", "--scale-up-threshold", "0"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))

    def status(self, job: str) -> dict:
        return self.call(ctl.job_status(self.store, self.keys, job))

    def leader(self) -> str | None:
        kv = self.call(self.store.get(self.keys.leader))
        return None if kv is None else kv.value.decode()

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                         for p in sorted(self.base.glob("*.log")))

    def poll(self, check, what: str, timeout: float = 90.0):
        return until(check, what, timeout, 0.1, retry_on=(Exception,), on_timeout=self.tails)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.call(self.store.close())
        self.loop.close()


@pytest.fixture
def vms(tmp_path, etcd, etcd_root):
    fleet = HollowVMs(tmp_path, etcd.endpoint, etcd_root)
    yield fleet
    fleet.close()


def _submit(vms: HollowVMs, job: str, steps: int, every: int) -> None:
    script = vms.base / "job" / "hollow_job.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text('raise SystemExit("a hollow VM\'s job is not run by python")\n')
    r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--etcd", vms.etcd, "--root", vms.root, "submit",
                        "--name", job, "--batch-size", "256", "--steps", str(steps), "--checkpoint-every", str(every),
                        "--no-import-check", str(script)], capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert r.returncode == 0, r.stderr


def _planner_says(vms: HollowVMs, job: str, names: list[str]) -> dict:
    """The plan the planner makes for `job` on the members `names` from what etcd holds (their
    facts, the stored calibration, the measured links): what the leader must have written."""
    snap = vms.call(read_fleet(vms.store, vms.keys, timeout=5.0))
    spec = snap.entry(job).spec
    listing = vms.call(vms.store.get_prefix(vms.keys.calibration_of(script_fingerprint(spec))))
    cals, missing = calibrations_for(spec, ["hollow"], {kv.key.rsplit("/", 1)[-1]: kv.value for kv in listing})
    assert not missing
    links = vms.call(read_links(vms.store, vms.keys, timeout=5.0)).values()
    cals = apply_links(cals, [m for m in links if set(m.members) <= set(names)])
    doc, _ = make_plan(spec, [(m, lease) for m, lease in snap.usable() if m.name in names], cals, calibrated=True,
                       reason="the test's")
    return {"P": doc.plan.P, "D": doc.plan.D, "micro_batch_size": doc.plan.micro_batch_size,
            "estimated_s": doc.estimated_s, "members": sorted(doc.members)}


def _as_planned(plan: dict) -> dict:
    return {k: sorted(plan[k]) if k == "members" else plan[k]
            for k in ("P", "D", "micro_batch_size", "estimated_s", "members")}


# 0.2 s a step: long enough for a kill's morph, then a join's, before the job ends
STEPS = 120


@pytest.mark.slow   # five VM processes through a job of STEPS steps and two morphs: about 30 s
def test_hollow_vms_plan_morph_and_finish_as_real_daemons_do(vms):
    for i in range(1, 5):
        vms.start(f"h{i}", f"127.3.0.{i}")
    # idle VMs measure their links (hollow probes, the leader's real survey): all 6 pairs of 4
    vms.poll(lambda: len(vms.call(vms.store.get_prefix(vms.keys.link_pairs))) == 6, "the links measured")
    _submit(vms, "hj", steps=STEPS, every=10)
    st = vms.poll(lambda: (s := vms.status("hj"))["state"] == "running" and s["step"] >= 12 and s, "hj training")
    plan = st["plan"]
    # the hollow calibration went the real way: a calibration run on one VM, stored, then planned
    # (a batch of 256 makes the planner's best 2x2: every stage has a replica to lose)
    assert plan["calibrated"] is True and (plan["P"], plan["D"]) == (2, 2), plan
    assert sorted(plan["members"]) == ["h1", "h2", "h3", "h4"], plan
    assert _as_planned(plan) == _planner_says(vms, "hj", plan["members"])
    epoch, leader = st["epoch"], vms.leader()

    victim = next(m for m in plan["members"] if m != leader)
    vms.procs[victim].kill()
    st = vms.poll(lambda: (s := vms.status("hj"))["epoch"] != epoch and s["step"] > 0 and
                  any(m["from_epoch"] == epoch for m in s["morphs"]) and s, f"a morph without {victim}")
    lost = next(m for m in st["morphs"] if m["from_epoch"] == epoch)
    assert lost["cause"] == f"{victim} was lost" and victim not in st["plan"]["members"], lost
    assert _as_planned(st["plan"]) == _planner_says(vms, "hj", st["plan"]["members"])
    # every stage of a D=2 plan kept a replica: the survivors' memory, unless the step they held was
    # one the periodic checkpoint (every 10) had committed, when their rescue saves nothing (as the
    # trainer's does) and that checkpoint is the newest; else the store's checkpoint
    if plan["D"] >= 2 and lost["source"] == "checkpoint":
        assert lost["resumed_from"] % 10 == 0, lost
    else:
        assert lost["source"] == ("replicas" if plan["D"] >= 2 else "checkpoint"), lost
    manifest = complete_manifest(str(vms.base / "store" / "hj"), lost["resumed_from"])
    assert manifest is not None and manifest["meta"]["source"] == lost["source"], (lost, manifest)
    ranges = vms.poll(lambda: (s := vms.status("hj"))["epochs"].get(str(lost["to_epoch"])) and s["epochs"],
                      "the new epoch's first step")
    assert ranges[str(lost["to_epoch"])][0] == lost["resumed_from"], (ranges, lost)
    assert ranges[str(epoch)][1] + 1 >= lost["resumed_from"], (ranges, lost)   # nothing skipped

    # a VM boots: with --scale-up-threshold 0 the leader takes it in
    vms.start("h5", "127.3.0.5")
    vms.poll(lambda: "h5" in vms.status("hj")["plan"]["members"], "a plan with h5")
    st = vms.poll(lambda: (s := vms.status("hj"))["state"] in ("done", "failed") and s, "hj done", timeout=150)
    print(f"\nhj: plans {plan['P']}x{plan['D']} first; morphs: " + "; ".join(
        f"{m['from']} -> {m['to']} ({m['cause'] or m['reason'][:50]}, from {m['source']} at {m['resumed_from']})"
        for m in st["morphs"]))
    assert st["state"] == "done" and st["restarts"] == 0, st
    history = dict(st["loss_history"])
    assert set(history) == set(range(STEPS)), sorted(set(range(STEPS)) - set(history))
    assert all(abs(loss - hollow_loss(step)) < 1e-9 for step, loss in history.items())
