"""Memory: a model whose Adam training state is several times one slot's memory, calibrated and
trained within the slots' budgets, each stage's measured peak beside the planner's estimate.

The model is the issue's plain MLP (`tests/memory_job/mlp.py`): 8 layers of width 2048, a
CutPoint after each but the last, Adam: 134 MB of weights, 537 MB with gradients and Adam's
two moments, 2.7x a slot of `--memory 200000000` (on a CPU, whose slots' memory holds each
worker's process too, about 330 MB here, a slot of 600 MB).

* default (`--device cpu`): a ring of four real varunad processes on loopback (one slot each,
  `--memory`, a private etcd, the daemons' calibration run); the job runs to its end. The
  estimates come from the plan the leader recorded, the measured peaks from `varunactl status`
  and the workers' logs, the calibration's peak from the calibration run's log.
* `--launch` (implied by `--device cuda`): no daemon and no etcd. The model is calibrated in
  this process (`trainer.Profiler` on the device), planned for four slots of `--memory` with
  `trainer.planning.planner.plan`, and trained with `python -m trainer.launch` as that P x D
  (its cuts, micro-batch and D; every worker on the same device, one GPU standing for four
  slots); the workers print their peaks.

A worker's peak is what it held since its stage was built (on CUDA `torch.cuda.max_memory_allocated`,
its stage's weights included; on a CPU its process's resident high-water mark, so the interpreter,
torch, the allocator's and libraries' buffers count too, as the planner's estimate does). The
calibration's is its rise above the built model. The host copy of the weights (the whole model as the script builds it) is reported apart:
the calibration and the workers leave it out.

Run:  python benchmarks/memory.py [--quick] [--device cpu|cuda] [--launch]
The last line is `bench memory: plan=PxD worker_peak_over_budget=X calibration_peak_over_budget=Y
estimate_error=Z` (the largest of each over the stages; the error is |peak - estimate| / estimate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "memory_job"))
sys.path.insert(0, str(REPO))

from trainer.planning.schedule import AUTO_SCHEDULE, DEFAULT_SCHEDULE, SCHEDULES  # noqa: E402  (after the path insert)

JOB = REPO / "tests" / "memory_job" / "mlp_job.py"
NAMES = ["d1", "d2", "d3", "d4"]
_MEMORY = re.compile(r"MEMORY (\{.*\})")
_CALIBRATION = re.compile(r"calibration memory: peak ([\d.]+) MB")


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def run_ring(args) -> dict:
    from support.etcd_server import EtcdServer
    from support.ring import Ring

    server = EtcdServer()
    server.start()
    base = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    ring = Ring(base, server.endpoint, root="/bench/", ttl=5.0,
                extra=["--calibrate", "profile", "--memory", str(args.memory), "--progress-interval", "0.5"])
    try:
        for name in NAMES:
            ring.start(name)
        ring.wait_members(NAMES)
        job = "memory"
        r = ring.varunactl("submit", "--name", job, "--batch-size", str(args.batch), "--chunk-size", "auto",
                           "--steps", str(args.steps), "--checkpoint-every", str(args.steps),
                           "--schedule", args.schedule, str(JOB), "--",
                           "--width", str(args.width), "--depth", str(args.depth))
        if r.returncode != 0:
            raise SystemExit(f"submit failed: {r.stderr}")
        st = ring.wait_state(job, ("done", "failed"), timeout=args.timeout)
        if st["state"] != "done":
            raise SystemExit(f"the job ended {st['state']}: {st['reason']}\n{ring.tails()}")
        logs = [p for p in base.rglob("*") if p.is_file() and p.suffix in (".log", ".txt", "")]
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        peaks: dict[int, int] = {}
        for m in _MEMORY.finditer(text):
            row = json.loads(m.group(1))
            peaks[row["stage"]] = max(peaks.get(row["stage"], 0), row["peak"])
        stages = []
        for row in st.get("stages") or []:
            peak = max(peaks.get(row["stage"], 0), row["peak"] or 0) or None
            stages.append({"stage": row["stage"], "estimate": row["estimate"], "peak": peak})
        cal = [float(x) * 1e6 for x in _CALIBRATION.findall(text)]
        return {"P": st["plan"]["P"], "D": st["plan"]["D"], "micro_batch": st["plan"]["micro_batch_size"],
                "stages": stages, "calibration_peak": max(cal) if cal else None}
    finally:
        ring.close()
        server.close()


def run_launch(args) -> dict:
    import torch
    from mlp import MLP, regression_set

    from trainer import Profiler
    from trainer.engine.memory import PeakMemory, process_bytes
    from trainer.planning.plan import PlanError, Slot
    from trainer.planning.planner import plan
    from trainer.profiler.calibration_run import profile_sizes

    torch.manual_seed(0)
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    model = MLP(args.width, args.depth)
    xs, ys = regression_set(args.width)
    batch = lambda b, _device=None: {"x": xs[:b], "y": ys[:b]}  # noqa: E731
    with tempfile.TemporaryDirectory() as folder:
        prof = Profiler(model, batch, device=device, out_folder=folder, repeats=3, warmup=1)
        prof.set_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
        meter = PeakMemory(device)
        # a CPU worker's slot holds its process too, as a daemon's calibration run measures it
        process = process_bytes(model) if device.type == "cpu" else 0
        cal = prof.profile_all(profile_sizes(args.batch, 4))
        cal = dataclasses.replace(cal, worker_bytes=cal.worker_bytes + process)
        calibration_peak = meter.growth_bytes()
    slots = [Slot(f"s{i}", "local", cal.device_kind, args.memory) for i in range(4)]
    try:
        chosen = plan(slots, args.batch, [cal], schedule=args.schedule)
    except PlanError as exc:   # an answer too: the model does not fit these slots
        raise SystemExit(f"bench memory: no plan: {exc}") from None
    par = chosen.parallel
    env = dict(os.environ, VARUNA_STEPS=str(args.steps), VARUNA_BATCH_SIZE=str(args.batch))
    # every worker on the one device (trainer.launch's --device cuda wants a GPU per worker)
    cmd = [sys.executable, "-m", "trainer.launch", "-P", str(par.P), "-D", str(par.D), "--schedule", par.schedule]
    if par.cuts:
        cmd += ["--cuts", ",".join(str(c) for c in par.cuts)]
    cmd += [str(JOB), "--width", str(args.width), "--depth", str(args.depth),
            "--chunk-size", str(par.micro_batch_size), "--device", str(device)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=str(JOB.parent), env=env)
    if out.returncode != 0:
        raise SystemExit(f"trainer.launch failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    peaks: dict[int, int] = {}
    for m in _MEMORY.finditer(out.stdout + out.stderr):
        row = json.loads(m.group(1))
        peaks[row["stage"]] = max(peaks.get(row["stage"], 0), row["peak"])
    stages = [{"stage": s, "estimate": st.memory_bytes, "peak": peaks.get(s),
               "recompute": st.recompute} for s, st in enumerate(chosen.stages)]
    note = ("" if all(st.recompute for st in chosen.stages[:-1]) else
            "  (trainer.launch recomputes on every stage; the plan's estimate assumed it only where marked)")
    return {"P": par.P, "D": par.D, "micro_batch": par.micro_batch_size, "stages": stages,
            "calibration_peak": calibration_peak, "note": note, "worker_bytes": cal.worker_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (under 3 minutes on 2 cores)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--launch", action="store_true", help="trainer.launch instead of a ring of daemons")
    ap.add_argument("--memory", type=int, default=None,
                    help="bytes per slot (default 200 MB on CUDA; 600 MB on a CPU, whose slots hold the workers' "
                         "processes too)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=[*SCHEDULES, AUTO_SCHEDULE],
                    help=f"the job's pipeline schedule (default {DEFAULT_SCHEDULE}): each has its own memory rule")
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.quick else 10)
    launch = args.launch or args.device == "cuda"
    args.memory = args.memory or (200_000_000 if args.device == "cuda" else 600_000_000)
    weights = args.width * (args.width + 1) * 4 * args.depth
    print(f"model: MLP {args.depth} x {args.width}, Adam: weights {weights / 1e6:.1f} MB, training state "
          f"{4 * weights / 1e6:.1f} MB = {4 * weights / args.memory:.2f}x a slot of {args.memory / 1e6:.0f} MB; "
          f"{'trainer.launch' if launch else 'a ring of 4 daemons'} on {args.device}", flush=True)
    started = time.monotonic()
    res = run_launch(args) if launch else run_ring(args)
    print(f"plan {res['P']}x{res['D']}, micro-batch {res['micro_batch']}, {args.steps} steps, "
          f"{time.monotonic() - started:.0f} s")
    print(f"host copy of the weights: {weights / 1e6:.1f} MB (the model as built; left out of every peak below)")
    print(f"{'stage':>5} {'estimate MB':>12} {'peak MB':>9} {'budget MB':>10} {'peak/budget':>12} {'error':>7}")
    over, errors = [], []
    for row in res["stages"]:
        est, peak = row["estimate"], row["peak"]
        ratio = None if peak is None else peak / args.memory
        err = None if peak is None or not est else abs(peak - est) / est
        over += [ratio] if ratio is not None else []
        errors += [err] if err is not None else []
        print(f"{row['stage']:>5} {_mb(est):>12} {_mb(peak):>9} {_mb(args.memory):>10} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>12} {'-' if err is None else f'{err:+.2f}':>7}")
    if res.get("worker_bytes"):
        print(f"every worker also holds {_mb(res['worker_bytes'])} MB beyond its tensors (cuBLAS's workspaces, "
              f"measured by the calibration; in each estimate)")
    cal = res["calibration_peak"]
    print(f"calibration: peak {_mb(cal)} MB above the built model, budget {_mb(args.memory)} MB"
          + res.get("note", ""))
    fmt = lambda x: "nan" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"bench memory: plan={res['P']}x{res['D']} worker_peak_over_budget={fmt(max(over, default=None))} "
          f"calibration_peak_over_budget={fmt(None if cal is None else cal / args.memory)} "
          f"estimate_error={fmt(max(errors, default=None))}")


if __name__ == "__main__":
    main()
