"""Stragglers (issue 33, "a slow VM must not slow the fleet"): what one slow VM costs a job's
throughput, and how long the fleet takes to re-plan around a VM that turns slow mid-job.

A ring of real varunad processes on loopback (one slot and one torch thread each, a private etcd,
CURVE off, lease TTL 5 s) trains examples/train_hf.py --size tiny --seq-len 64: Hugging Face's
GPT-2 class from a small config (4 blocks of 64 wide, random weights), a model and script the
planner was not shaped around, captured with torch.export; a global batch of 24. Each daemon is
moved, as soon as it is started (so with the workers and spares it starts), into a cgroup v1 cpu
group of its own (tests/support/cpu_quota.py), as if each were a VM: under contention the kernel
shares the cores between the groups, not between the processes, so a daemon's spare importing
torch takes from its own worker, not from the other VMs'. The slow VM's group is capped at --quota
of one core; the others are unlimited (the machine has 2 cores, and other work may share them).
Four cases, each in a fleet of its own (a fresh etcd, so that nothing the leader learnt in one
case carries over to the next):

* healthy     d1, d2: the job on the two healthy daemons alone (a ring of 2); the default
              `--calibrate profile` measures the script on a healthy slot first
* neighbour   d1, d2 as healthy, the same calibration, beside a busy loop held to d3's quota: the
              most the slow VM's group can take from the healthy two on this one host (separate
              VMs would take nothing), so with slow over neighbour is the ratio to this host's limit
* with slow   d1, d2, then d3: the healthy fleet's calibration is put in this fleet's etcd first
              (it is keyed by script, arguments and device kind: every case plans from the same
              measurement, and the slow slot never profiles); d3 is then started and moved into
              its group, capped from the start, before the job is submitted; the leader plans it
              over all three as it sees fit (and may re-plan it while it runs)
* turns slow  d1, d2, d3: the same calibration, d3's group uncapped; a job on all three; once it
              runs on d3 and reaches step --slow-after the cap is set, and the benchmark waits up to
              --replan-timeout seconds for a re-plan: a new run plan (a morph, not a restart of
              the same plan) after the slowdown. The table says whether that plan keeps d3 and
              with how many of its ranks (a plan that gives it fewer layers keeps the count).
              Should the leader plan around d3 before the cap (it judged the uncapped VM slow),
              the benchmark says so, caps nothing that runs, and reports replan_s=nan.

Throughput is samples per second in steady state: read from the job's progress records in etcd
(progress/<job>/<rank>: each holds the newest step of one rank and the wall-clock time its daemon
heard of it), polled every 0.2 s, rank 0's (step, time) pairs of the epoch, from the first step
at or after a warm-up (a fifth of the steps, or 3 steps into a later epoch) to the last, times
the global batch, in the job's last epoch (the plan it settled on). Beside it, "epoch rate" is what
the end-of-job report (varunad/report/record.py) computes for that epoch: its steps over its
loss-history span (first to newest reported step), warm-up included; and "job rate", every step
over the wall time from the first step's report to the last, re-plans and all.

replan_s: from the moment the cap is set (the VM turns slow) to the first step of the new
plan's epoch (its loss-history span's start): detection, the stop, the plan, the new workers'
start and load all included. nan when no re-plan came within --replan-timeout.

Run:  python benchmarks/stragglers.py [--quick]     (root, with a writable cgroup v1 cpu controller)
The last line is `bench stragglers: with_slow_vs_without=<steady samples/s with the slow VM /
the healthy two's> replan_s=<seconds or nan>`. A fleet's daemon logs are printed when a wait
times out; --keep DIR keeps every fleet's state (daemon and worker logs) there.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support import REPO  # noqa: E402
from support.cpu_quota import CpuQuota  # noqa: E402
from support.etcd_server import EtcdServer  # noqa: E402
from support.ring import Ring  # noqa: E402

from varunad.control.fleet import read_plan  # noqa: E402
from varunad.control.records import Progress  # noqa: E402

SCRIPT = REPO / "examples" / "train_hf.py"
SCRIPT_ARGS = ("--size", "tiny", "--seq-len", "64")
BATCH = 24
HEALTHY, SLOW = ["d1", "d2"], "d3"
ALL = HEALTHY + [SLOW]
EXTRA = ["--calibrate", "profile", "--memory", str(2**30), "--stop-grace", "30", "--abort-grace", "2",
         "--progress-interval", "0.5", "--debounce", "0.2", "--straggler-threshold", "1.5"]   # the default; the
# test ring turns it off (tests/support/ring.py): its daemons share a host, here each has a cgroup
POLL_S = 0.2


@dataclass
class Samples:
    """What the benchmark read of one job while it ran: rank 0's (step, wall time) per epoch."""

    job: str
    points: dict[int, dict[int, float]] = field(default_factory=dict)   # epoch -> step -> time heard

    def read(self, ring: Ring) -> None:
        for kv in ring.call(ring.store.get_prefix(ring.keys.progress_of(self.job))):
            try:
                p = Progress.decode(kv.value)
            except ValueError:
                continue
            if p.rank == 0:
                self.points.setdefault(p.epoch, {}).setdefault(p.step, p.at)

    def rate(self, epoch: int, *, from_step: int = 0, t_from: float = 0.0, t_to: float = math.inf) -> float:
        """Samples/s between the first and last of the epoch's points in the window, nan if < 2."""
        pts = sorted((s, t) for s, t in self.points.get(epoch, {}).items() if s >= from_step and t_from <= t <= t_to)
        if len(pts) < 2 or pts[-1][0] <= pts[0][0] or pts[-1][1] <= pts[0][1]:
            return math.nan
        return (pts[-1][0] - pts[0][0]) * BATCH / (pts[-1][1] - pts[0][1])


def epoch_rate(st: dict, epoch: int) -> float:
    """The report's samples/s of one epoch: its steps over its loss-history span."""
    first, last = st["epochs"].get(str(epoch), (None, None))
    t0, t1 = (st.get("epoch_spans") or {}).get(str(epoch), (None, None))
    if first is None or t0 is None or last <= first or t1 <= t0:
        return math.nan
    return (last - first) * BATCH / (t1 - t0)


def job_rate(st: dict) -> float:
    """Every step the job trained (redone ones counted once) over the wall time from its first
    step's report to its last, re-plans and restarts included."""
    spans = [tuple(v) for v in (st.get("epoch_spans") or {}).values()]
    ranges = [tuple(v) for v in st["epochs"].values()]
    if not spans or not ranges:
        return math.nan
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    first, last = min(a for a, _ in ranges), max(b for _, b in ranges)
    return (last - first) * BATCH / (t1 - t0) if t1 > t0 and last > first else math.nan


def shape(st: dict) -> str:
    plan = st["plan"]
    if not plan.get("P"):
        return "-"
    shares = plan.get("shares")
    return f"{plan['P']}x{plan['D']}" + (f" shares {','.join(map(str, shares))}" if shares else "")


def morph_lines(st: dict, since: float) -> list[str]:
    out = []
    for m in st["morphs"]:
        at = st["epochs"].get(str(m["to_epoch"]), ["?"])[0]
        kind = "restart" if m["restart"] else "morph"
        out.append(f"{kind} {m['from']} -> {m['to']} at +{m['noticed_at'] - since:.1f}s, the new epoch from step {at}: "
                   f"{m['reason'][:160]}")
    for slot, factor in sorted((st.get("stragglers") or {}).items()):
        out.append(f"straggler {slot}: {factor:.1f}x slower (status)")
    if st.get("paces"):
        out.append("paces " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(st["paces"].items())))
    return out


def submit(ring: Ring, job: str, steps: int, every: int) -> float:
    r = ring.varunactl("submit", "--name", job, "--batch-size", str(BATCH), "--chunk-size", "auto", "--steps",
                       str(steps), "--checkpoint-every", str(every), str(SCRIPT), "--", *SCRIPT_ARGS)
    if r.returncode != 0:
        raise SystemExit(f"submit {job}: {r.stderr}")
    return time.time()


def watch(ring: Ring, job: str, samples: Samples | None, until, *, timeout: float, what: str) -> dict:
    """Poll the job's status (and progress) until ``until(status)`` holds; the status then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if samples is not None:
                samples.read(ring)
            st = ring.status(job)
        except Exception:   # noqa: BLE001 - etcd briefly busy, or the job not written yet: not yet
            st = None
        if st is not None:
            if st["state"] == "failed":
                raise SystemExit(f"{job} failed: {st['error']}\n{ring.tails()}")
            if until(st):
                return st
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}\n{ring.tails()}")
        time.sleep(POLL_S)


def slow_ranks(ring: Ring, job: str) -> tuple[int, int] | None:
    """(ranks on the slow VM, ranks in all) of the plan in force, None if it is not a run plan of the job."""
    doc, _ = ring.call(read_plan(ring.store, ring.keys, timeout=3.0))
    if doc is None or doc.kind != "run" or doc.job != job:
        return None
    return sum(1 for s in doc.slots if s.member == SLOW), len(doc.slots)


@contextlib.contextmanager
def fleet(base: Path, groups: dict[str, CpuQuota]) -> Iterator[Ring]:
    """A fresh etcd and the two healthy daemons, each in its cpu group."""
    server = EtcdServer()
    server.start()
    ring = Ring(base, server.endpoint, root="/bench/", ttl=5.0, extra=EXTRA, own_machines=True)
    try:
        for name in HEALTHY:
            groups[name].add(ring.start(name).proc.pid)
        ring.wait_members(HEALTHY)
        yield ring
    finally:
        ring.close()
        server.close()


def read_calibrations(ring: Ring) -> dict[str, bytes]:
    """Every calibration in the fleet's etcd, by key below the calibration prefix."""
    prefix = ring.keys.calibration
    return {kv.key[len(prefix):]: kv.value for kv in ring.call(ring.store.get_prefix(prefix))}


def calibrate_then_add_slow(ring: Ring, group: CpuQuota, cores: float | None,
                            calibrations: dict[str, bytes]) -> None:
    """The script's calibration: the healthy fleet's, put in this etcd, or (the healthy case not
    run) measured on the healthy two by a 2-step job of the same script and arguments. Then d3
    started and moved into the group, capped at ``cores`` (None: uncapped)."""
    if calibrations:
        for key, value in calibrations.items():
            ring.call(ring.store.put(ring.keys.calibration + key, value))
    else:
        submit(ring, "calibrate", 2, 2)
        watch(ring, "calibrate", None, lambda s: s["state"] == "done", timeout=300, what="the calibration job done")
        calibrations.update(read_calibrations(ring))
    group.set(cores)
    d3 = ring.start(SLOW)
    group.add(d3.proc.pid)   # before it starts anything: its workers and spares inherit the group
    ring.wait_members(ALL, timeout=60)


def full_run(ring: Ring, job: str, steps: int, every: int, timeout: float) -> dict:
    """Submit, wait for done; the row of the table."""
    samples = Samples(job)
    t0 = submit(ring, job, steps, every)
    seen: dict = {}

    def done(st: dict) -> bool:
        if st["state"] == "running" and SLOW in st["plan"]["members"] and st["epoch"] not in seen:
            seen[st["epoch"]] = slow_ranks(ring, job)
        return st["state"] in ("done", "cancelled")

    st = watch(ring, job, samples, done, timeout=timeout, what=f"{job} done")
    wall = time.time() - t0
    samples.read(ring)
    epochs = sorted(int(e) for e in st["epochs"])
    last = epochs[-1] if epochs else 0
    first_step = st["epochs"][str(last)][0] if epochs else 0
    warm = max(2, steps // 5) if len(epochs) <= 1 else first_step + 3
    return {"run": job, "members": ",".join(st["plan"]["members"]), "shape": shape(st), "epochs": len(epochs),
            "steady": samples.rate(last, from_step=warm), "epoch_rate": epoch_rate(st, last), "job_rate": job_rate(st),
            "wall": wall, "slow_ranks": seen.get(last, seen.get(st["epoch"])),
            "notes": morph_lines(st, t0), "note": f"{steps} steps"}


def turns_slow(ring: Ring, group: CpuQuota, quota: float, slow_after: int, replan_timeout: float,
               every: int, after_s: float) -> tuple[list[dict], dict]:
    job = "turns-slow"
    samples = Samples(job)
    t_submit = submit(ring, job, 100000, every)
    # on d3 at step slow_after; or planned around d3 before it is capped (a morph that left it out)
    st = watch(ring, job, samples, lambda s: s["state"] == "running" and s["step"] >= slow_after and (
        SLOW in s["plan"]["members"] or any(not m["restart"] for m in s["morphs"])),
               timeout=300, what=f"{job} on {SLOW} at step {slow_after}")
    e0, shape0, members0 = st["epoch"], shape(st), ",".join(st["plan"]["members"])
    ranks0 = slow_ranks(ring, job)
    if SLOW not in st["plan"]["members"]:
        ring.varunactl("cancel", job)
        m = next(m for m in st["morphs"] if not m["restart"])
        row = {"run": "turns slow: d3 left out uncapped", "members": members0, "shape": shape0,
               "steady": samples.rate(e0, from_step=st["epochs"][str(e0)][0] + 3), "slow_ranks": ranks0,
               "note": f"epoch {e0}: planned around {SLOW} before the cap", "notes": morph_lines(st, t_submit)}
        print(f"  turns slow: the leader planned around {SLOW} before it was capped, {m['noticed_at'] - t_submit:.1f}s "
              f"after submit: {m['reason'][:120]}", flush=True)
        return [row], {"replan_s": math.nan, "left_out_uncapped": True}
    started = time.time()
    group.set(quota)
    t_slow = time.time()
    at_slow = st["step"]
    print(f"  turns slow: {SLOW} capped at {quota:g} core at step ~{at_slow} ({t_slow - t_submit:.1f}s after "
          f"submit, plan {shape0} on {members0})", flush=True)

    def replanned(s: dict) -> dict | None:
        return next((m for m in s["morphs"] if not m["restart"] and m["to_epoch"] > e0
                     and m["noticed_at"] >= started - 1.0), None)

    found: dict = {}

    def new_epoch_runs(s: dict) -> bool:
        m = replanned(s)
        if m is None:
            return time.time() - t_slow > replan_timeout
        found["morph"] = m
        if s["epoch"] == m["to_epoch"] and s["state"] == "running" and "members" not in found:
            found["ranks"] = slow_ranks(ring, job)
            found["members"] = ",".join(s["plan"]["members"])
        span = (s.get("epoch_spans") or {}).get(str(m["to_epoch"]))
        if span is None:
            return False
        found["first_step_at"] = span[0]
        return True

    watch(ring, job, samples, new_epoch_runs, timeout=replan_timeout + 300, what="a re-plan's first step")
    t_end_slow = time.time()
    m = found.get("morph")
    if m is not None:   # the new plan's steady rate: let it run a while after its first step
        first = found["first_step_at"]
        watch(ring, job, samples, lambda s: time.time() > first + after_s, timeout=after_s + 120,
              what="the re-planned epoch running")
    st = ring.status(job)
    samples.read(ring)
    ring.varunactl("cancel", job)
    settle = 2.0
    before = samples.rate(e0, from_step=max(2, slow_after // 4), t_to=t_slow)
    slowed = samples.rate(e0, t_from=t_slow + settle, t_to=(m["noticed_at"] if m else t_end_slow))
    rows = [
        {"run": "turns slow: before the cap", "members": members0, "shape": shape0, "steady": before,
         "slow_ranks": ranks0, "note": f"epoch {e0}, steps < {at_slow}"},
        {"run": "turns slow: capped", "members": members0.replace(SLOW, f"{SLOW}@{quota:g}"), "shape": shape0,
         "steady": slowed, "slow_ranks": ranks0,
         "note": f"epoch {e0}, from {settle:g}s after the cap" + (" to the re-plan" if m else
                                                                   f" for {replan_timeout:g}s, no re-plan")},
    ]
    replan = {"replan_s": math.nan, "detect_s": math.nan, "planned_s": math.nan}
    if m is not None:
        e1 = m["to_epoch"]
        first_step = st["epochs"][str(e1)][0] if str(e1) in st["epochs"] else 0
        members1 = found.get("members") or ",".join(st["plan"]["members"])
        rows.append({"run": "turns slow: re-planned", "members": members1.replace(SLOW, f"{SLOW}@{quota:g}"),
                     "shape": m["to"], "steady": samples.rate(e1, from_step=first_step + 3),
                     "epoch_rate": epoch_rate(st, e1), "slow_ranks": found.get("ranks"),
                     "note": f"epoch {e1}, from step {first_step + 3}"})
        replan = {"replan_s": found["first_step_at"] - t_slow, "detect_s": m["noticed_at"] - t_slow,
                  "planned_s": m["planned_at"] - t_slow}
    rows[-1]["notes"] = morph_lines(st, t_submit)
    return rows, replan


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _ranks(r: tuple[int, int] | None, members: str) -> str:
    if not any(m.split("@")[0] == SLOW for m in members.split(",")):
        return "-"
    return "?" if r is None else f"{r[0]} of {r[1]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer steps (120 a run), a shorter wait for the re-plan (60 s); ~4 minutes on 2 cores")
    p.add_argument("--steps", type=int, default=None, help="steps of the healthy and with-slow runs (default 300, "
                   "120 with --quick); ~10 steps/s on two healthy CPU slots")
    p.add_argument("--quota", type=float, default=0.25, help="the slow VM's CPU, a fraction of one core (default 0.25)")
    p.add_argument("--slow-after", type=int, default=None,
                   help="turns slow: the step at which the VM is capped (default 60, 40 with --quick)")
    p.add_argument("--replan-timeout", type=float, default=None,
                   help="turns slow: seconds to wait for a re-plan after the cap (default 120, 60 with --quick)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="the jobs' checkpoint interval (default 100)")
    p.add_argument("--cases", default="healthy,neighbour,slow,turns-slow",
                   help="comma-separated, of healthy, neighbour, slow, turns-slow (default all four)")
    p.add_argument("--keep", metavar="DIR", help="keep the fleets' state (daemon and worker logs) in DIR")
    args = p.parse_args()
    steps = args.steps or (120 if args.quick else 300)
    slow_after = args.slow_after or (40 if args.quick else 60)
    replan_timeout = args.replan_timeout or (60.0 if args.quick else 120.0)
    after_s = 10.0 if args.quick else 30.0
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - {"healthy", "neighbour", "slow", "turns-slow"})
    if unknown:
        p.error(f"unknown case(s) {unknown}")

    groups: dict[str, CpuQuota] = {}
    for name in ALL:
        made = CpuQuota.create(None, name=f"varunad-bench-stragglers-{os.getpid()}-{name}")
        if made is None:
            for g in groups.values():
                g.close()
            print("skipped: no writable cgroup v1 cpu controller here (needs root and a cgroup v1 cpu hierarchy)")
            print("bench stragglers: with_slow_vs_without=nan replan_s=nan")
            return
        groups[name] = made
    group = groups[SLOW]
    rows: list[dict] = []
    replan = {"replan_s": math.nan}
    t_bench = time.time()
    load0 = os.getloadavg()[0]
    calibrations: dict[str, bytes] = {}

    def throttled_s() -> float:
        return group.throttled().get("throttled_time", 0) / 1e9

    with contextlib.ExitStack() as stack:
        for g in groups.values():
            stack.enter_context(g)
        tmp = Path(args.keep) if args.keep else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench-stragglers-")))
        if "healthy" in cases:
            with fleet(tmp / "healthy", groups) as ring:
                rows.append(full_run(ring, "healthy", steps, args.checkpoint_every, timeout=600))
                calibrations.update(read_calibrations(ring))
            print(f"  healthy: {rows[-1]['shape']} on {rows[-1]['members']}, {rows[-1]['wall']:.1f}s", flush=True)
        if "neighbour" in cases:
            # The most the slow VM's group can take from the healthy two on this one host: a busy
            # loop held to the same quota beside the healthy job. On separate VMs it takes nothing.
            with fleet(tmp / "neighbour", groups) as ring:
                for key, value in calibrations.items():
                    ring.call(ring.store.put(ring.keys.calibration + key, value))
                group.set(args.quota)
                burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    group.add(burner.pid)
                    rows.append(full_run(ring, "neighbour", steps, args.checkpoint_every, timeout=600))
                finally:
                    burner.kill()
                    burner.wait()
            print(f"  neighbour: {rows[-1]['shape']} on {rows[-1]['members']}, {rows[-1]['wall']:.1f}s", flush=True)
        if "slow" in cases:
            with fleet(tmp / "with-slow", groups) as ring:
                calibrate_then_add_slow(ring, group, args.quota, calibrations)
                t = throttled_s()
                rows.append(full_run(ring, "with-slow", steps, args.checkpoint_every, timeout=900))
                rows[-1]["members"] = rows[-1]["members"].replace(SLOW, f"{SLOW}@{args.quota:g}")
                rows[-1]["throttled"] = throttled_s() - t
            print(f"  with slow: {rows[-1]['shape']} on {rows[-1]['members']}, {rows[-1]['wall']:.1f}s", flush=True)
        if "turns-slow" in cases:
            with fleet(tmp / "turns-slow", groups) as ring:
                calibrate_then_add_slow(ring, group, None, calibrations)
                t = throttled_s()
                more, replan = turns_slow(ring, group, args.quota, slow_after, replan_timeout,
                                          args.checkpoint_every, after_s)
                more[-1]["throttled"] = throttled_s() - t
                rows += more

    print(f"\n{SLOW} capped at {args.quota:g} of one core (a cgroup v1 cpu quota); global batch {BATCH}; {steps} steps "
          f"a full run; TTL 5 s; {time.time() - t_bench:.0f}s in all; "
          f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)")
    print("| run | members (last plan) | plan | epochs | ranks on d3 | steady samples/s | epoch rate | job rate "
          "| wall s | d3 throttled s | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['members']} | {r['shape'] or '?'} | {r.get('epochs', '-')} "
              f"| {_ranks(r.get('slow_ranks'), r['members'])} | {_fmt(r['steady'])} | {_fmt(r.get('epoch_rate'))} "
              f"| {_fmt(r.get('job_rate'))} | {_fmt(r.get('wall'))} | {_fmt(r.get('throttled'))} | {r.get('note', '')} |")
    for r in rows:
        for line in r.get("notes") or []:
            print(f"  {r['run']}: {line}")
    if "turns-slow" in cases:
        if replan.get("left_out_uncapped"):
            print(f"turns slow: the leader planned around {SLOW} before it was capped (see its morph above): "
                  "no re-plan after a slowdown to time")
        elif math.isnan(replan["replan_s"]):
            print(f"turns slow: no re-plan within {replan_timeout:g}s of the cap")
        else:
            print(f"turns slow: from the cap, the leader decides at {replan['detect_s']:.1f}s, writes the plan at "
                  f"{replan['planned_s']:.1f}s, the new epoch's first step at {replan['replan_s']:.1f}s")
    by = {r["run"]: r["steady"] for r in rows}
    healthy = by.get("healthy", math.nan)
    ratio = by.get("with-slow", math.nan) / healthy if healthy else math.nan
    limit = by.get("neighbour", math.nan)
    print(f"with the slow VM, {by.get('with-slow', math.nan) / limit:.2f} of the healthy two beside a neighbour "
          f"held to the same quota (this host's limit: the slow VM's group shares its cores)")
    print(f"bench stragglers: with_slow_vs_without={ratio:.2f} replan_s={replan['replan_s']:.1f}")


if __name__ == "__main__":
    main()
