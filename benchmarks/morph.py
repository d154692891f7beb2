"""Morph latency: from a lost VM (kill -9) or a preemption notice (SIGTERM) to the job's first step
in its new epoch, split into where the time goes, and how many steps the new epoch trained again.

A ring of four real varunad processes on loopback (one slot each, a private etcd, CURVE off)
trains the tiny GPT as a pipeline (the daemons calibrate it with the test job's synthetic
calibration, which does not fit one slot) with a checkpoint every 10 steps, in two shapes:

* 2x2 (`--cheap-allreduce`: the calibration makes data parallelism nearly free): every stage has
  a second replica, so after a kill -9 the survivors save the step they hold and the new epoch
  starts there (trainer.checkpoint.rescue);
* 4x1: the lost VM's stage has no other replica, so the new epoch falls back to the store's
  newest checkpoint and redoes the steps since.

Each trial waits for the job to run on all four members, then:

* kill:   SIGKILL to a non-leading member's process group (its workers die with it);
* notice: SIGTERM to a non-leading member (checkpoint, then leave the fleet).

It then reads the leader's morph record, the job's status and the new epoch's worker logs:
  detect   the event -> the leader decides to morph: after kill -9 the lease TTL, or sooner when a
           surviving worker's all-reduce fails; after a notice, the leaving member marks itself at once
  stop     the decision -> every old worker gone and the lost member known (after a kill, the
           survivors' save from memory; a member whose host refuses its port is lost at once, one
           that does not answer costs the ping timeout, TTL/4)
  plan     every old worker gone -> the new plan written in etcd
  restart  plan written -> the slowest new worker is ready to load (spawn, imports, tracing, rendezvous)
  load     the slowest checkpoint load (the transfer of the saved state into the new workers)
  step     -> the first step of the new epoch done
  redone   steps the new epoch trained that the old one had already trained
  source   where the new epoch's state came from, as the morph record says
The lost member is restarted between trials (a scale-up morph, threshold 0, brings it back in):
  join stall  the last step of the epoch before that morph -> the first step of the one with the
              newcomer: how long training stood still for a VM that joined (taken in once its spare
              workers have imported torch, DaemonMember.warming)
Each trial starts in the steady state between morphs: the job has trained a few steps in its epoch
and every member's spare worker has finished its imports.

Run:  python benchmarks/morph.py [--quick] [--trials N]
The last line is `bench morph: kill_to_resume_s=<median, 2x2, TTL 5 s> notice_to_resume_s=<median,
2x2> steps_redone=<median, 2x2 kill> join_stall_s=<median of every case's>`.
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

from support.etcd_server import EtcdServer  # noqa: E402
from support.ring import Ring  # noqa: E402
from support.spares import spares_settled  # noqa: E402

NAMES = ["d1", "d2", "d3", "d4"]
SHAPES = {"2x2": ("--cheap-allreduce",), "4x1": ()}
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


def _last_step(ring: Ring, job: str, epoch: int) -> float:
    """When the last step of ``epoch`` was done (wall clock), from its workers' logs."""
    return max(float(m.group(2)) for text in _worker_logs(ring, job, epoch) for m in _STEP.finditer(text))


def _wait_full(ring: Ring, job: str) -> dict:
    """Until the job runs on every ring member, has trained a few steps in this epoch, and every
    member's spare worker is ready (the steady state between morphs)."""
    st = ring.poll(lambda: (s := ring.status(job))["state"] == "running" and len(s["plan"]["members"]) == len(NAMES)
                   and s, timeout=180, what="the job on all members")
    ring.wait_step(job, st["step"] + 4, timeout=120)
    ring.poll(lambda: spares_settled(ring), timeout=120, what="the spare workers' imports")
    return ring.status(job)


def _redone(st: dict, old_epoch: int, new_epoch: int) -> int:
    """The steps the new epoch will train again: the old one trained them from the new one's first
    step on. Read right after the new epoch's first step, so not status's steps_trained_twice,
    which counts only what the new epoch has already trained twice (one step, at that moment)."""
    epochs = st["epochs"]
    if str(old_epoch) not in epochs or str(new_epoch) not in epochs:
        return -1
    return max(0, epochs[str(old_epoch)][1] - epochs[str(new_epoch)][0] + 1)


def trial(ring: Ring, job: str, how: str, shape: str) -> dict:
    st = _wait_full(ring, job)
    if f"{st['plan']['P']}x{st['plan']['D']}" != shape:
        raise SystemExit(f"the job runs as {st['plan']['P']}x{st['plan']['D']}, not {shape}: the calibration changed?")
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
    st = ring.poll(lambda: str(morph["to_epoch"]) in (s := ring.status(job))["epochs"] and s, timeout=60,
                   what="the new epoch's first step in the status")
    if how != "kill":
        ring.daemons[victim].proc.wait(60)
    morphs = len(st["morphs"])
    ring.poll(lambda: spares_settled(ring), timeout=120, what="the spare workers' imports")
    ring.start(victim)  # back for the next trial (a scale-up morph), once the survivors' spares are ready
    joined = ring.poll(lambda: (s := ring.status(job))["state"] == "running" and len(s["morphs"]) > morphs
                       and victim in s["plan"]["members"] and s, timeout=180, what=f"{victim} planned in again")
    grown = joined["morphs"][-1]
    _, _, resumed = _epoch_timing(ring, job, grown["to_epoch"])
    return {
        "detect": first_morph["noticed_at"] - event,
        "stop": first_morph["stopped_at"] - first_morph["noticed_at"],
        "plan": morph["planned_at"] - first_morph["stopped_at"],
        "restart": ready - morph["planned_at"],
        "load": loaded - ready,
        "step": first - loaded,
        "total": first - event,
        "redone": _redone(st, first_morph["from_epoch"], morph["to_epoch"]),
        "source": (morph.get("source") or "?") + (f" {morph['resumed_from']}" if morph.get("resumed_from", -1) >= 0
                                                  else ""),
        "trigger": first_morph["reason"],
        # a join: from the last step of the epoch the newcomer's plan replaced to the new one's first
        "join_stall": resumed - _last_step(ring, job, grown["from_epoch"]),
        "join_stop": grown["stopped_at"] - grown["noticed_at"],
        "join_restart": resumed - grown["planned_at"],
    }


def run_config(base: Path, ttl: float, shape: str, hows: list[str], trials: int) -> dict[str, list[dict]]:
    server = EtcdServer()
    server.start()
    # each daemon plays a VM of its own: the job's workers sleep, and its shapes are the point
    ring = Ring(base, server.endpoint, root="/bench/", ttl=ttl, own_machines=True,
                extra=["--calibrate", "profile", "--memory", str(2**30), "--stop-grace", "30", "--abort-grace", "2",
                       "--scale-up-threshold", "0", "--progress-interval", "0.5", "--debounce", "0.2"])
    results: dict[str, list[dict]] = {h: [] for h in hows}
    try:
        for name in NAMES:
            ring.start(name)
        ring.wait_members(NAMES)
        job = f"bench-{shape}-ttl{int(ttl)}"
        ring.submit(job, steps=100000, every=10, script_args=("--step-sleep", "0.2", *SHAPES[shape]))
        for i in range(trials):
            for how in hows:
                r = trial(ring, job, how, shape)
                results[how].append(r)
                print(f"  {shape} ttl={ttl:>2.0f}s {how:<6} trial {i + 1}: total {r['total']:6.2f}s = detect "
                      f"{r['detect']:5.2f} + stop {r['stop']:5.2f} + plan {r['plan']:5.2f} "
                      f"+ restart {r['restart']:5.2f}"
                      f" + load {r['load']:5.2f} + step {r['step']:5.2f}; redone {r['redone']}, from {r['source']}"
                      f"; back in: stood still {r['join_stall']:5.2f}s (stop {r['join_stop']:.2f}, restart "
                      f"{r['join_restart']:.2f})   ({r['trigger'][:60]})", flush=True)
        ring.varunactl("cancel", job)
    finally:
        ring.close()
        server.close()
    return results


def _median_row(label: str, rows: list[dict]) -> tuple[float, float]:
    keys = ["detect", "stop", "plan", "restart", "load", "step", "total", "redone", "join_stall"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    sources = sorted({r["source"].split()[0] for r in rows})
    print(f"| {label} | " + " | ".join(f"{med[k]:.2f}" for k in keys[:-2]) + f" | {med['redone']:g} | "
          f"{', '.join(sources)} | {med['join_stall']:.2f} |")
    return med["total"], med["redone"], med["join_stall"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one trial per case")
    p.add_argument("--trials", type=int, default=3, help="trials per case (default 3)")
    p.add_argument("--shapes", default="2x2,4x1", help="comma-separated, of " + ", ".join(SHAPES))
    args = p.parse_args()
    trials = 1 if args.quick else args.trials
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {unknown}: choose from {sorted(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="bench-morph-") as tmp:
        results = {shape: run_config(Path(tmp) / shape, 5.0, shape, ["kill", "notice"], trials) for shape in shapes}
    print("\nmedian seconds, TTL 5 s:")
    print("| case | detect | stop | plan | restart | load | step | total | steps redone | source | join stall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for shape, by_how in results.items():
        for how, rows in by_how.items():
            summary[shape, how] = _median_row(f"{shape} {'kill -9' if how == 'kill' else 'SIGTERM notice'}", rows)
    head = shapes[0]
    print(f"bench morph: kill_to_resume_s={summary[head, 'kill'][0]:.2f} "
          f"notice_to_resume_s={summary[head, 'notice'][0]:.2f} steps_redone={summary[head, 'kill'][1]:g} "
          f"join_stall_s={statistics.median(v[2] for v in summary.values()):.2f}")


if __name__ == "__main__":
    main()
