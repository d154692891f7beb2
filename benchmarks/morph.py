"""Morph latency: from a lost VM (kill -9) or a preemption notice (SIGTERM) to the job's first step
in its new epoch, split into where the time goes.

A ring of three real varunad processes on loopback (one slot each, a private etcd, CURVE off)
trains the tiny GPT as a pipeline (the daemons calibrate it with the test job's synthetic
calibration, which does not fit one slot) with a checkpoint every 3 steps. Each trial waits for
the job to run on all three members, then:

* kill:   SIGKILL to a non-leading member's process group (its workers die with it);
* notice: SIGTERM to a non-leading member (checkpoint, then leave the fleet).

It then reads the leader's morph record and the new epoch's worker logs and reports
  detect   the event -> the leader decides to morph: after kill -9 the lease TTL, or sooner when a
           surviving worker's all-reduce fails and the lost member does not answer a ping; after a
           notice, the leaving member marks itself at once
  stop     the decision -> every old worker gone
  plan     every old worker gone -> the new plan written in etcd
  restart  plan written -> the slowest new worker is ready to load (spawn, imports, tracing, rendezvous)
  load     the slowest checkpoint load
  step     -> the first step of the new epoch done
The killed member is restarted between trials (a scale-up morph, threshold 0, brings it back in).

Run:  python benchmarks/morph.py [--quick] [--trials N]
The last line is `bench morph: kill_to_resume_s=<median, TTL 5 s> notice_to_resume_s=<median>`.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from etcd_server import EtcdServer  # noqa: E402
from ring import Ring  # noqa: E402

NAMES = ["d1", "d2", "d3"]
_TIMING = re.compile(r"TIMING start=([\d.]+) before_load=([\d.]+) loaded=([\d.]+)")
_STEP = re.compile(r"^step (\d+) loss [\d.]+ t=([\d.]+)", re.M)


def _worker_logs(ring: Ring, job: str, epoch: int) -> list[str]:
    out = []
    for name in NAMES:
        for path in (ring.base / name / "logs" / job).glob(f"e{epoch}-r*.log"):
            out.append(path.read_text(errors="replace"))
    return out


def _epoch_timing(ring: Ring, job: str, epoch: int, timeout: float = 120.0) -> tuple[float, float, float]:
    """(slowest worker ready to load, slowest load done, first step done) of one epoch, wall clock."""
    def read():
        logs = _worker_logs(ring, job, epoch)
        timings = [m.groups() for text in logs for m in _TIMING.finditer(text)]
        steps = [float(m.group(2)) for text in logs for m in _STEP.finditer(text)]
        if not timings or not steps:
            return None
        ready = max(float(t[1]) for t in timings)
        loaded = max(float(t[2]) for t in timings)
        return ready, loaded, min(steps)

    return ring.poll(read, timeout=timeout, what=f"the first step of epoch {epoch}")


def _wait_full(ring: Ring, job: str) -> dict:
    """Until the job runs on every ring member and has a checkpoint in this epoch."""
    st = ring.poll(lambda: (s := ring.status(job))["state"] == "running" and len(s["plan"]["members"]) == len(NAMES)
                   and s, timeout=180, what="the job on all members")
    ring.wait_step(job, st["step"] + 4, timeout=120)
    return ring.status(job)


def trial(ring: Ring, job: str, how: str) -> dict[str, float]:
    st = _wait_full(ring, job)
    leader = ring.leader()
    victim = next(m for m in st["plan"]["members"] if m != leader)
    morphs = len(st["morphs"])
    event = time.time()
    if how == "kill":
        ring.daemons[victim].kill9()
    else:
        ring.daemons[victim].proc.send_signal(signal.SIGTERM)
    st = ring.poll(lambda: (s := ring.status(job))["state"] == "running" and len(s["morphs"]) > morphs
                   and victim not in s["plan"]["members"] and s, timeout=180, what="the morph")
    first_morph, morph = st["morphs"][morphs], st["morphs"][-1]  # more than one when a restart came between
    ready, loaded, first = _epoch_timing(ring, job, morph["to_epoch"])
    if how != "kill":
        ring.daemons[victim].proc.wait(60)
    ring.start(victim)  # back for the next trial (a scale-up morph)
    return {
        "detect": first_morph["noticed_at"] - event,
        "stop": first_morph["stopped_at"] - first_morph["noticed_at"],
        "plan": morph["planned_at"] - first_morph["stopped_at"],
        "restart": ready - morph["planned_at"],
        "load": loaded - ready,
        "step": first - loaded,
        "total": first - event,
        "trigger": first_morph["reason"],
    }


def run_config(base: Path, ttl: float, hows: list[str], trials: int) -> dict[str, list[dict]]:
    server = EtcdServer()
    server.start()
    ring = Ring(base, server.endpoint, root="/bench/", ttl=ttl,
                extra=["--calibrate", "profile", "--memory", str(2**30), "--stop-grace", "30", "--abort-grace", "2",
                       "--scale-up-threshold", "0", "--progress-interval", "0.5", "--debounce", "0.2"])
    results: dict[str, list[dict]] = {h: [] for h in hows}
    try:
        for name in NAMES:
            ring.start(name)
        ring.wait_members(NAMES)
        job = f"bench-ttl{int(ttl)}"
        ring.submit(job, steps=100000, script_args=("--step-sleep", "0.2"))
        for i in range(trials):
            for how in hows:
                r = trial(ring, job, how)
                results[how].append(r)
                print(f"  ttl={ttl:>4.0f}s {how:<6} trial {i + 1}: total {r['total']:6.2f}s = detect {r['detect']:5.2f} "
                      f"+ stop {r['stop']:5.2f} + plan {r['plan']:5.2f} + restart {r['restart']:5.2f} + load "
                      f"{r['load']:5.2f} + step {r['step']:5.2f}   ({r['trigger'][:70]})", flush=True)
        ring.varunactl("cancel", job)
    finally:
        ring.close()
        server.close()
    return results


def _median_row(label: str, rows: list[dict]) -> float:
    keys = ["detect", "stop", "plan", "restart", "load", "step", "total"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"{label:<22} " + "  ".join(f"{k} {med[k]:6.2f}" for k in keys))
    return med["total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one trial per case, TTL 5 s only for kill -9")
    p.add_argument("--trials", type=int, default=3, help="trials per case (default 3)")
    args = p.parse_args()
    trials = 1 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="bench-morph-") as tmp:
        five = run_config(Path(tmp) / "ttl5", 5.0, ["kill", "notice"], trials)
        ten = {} if args.quick else run_config(Path(tmp) / "ttl10", 10.0, ["kill"], trials)
    print("median seconds:")
    kill5 = _median_row("kill -9, TTL 5 s", five["kill"])
    if ten:
        _median_row("kill -9, TTL 10 s", ten["kill"])
    notice = _median_row("SIGTERM notice, TTL 5 s", five["notice"])
    print(f"bench morph: kill_to_resume_s={kill5:.2f} notice_to_resume_s={notice:.2f}")


if __name__ == "__main__":
    main()
