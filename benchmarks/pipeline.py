"""Pipeline throughput: Varuna's executor at P=2 vs torch.distributed.pipelining vs one process.

Same model (8 blocks of Linear(512, 512) + ReLU, MSE loss against random targets), same split
(after block 3: blocks 0-3 on stage 0, 4-7 on stage 1), same micro-batches (4 examples, m per
step), plain SGD, one torch thread per process. Contenders:

- single      one process runs the m micro-batches one after another (forward+backward each),
              then the optimizer step
- ours/<schedule>/rc<0|1>   trainer.Varuna at P=2, D=1 via trainer.launch, for the schedules
              of the schedule table (varuna, gpipe, 1f1b, zb-h1), recompute off (rc0) and on (rc1)
- torch/<schedule>          torch.distributed.pipelining over gloo, 2 processes, every schedule it
              ships: ScheduleGPipe, Schedule1F1B and ScheduleInterleavedZeroBubble (zb-h1) on the
              same halves; ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on 4 chunks of
              2 blocks looped (rank r holds chunks r and r+2); ScheduleZBVZeroBubble and
              ScheduleDualPipeV on the same chunks in a V (rank 0 holds 0 and 3, rank 1 holds 1 and 2).
              Each rank holds 4 blocks either way; `ratio_vs_torch` is against the best of them
- ceiling     two `single` processes run concurrently: their combined throughput over one alone
              is what this machine gives two single-threaded processes (the efficiency ceiling)

Two worker processes are started once, by trainer.launch (P=2, D=1, cut forced with `cuts=`,
1 thread each, OMP_NUM_THREADS=1), and host every contender: worker k is Varuna's stage k, holds
torch's PipelineStage k on the same gloo world group that Varuna initialised, and a whole model
for `single` (worker 0) and `ceiling` (both). They step through the same plan, contenders
alternating (A B C ... A B C ..., `--rounds` rounds, the order rotated every round), separated by
a barrier; the idle side sleeps in it. Each run does `--warmup` untimed steps, then `--iters`
steps each timed with perf_counter; a contender's step time is the median over all its timed
steps (for a pipeline, the slower stage's median). Results go back through JSON files in a
temporary directory. No process start-up is ever timed.

Idle is measured two ways per stage: time blocked in receives (PeerChannel.wait_s, ours only)
and 1 - compute/wall, compute being the time in forward / recompute / backward / optimizer.step
(the executor's dispatch table and torch's forward_one_chunk / backward_one_chunk are wrapped
here; the engine is not modified). `cpu ms` is CPU time per step over all threads of the
contender's processes: unlike wall time it hardly moves with other load on the machine, and
`/single` shows the CPU overhead a contender adds to the same work. The processes run at
`--nice` (default -10) so that other work on a shared machine disturbs the timings less.

Run:  python benchmarks/pipeline.py [--quick] [--m 8] [--rounds R] [--iters N] [--nice N]
The last line is  `bench pipeline: ratio_vs_torch=<best ours / best torch>
efficiency=<best ours with recompute off / (P x single x m/(m+P-1))>
of_ceiling=<that efficiency / the machine's ceiling (ceiling / P), measured in the same run>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.planning.schedule import SCHEDULES  # noqa: E402  (after the path insert)

__all__ = ["main"]

WIDTH, LAYERS, CUT, MICRO, P = 512, 8, 3, 4, 2
# name -> (torch's class, which chunks of 2 blocks each rank holds: None for the two halves)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", None), "1f1b": ("Schedule1F1B", None),
    "zb-h1": ("ScheduleInterleavedZeroBubble", None),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", ((0, 2), (1, 3))),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", ((0, 2), (1, 3))),
    "zbv": ("ScheduleZBVZeroBubble", ((0, 3), (1, 2))),
    "dualpipev": ("ScheduleDualPipeV", ((0, 3), (1, 2))),
}
N_BATCHES = 4   # distinct global batches, cycled


# -- the model and data (built identically in every process) --------------------------------------

def _model():
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])

        def forward(self, x, y):
            return nn.functional.mse_loss(self.body(x), y)

    torch.manual_seed(0)
    return MLP()


def _batches(batch: int):
    import torch
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(batch, WIDTH, generator=g), "y": torch.randn(batch, WIDTH, generator=g)}
            for _ in range(N_BATCHES)]


def _sgd(params):
    import torch
    return torch.optim.SGD(params, lr=1e-3)


class _Clock:
    """Accumulates the seconds spent inside wrapped callables (compute)."""

    def __init__(self) -> None:
        self.s = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s += time.perf_counter() - t
        return timed


def _timed_loop(step, ns, clock: _Clock, wait=lambda: 0.0) -> dict:
    for i in range(ns.warmup):
        step(i)
    times, compute0, wait0, cpu0 = [], clock.s, wait(), time.process_time()
    for i in range(ns.iters):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    total = sum(times)
    return {"times": times, "compute_frac": (clock.s - compute0) / total, "wait_frac": (wait() - wait0) / total,
            "cpu_per_step": (time.process_time() - cpu0) / ns.iters}


# -- the worker (one per stage, started by trainer.launch; each also hosts the other contenders) --

def _worker(ns) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, schedules

    from trainer import Varuna
    from trainer.planning.schedule import Kind

    batches = _batches(ns.batch)
    m = ns.batch // MICRO

    # ours: Varuna initialises torch.distributed (gloo, world P) and the ZeroMQ channel
    varuna = Varuna(_model(), None, lambda n, d: {k: v[:n] for k, v in batches[0].items()},
                    ns.batch, MICRO, schedule="varuna", recompute=False)
    varuna.set_optimizer(_sgd(varuna.parameters()))
    rank = varuna.stage
    assert torch.get_num_threads() == 1, torch.get_num_threads()
    clocks = {k: _Clock() for k in ("ours", "torch", "single")}
    ex = varuna.executor
    # An instance attribute shadows the class's dispatch table: time the compute actions only.
    compute = (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD, Kind.WEIGHT)
    ex._DISPATCH = {k: (clocks["ours"].wrap(f) if k in compute else f) for k, f in type(ex)._DISPATCH.items()}
    varuna.optimizer.step = clocks["ours"].wrap(varuna.optimizer.step)

    # torch.distributed.pipelining, over the same gloo world group: each schedule on its own copy
    # of the model (the halves, or chunks of 2 blocks), with its own optimizer
    scheds = {}
    for name, (cls, chunks) in TORCH_SCHEDULES.items():
        blocks = list(_model().body)
        if chunks is None:
            ids, n = (rank,), P
            mods = [nn.Sequential(*(blocks[:CUT + 1] if rank == 0 else blocks[CUT + 1:]))]
        else:
            ids, n = chunks[rank], 2 * P
            mods = [nn.Sequential(*blocks[2 * i:2 * i + 2]) for i in ids]
        stages = [PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(mods, ids)]
        for st in stages:
            for fn in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(st, fn):
                    setattr(st, fn, clocks["torch"].wrap(getattr(st, fn)))
        multi = issubclass(getattr(schedules, cls), schedules.PipelineScheduleMulti)
        sched = getattr(schedules, cls)(stages if multi else stages[0], m, loss_fn=nn.functional.mse_loss)
        opt = _sgd([p for mod in mods for p in mod.parameters()])
        scheds[name] = (sched, opt, clocks["torch"].wrap(opt.step), 0 in ids, n - 1 in ids)

    # single: the whole model, micro-batch after micro-batch
    whole = _model()
    s_opt = _sgd(whole.parameters())
    fwd_bwd = clocks["single"].wrap(lambda x, y, w: (whole(x, y) * w).backward())
    s_opt_step = clocks["single"].wrap(s_opt.step)

    def single_step(i):
        b = batches[i % N_BATCHES]
        for k in range(m):
            fwd_bwd(b["x"][k * MICRO:(k + 1) * MICRO], b["y"][k * MICRO:(k + 1) * MICRO], MICRO / ns.batch)
        s_opt_step()
        s_opt.zero_grad(set_to_none=True)

    def torch_step(sched, opt, opt_step, first, last):
        def step(i):
            b = batches[i % N_BATCHES]
            # in a V the first and the last stage are on rank 0
            sched.step(*((b["x"],) if first else ()), **(dict(target=b["y"], losses=[]) if last else {}))
            opt_step()
            opt.zero_grad(set_to_none=True)
        return step

    def ours_step(i):
        varuna.step(batches[i % N_BATCHES])

    results: dict[str, list[dict]] = {}
    for r in range(ns.rounds):
        for name, ranks, extra in _rotated(r):
            dist.barrier()
            if rank not in ranks:
                continue
            if name.startswith("ours/"):
                varuna.schedule, varuna.recompute = extra["schedule"], extra["recompute"]
                out = _timed_loop(ours_step, ns, clocks["ours"], wait=lambda: varuna.channel.wait_s)
            elif name.startswith("torch/"):
                out = _timed_loop(torch_step(*scheds[extra["schedule"]]), ns, clocks["torch"])
            else:
                out = _timed_loop(single_step, ns, clocks["single"])
            results.setdefault(name, []).append(out)
    dist.barrier()
    with open(os.path.join(ns.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    varuna.close()


# -- driver ---------------------------------------------------------------------------------------

def _contenders() -> list[tuple[str, tuple[int, ...], dict]]:
    out = [("single", (0,), {}), ("ceiling", (0, 1), {})]
    for sched in SCHEDULES:
        for rc in (False, True):
            out.append((f"ours/{sched}/rc{int(rc)}", (0, 1), {"schedule": sched, "recompute": rc}))
    for sched in TORCH_SCHEDULES:
        out.append((f"torch/{sched}", (0, 1), {"schedule": sched}))
    return out


def _rotated(r: int):
    c = _contenders()
    k = r % len(c)
    return c[k:] + c[:k]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 60 s)")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step (batch = 4 m)")
    ap.add_argument("--rounds", type=int, default=None, help="alternation rounds (default 10, quick 2)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed steps per contender per round (default 20, quick 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before each run (default 3, quick 2)")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness of the benchmark's processes (default -10 where permitted, so that "
                         "other work on the machine disturbs the timings less; 0 to leave it)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    ns.rounds = ns.rounds or (2 if ns.quick else 10)
    ns.iters = ns.iters or (10 if ns.quick else 20)
    ns.warmup = ns.warmup if ns.warmup is not None else (2 if ns.quick else 3)
    if ns.worker:
        _worker(ns)
        return 0

    from trainer.launch import launch

    m = ns.m
    batch = MICRO * m
    print(f"# {ns.rounds} rounds x {ns.iters} timed steps (+{ns.warmup} warm-up) per contender; "
          f"m={m}, micro-batch {MICRO}, batch {batch}, cut after block {CUT}; 1 thread per process", flush=True)
    nice = _renice(ns.nice)
    load0 = os.getloadavg()[0]
    if load0 > 0.5:
        print(f"# warning: load average {load0:.1f} on {os.cpu_count()} cores before starting: other processes "
              "compete for the CPUs, so wall-clock numbers below are pessimistic and noisy (cpu ms is not)",
              flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as out:
        args = ["--worker", "--out", out, "--batch", batch, "--rounds", ns.rounds, "--iters", ns.iters,
                "--warmup", ns.warmup]
        result = launch(__file__, args, stages=P, replicas=1, cuts=[CUT], threads=1, timeout=900)
        if not result.ok:
            for rank, err in enumerate(result.errors):
                sys.stderr.write(f"--- rank {rank} stderr ---\n{err[-4000:]}\n")
            print(f"bench pipeline: FAILED ({result.reason})")
            return 1
        res = {}
        for rank in range(P):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                for name, runs in json.load(f).items():
                    res.setdefault(name, [[] for _ in range(P)])[rank].extend(runs)
    print(f"# {time.perf_counter() - t0:.1f}s in all; nice {nice}; load average before {load0:.2f}, "
          f"after {os.getloadavg()[0]:.2f} (ours adds ~2)", flush=True)
    return _report(res, m, batch)


def _renice(nice: int) -> int:
    """Set this process's niceness (inherited by the workers); returns the one in effect."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except (PermissionError, OSError):
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def _report(res, m: int, batch: int) -> int:
    """`res[name][rank]` is the list of that rank's runs of contender `name`."""

    def times(name: str, rank: int) -> list[float]:
        return [t for run in res[name][rank] for t in run["times"]]

    def frac(name: str, rank: int, key: str) -> float:
        runs = res[name][rank]
        return sum(x[key] * sum(x["times"]) for x in runs) / sum(sum(x["times"]) for x in runs)

    single = batch / statistics.median(times("single", 0))
    ceiling = sum(batch / statistics.median(times("ceiling", r)) for r in range(2)) / single
    ideal = P * single * m / (m + P - 1)
    bubble = (P - 1) / (m + P - 1)
    rate = {"single": single}
    for name in res:
        if name.startswith(("ours/", "torch/")):
            # every stage runs the same number of steps back to back: the slower median sets the pace
            rate[name] = batch / max(statistics.median(times(name, r)) for r in range(P))
    ours = {n: v for n, v in rate.items() if n.startswith("ours/")}
    torch_ = {n: v for n, v in rate.items() if n.startswith("torch/")}
    best_ours, best_torch = max(ours.values()), max(torch_.values())
    best_rc0 = max(v for n, v in ours.items() if n.endswith("rc0"))

    def cpu(name: str) -> float:   # CPU seconds per step, all threads of all its processes
        ranks = range(P) if name != "single" else (0,)
        return sum(sum(x["cpu_per_step"] for x in res[name][r]) / len(res[name][r]) for r in ranks)

    print(f"\n{'contender':<23}{'step ms':>8}{'samples/s':>10}{'/torch':>7}{'eff':>7}{'cpu ms':>8}{'/single':>8}"
          f"  idle s0/s1: recv-wait  1-compute/wall")
    for name, r in rate.items():
        eff = r / (ideal if name != "single" else single)
        line = (f"{name:<23}{1e3 * batch / r:>8.2f}{r:>10.0f}{r / best_torch:>7.2f}{eff:>7.3f}"
                f"{1e3 * cpu(name):>8.1f}{cpu(name) / cpu('single'):>8.2f}  ")
        if name == "single":
            line += f"{'-':>21}  {1 - frac(name, 0, 'compute_frac'):>14.3f}"
        else:
            w = [frac(name, s, "wait_frac") for s in range(P)]
            c = [1 - frac(name, s, "compute_frac") for s in range(P)]
            wait = f"{w[0]:.3f} / {w[1]:.3f}" if name.startswith("ours/") else "-"
            line += f"{wait:>21}  {c[0]:.3f} / {c[1]:.3f}"
        print(line)
    print(f"(theoretical idle (P-1)/(m+P-1) = {bubble:.3f}; cpu ms: CPU time per step summed over the "
          f"contender's processes and threads, /single: that over the single process's)")
    print(f"\nsingle process: {single:.0f} samples/s; ideal P={P} pipeline at m={m}: {ideal:.0f} samples/s "
          f"(P x single x m/(m+P-1))")
    print(f"machine ceiling: two single-threaded processes together = {ceiling:.3f} x one alone "
          f"(efficiency ceiling ~{ceiling / P:.3f}; best ours recompute off reaches "
          f"{best_rc0 / ideal / (ceiling / P):.2f} of it)")
    print(f"best ours {max(ours, key=ours.get)} {best_ours:.0f}/s, best torch {max(torch_, key=torch_.get)} "
          f"{best_torch:.0f}/s, best ours recompute off {best_rc0:.0f}/s")
    # no schedule beats the machine: P processes at its ceiling with no bubble at all
    print(f"the most any schedule can reach here: ceiling x single = {ceiling * single:.0f}/s, "
          f"{ceiling * single / best_torch:.2f}x the best torch")
    print(f"bench pipeline: ratio_vs_torch={best_ours / best_torch:.3f} efficiency={best_rc0 / ideal:.3f} "
          f"of_ceiling={best_rc0 / ideal / (ceiling / P):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
