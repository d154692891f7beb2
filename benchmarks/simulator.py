"""Estimated vs actual mini-batch time: the simulator against real training (the paper's Table).

The reference model is a GPT (the `small` preset narrowed to 12 blocks of width 192 over 64
tokens, ~5.4M parameters: ~0.3-0.6 s per mini-batch on one CPU thread). It is profiled once
with `trainer.profiler.Profiler` (AdamW, like the workers), itself inside a worker started by
`trainer.launch`, so that it measures in the workers' environment (one torch thread, their
allocator settings, which change CPU timings by 10-20%). Then, per configuration
(P, D, micro-batch size, schedule; P x D <= 2, one torch thread per worker):

* actual: `trainer.launch` runs benchmarks/_sim_worker.py as P x D workers with the cut points
  given explicitly (`cuts=`); every worker times each step after warm-up; a step's time is the
  slowest worker's, the row's the median over all timed steps of `--rounds` runs (the rounds
  interleave the configurations, so a burst of other work on the machine hits one run, not a row;
  5 by default: on a shared VM a run's speed moves by up to a third from one run to the next
  while staying steady within the run, and with 3 rounds two slow runs decided a row);
  every round also profiles the model again, and the estimates use the element-wise median of
  the rounds' calibrations, so both sides average over the same stretch of time;
* estimated: `simulator.simulate` replays `schedule.build_table(schedule, P, m)` (the very list
  the engine ran) with `simulator.stage_costs` from the calibration and the same cut points.

Calibrations: a lone worker (P x D = 1) uses the profile of a lone slot; two workers share this
2-core host, so P x D = 2 uses the profile taken with both slots busy (`gpus_per_node=2`:
device kind 'cpu-2slots'). Cut points for P = 2 are those with the fastest simulated
mini-batch (what the planner would choose), passed to the launcher, so both sides use the
same stages.

Wall-clock times need the cores to ourselves: a profile or a run during which other processes
used more than `--max-others` cores (from /proc/stat minus our own rusage) is redone, up to
`--tries` attempts; the `others` column is that load for the runs kept. Rows with a large value
measured the machine's load, not the engine. `--wait-quiet S` first waits up to S seconds for
a quiet window.

Run:  python benchmarks/simulator.py [--quick] [--steps N] [--warmup W] [--rounds R] [--in-flight K]
                                     [--max-others CORES] [--tries T] [--wait-quiet S] [--trace DIR]
                                     [--save DIR]   (keeps the median calibrations and the rows' times)
Last line:  `bench simulator: median_error=<x> max_error=<y>` (fractions |est - act| / act).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.launch import launch  # noqa: E402
from trainer.models.gpt import GPTConfig  # noqa: E402
from trainer.planning.calibration import Calibration, LinkCost  # noqa: E402
from trainer.planning.schedule import build_table  # noqa: E402
from trainer.planning.simulator import simulate, stage_costs  # noqa: E402

__all__ = ["main", "REFERENCE", "CONFIGS"]

REFERENCE = GPTConfig.preset("small", n_layer=12, n_embd=192, n_head=4, seq_len=64)
GLOBAL_BATCH = 16
WORKER = ROOT / "benchmarks" / "_sim_worker.py"

# (P, D, micro-batch size, schedule)
CONFIGS = [
    (1, 1, 4, "varuna"),
    (1, 1, 2, "gpipe"),
    (1, 2, 4, "1f1b"),
    (1, 2, 2, "varuna"),
    (2, 1, 4, "varuna"),
    (2, 1, 2, "varuna"),
    (2, 1, 4, "gpipe"),
    (2, 1, 2, "1f1b"),
    (2, 1, 4, "1f1b"),
    (2, 1, 8, "gpipe"),
]


def _profile(sizes, folder: str, repeats: int, slots: int = 1, network: str | None = None,
             in_flight: int | None = None) -> str:
    """Profile the reference model in a worker started by the launcher (the workers' environment:
    one thread, their allocator settings); returns the calibration file."""
    path = os.path.join(folder, f"calibration-{slots}slots.json")
    args = ["--config", json.dumps(asdict(REFERENCE)), "--profile", path, "--sizes", ",".join(map(str, sizes)),
            "--slots", slots, "--repeats", repeats, *(["--network", network] if network else []),
            *(["--in-flight", in_flight] if in_flight else [])]
    res = launch(WORKER, args, stages=1, replicas=1, threads=1, timeout=600)
    if not res.ok:
        raise SystemExit(f"profiling failed: {res.reason}\n{res.errors[0][-3000:]}")
    return path


def _cuts(cal, P: int, D: int, mb: int, schedule: str) -> list[int]:
    """The cut points whose simulated mini-batch is fastest (the planner's choice, here for P <= 2)."""
    if P == 1:
        return []
    return min(([c] for c in range(cal.n_segments - 1)), key=lambda cuts: estimate(cal, P, D, mb, schedule, cuts))


def median_calibration(cals: list[Calibration]) -> Calibration:
    """Element-wise median of calibrations of one key (times; sizes and bytes are equal)."""
    if len(cals) == 1:
        return cals[0]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    segments = []
    for k, seg in enumerate(cals[0].segments):
        costs = tuple(
            replace(c, **{f: med([getattr(cal.segments[k].costs[j], f) for cal in cals])
                          for f in ("forward_s", "backward_s", "recompute_s")})
            for j, c in enumerate(seg.costs))
        segments.append(replace(seg, step_s=med([cal.segments[k].step_s for cal in cals]), costs=costs))
    link = lambda table, kind: LinkCost(**{f: med([getattr(getattr(c, table)[kind], f) for c in cals])  # noqa: E731
                                           for f in LinkCost.__slots__})
    return replace(cals[0], segments=tuple(segments),
                   links={k: link("links", k) for k in cals[0].links},
                   allreduce={k: link("allreduce", k) for k in cals[0].allreduce})


def estimate(cal, P: int, D: int, mb: int, schedule: str, cuts: list[int]) -> float:
    m = GLOBAL_BATCH // D // mb
    bounds = [0, *(c + 1 for c in cuts), cal.n_segments]
    costs = stage_costs([cal] * P, bounds, mb, D, ["intra"] * (P - 1), ["intra"] * P)
    return simulate(build_table(schedule, P, m, True), costs).minibatch_s


def actual(P: int, D: int, mb: int, schedule: str, cuts: list[int], *, steps: int, warmup: int,
           trace: str | None) -> list[float]:
    """Per-step mini-batch times of one run: the slowest worker's time of each timed step."""
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as out:
        args = ["--out", out, "--config", json.dumps(asdict(REFERENCE)), "--batch-size", GLOBAL_BATCH,
                "--chunk-size", mb, "--warmup", warmup, "--steps", steps]
        res = launch(WORKER, args, stages=P, replicas=D, schedule=schedule, cuts=cuts, threads=1,
                     timeout=600, trace_dir=trace)
        if not res.ok:
            tail = res.errors[res.failed_rank or 0][-3000:]
            raise SystemExit(f"P={P} D={D} mb={mb} {schedule}: {res.reason}\n{tail}")
        runs = [json.loads(p.read_text()) for p in sorted(Path(out).glob("times_rank*.json"))]
    return [max(r["times"][i] for r in runs) for i in range(steps)]


class _Load:
    """CPU time other processes used while a block ran, in cores (resource.getrusage counts this
    process and its finished children; /proc/stat counts everybody)."""

    def __enter__(self) -> _Load:
        self.t0, self.cpu0 = time.perf_counter(), _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        cpu1 = _cpu_seconds()
        self.wall = wall
        self.others = max(0.0, (cpu1[0] - self.cpu0[0]) - (cpu1[1] - self.cpu0[1])) / max(wall, 1e-9)


def _cpu_seconds() -> tuple[float, float]:
    """(all CPU time on this machine, this process's and its finished children's), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])   # user nice system, irq softirq steal
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy / os.sysconf("SC_CLK_TCK"), me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _quietly(fn, limit: float, tries: int):
    """fn() again (at most `tries` times) while other processes used more than `limit` cores
    during it; returns the result of the least disturbed attempt and that load."""
    best = None
    for _ in range(max(1, tries)):
        with _Load() as load:
            result = fn()
        if best is None or load.others < best[1]:
            best = (result, load.others)
        if load.others <= limit:
            break
    return best


def _wait_quiet(limit_s: float, threshold: float = 0.2, window_s: float = 15.0) -> None:
    """Wait (at most limit_s) for a window in which other processes use < threshold cores."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with _Load() as load:
            time.sleep(window_s)
        if load.others < threshold:
            return
        print(f"waiting for a quiet machine: others use {load.others:.2f} cores", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps, repeats and rounds (under ~90 s)")
    p.add_argument("--steps", type=int, help="timed steps per configuration and round")
    p.add_argument("--warmup", type=int, help="untimed steps per run (default 2)")
    p.add_argument("--rounds", type=int, help="runs of every configuration, interleaved (default 5, quick 1)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for other processes to leave the cores alone")
    p.add_argument("--max-others", type=float, default=0.15, metavar="CORES",
                   help="redo a profile or a run during which other processes used more cores (default 0.15)")
    p.add_argument("--tries", type=int, default=4, help="at most this many attempts per profile or run (default 4)")
    p.add_argument("--trace", metavar="DIR", help="write each run's Chrome traces under DIR/<row>")
    p.add_argument("--save", metavar="DIR", help="keep the (median) calibrations and the rows' times in DIR")
    p.add_argument("--in-flight", type=int, metavar="K",
                   help="profile with K micro-batches in flight (default: the profiler's; 1: one at a time)")
    ns = p.parse_args(argv)
    steps = ns.steps or (4 if ns.quick else 8)
    # The estimate is of a steady step; a run's first two are not (the allocator's first growth,
    # the first optimizer step's state, the ZeroMQ connections' first messages), quick or not.
    warmup = ns.warmup or 2
    rounds = ns.rounds or (1 if ns.quick else 5)
    configs = CONFIGS[:8] if ns.quick else CONFIGS
    sizes = sorted({mb for _, _, mb, _ in configs})
    if ns.wait_quiet > 0:
        _wait_quiet(ns.wait_quiet)

    with _Load() as total, tempfile.TemporaryDirectory(prefix="bench-sim-prof-") as folder:
        repeats = 5 if ns.quick else 7
        slot_counts = sorted({P * D for P, D, _, _ in configs})
        profiles: dict[int, list[Calibration]] = {n: [] for n in slot_counts}
        rows = []
        for r in range(rounds):
            # Profiles are taken in every round too, so the estimates and the runs they are
            # compared with average over the same stretch of time.
            loads = []
            with _Load() as load:
                alone, others = _quietly(lambda: _profile(sizes, folder, repeats, in_flight=ns.in_flight),
                                         ns.max_others, ns.tries)
                profiles[1].append(Calibration.load(alone))
                loads.append(others)
                if 2 in profiles:   # two workers share this host: a slot of a host with both slots busy
                    busy, others = _quietly(lambda: _profile(sizes, folder, repeats, slots=2, network=alone,
                                                             in_flight=ns.in_flight), ns.max_others, ns.tries)
                    profiles[2].append(Calibration.load(busy))
                    loads.append(others)
            cal = profiles[1][-1]
            print(f"round {r}: profiled {cal.n_segments} segments x sizes {list(cal.micro_batch_sizes)} x slots "
                  f"{slot_counts} in {load.wall:.1f}s (others used {', '.join(f'{x:.2f}' for x in loads)} cores)",
                  flush=True)
            if not rows:   # cut points are fixed by the first round's calibration
                for P, D, mb, schedule in configs:
                    rows.append({"P": P, "D": D, "mb": mb, "schedule": schedule, "times": [], "others": [],
                                 "cuts": _cuts(profiles[P * D][0], P, D, mb, schedule)})
            for i, row in enumerate(rows):
                trace = None if ns.trace is None else str(
                    Path(ns.trace) / f"row{i}_P{row['P']}D{row['D']}mb{row['mb']}_{row['schedule']}_r{r}")
                times, others = _quietly(
                    lambda: actual(row["P"], row["D"], row["mb"], row["schedule"], row["cuts"],
                                   steps=steps, warmup=warmup, trace=trace), ns.max_others, ns.tries)
                row["times"] += times
                row["others"].append(others)
        cals = {n: median_calibration(cs) for n, cs in profiles.items()}
        if ns.save:
            os.makedirs(ns.save, exist_ok=True)
            for n, cal in cals.items():
                cal.save(os.path.join(ns.save, f"calibration-{n}slots.json"))
        print(f"link {cals[1].links['intra']}, all-reduce {cals[1].allreduce['intra']}")
        for row in rows:
            row["est"] = estimate(cals[row["P"] * row["D"]], row["P"], row["D"], row["mb"], row["schedule"],
                                  row["cuts"])
        print(f"{'P':>2} {'D':>2} {'mb':>3} {'m':>3} {'schedule':>8} {'cuts':>6} {'estimated_s':>12} "
              f"{'actual_s':>9} {'error':>7} {'others':>7}")
        errors = []
        for row in rows:
            act = statistics.median(row["times"])
            err = abs(row["est"] - act) / act
            errors.append(err)
            m = GLOBAL_BATCH // row["D"] // row["mb"]
            print(f"{row['P']:>2} {row['D']:>2} {row['mb']:>3} {m:>3} {row['schedule']:>8} {str(row['cuts']):>6} "
                  f"{row['est']:12.4f} {act:9.4f} {err:7.3f} {statistics.mean(row['others']):7.2f}")
    if ns.save:
        Path(ns.save, "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"total {total.wall:.0f}s; other processes used {total.others:.2f} of {os.cpu_count()} cores meanwhile"
          + (" (a busy machine: actual times are not those of dedicated cores)" if total.others > 0.2 else ""))
    print(f"bench simulator: median_error={statistics.median(errors):.4f} max_error={max(errors):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
