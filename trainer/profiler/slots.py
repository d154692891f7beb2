"""All of a model's compute measurements (segments, then optimizer steps) as one job, run alone
or in one forked process per slot of a host whose every slot is busy at once."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.engine.precision import Precision
from trainer.errors import ConfigError
from trainer.graph.partition import StageSlice
from trainer.profiler.common import _fork_and_collect
from trainer.profiler.segments import SegmentMeasurement, measure_segments, measure_segments_interleaved, resident
from trainer.profiler.steps import OptimizerFactory, measure_steps

__all__: list[str] = []


def in_flight(wanted: int, size: int, largest: int) -> int:
    """Micro-batches of `size` to keep in flight while timing them: `wanted`, but never more than
    `largest` (the global batch, else the largest size measured) holds. A step never has more
    micro-batches than its batch holds, and an outside probe's calibration held four micro-batches
    of the whole batch at once (1.7 GB of a 350 MB slot for a model whose whole training state was
    0.5 GB)."""
    return max(1, min(wanted, largest // size))


@dataclass
class _Job:
    slices: list[StageSlice]
    batches: dict[int, dict[str, torch.Tensor]]
    segments: list[int]
    device: torch.device
    precision: Precision
    repeats: int
    warmup: int
    factory: OptimizerFactory | None
    optimizer_factor: float
    in_flight: int = 1
    batch: int | None = None   # the global batch: never more micro-batches in flight than it holds

    def run(self, between: Callable[[], object] | None = None
            ) -> tuple[dict[int, dict[int, SegmentMeasurement]], list[tuple[float, int, int]]]:
        """Segments, then (after `between()`: the slots meet there) optimizer steps."""
        per_size = {b: measure_segments_interleaved(self.slices, batch, device=self.device, precision=self.precision,
                                                    segments=self.segments, repeats=self.repeats, warmup=self.warmup,
                                                    in_flight=in_flight(self.in_flight, b, self.batch or max(self.batches)))
                    for b, batch in self.batches.items()}
        if between is not None:
            between()
        steps = []
        for k in self.segments:
            # one segment's parameters on the device at a time, each copy and state freed before the next
            with resident(self.slices[k].module, self.device) as module:
                steps += measure_steps([list(module.parameters())], self.factory,
                                       optimizer_factor=self.optimizer_factor, repeats=self.repeats,
                                       warmup=self.warmup, device=self.device)
        # A stage runs one STEP over all of its segments: one call's fixed costs, not one per
        # segment. Take all but one of those off, so that the segments' times add up to one STEP
        # of them all; the fixed cost is a step over one one-element parameter.
        total = sum(t for t, *_ in steps)
        if len(steps) > 1 and total > 0:
            one = torch.zeros(1, device=self.device, requires_grad=True)
            (fixed, *_), = measure_steps([[one]], self.factory, optimizer_factor=self.optimizer_factor,
                                        repeats=max(self.repeats, 5), warmup=self.warmup, device=self.device)
            whole = max(total - (len(steps) - 1) * fixed, total / len(steps))
            steps = [(t * whole / total, *rest) for t, *rest in steps]
        return per_size, steps

    def filler(self) -> None:
        """Some of the same work, results dropped: keeps a finished slot busy for the others."""
        b = min(self.batches)
        measure_segments(self.slices, self.batches[b], device=self.device, precision=self.precision,
                         segments=self.segments[:1], repeats=1, warmup=0)


def _busy_slot(job: _Job, threads: int, work: Callable[[], object], barrier, done, conn) -> None:
    """One forked slot: ``work()`` once every slot is ready, its result to the parent, then more
    of the same work until all have finished, so that every measurement sees the host busy."""
    try:
        torch.set_num_threads(threads)
        barrier.wait(timeout=60)
        conn.send(work())
        while not done.is_set():
            job.filler()
    except BaseException as exc:  # reported to the parent, which raises
        try:
            conn.send(f"{type(exc).__name__}: {exc}")
        except Exception:
            pass
    finally:
        conn.close()


def _slot_main(job: _Job, threads: int, barrier, done, conn) -> None:
    # The workers of a host step their optimizers at the same moment (the step's all-reduce
    # lines them up), and the step is bound by memory bandwidth: time it with every slot
    # stepping too, not beside another slot's compute.
    _busy_slot(job, threads, lambda: job.run(between=lambda: barrier.wait(timeout=1800)), barrier, done, conn)


def _run_concurrently(job: _Job, slots: int, timeout_s: float = 1800.0):
    """Run `job` in `slots` forked processes at once (one torch thread each), as the workers of
    a host whose every slot is busy share its cores and memory bandwidth; each number is the
    slowest slot's (each slot's being a median over repeats): replicas run in lock-step and a
    pipeline is paced by its slowest stage, so the slowest core sets the pace. A slot that
    finishes first repeats some work until all have finished, so every measurement sees a fully
    loaded host."""
    if "fork" not in mp.get_all_start_methods():
        raise ConfigError("profiling several CPU slots at once needs fork (Linux)", hint="use gpus_per_node=None")
    threads = torch.get_num_threads()
    if threads != 1:
        # GNU OpenMP's thread pool does not survive fork: a forked child that runs parallel
        # regions may hang once the parent has used them.
        raise ConfigError(f"profiling {slots} CPU slots at once forks one process per slot, which needs one "
                          f"torch thread per slot (this process has {threads})",
                          hint="call torch.set_num_threads(1) before profiling, as each worker of such a host runs")
    ctx = mp.get_context("fork")
    barrier, done = ctx.Barrier(slots), ctx.Event()
    results = _fork_and_collect(ctx, _slot_main, [(job, threads, barrier, done)] * slots, timeout_s=timeout_s,
                                what="concurrent profiling", who="a profiling slot", on_exit=done.set, join_s=30.0)
    per_size = {}
    for b in results[0][0]:
        per_size[b] = {}
        for k in results[0][0][b]:
            ms = [res[0][b][k] for res in results]
            split = all(m.input_grad_s is not None for m in ms)
            working = [m.working_bytes for m in ms if m.working_bytes is not None]
            per_size[b][k] = SegmentMeasurement(
                max(m.forward_s for m in ms), max(m.recompute_s for m in ms),
                max(m.backward_s for m in ms), ms[0].activation_bytes, ms[0].peak_activation_bytes,
                max(m.input_grad_s for m in ms) if split else None,
                max(m.weight_grad_s for m in ms) if split else None,
                ms[0].split_bytes if split else None,
                max(working) if working else None)
    steps = [(max(res[1][i][0] for res in results), *results[0][1][i][1:]) for i in range(len(results[0][1]))]
    return per_size, steps


def _probe_main(job: _Job, size: int, barrier, done, conn) -> None:
    _busy_slot(job, 1, lambda: measure_segments_interleaved(
        job.slices, job.batches[size], device=job.device, precision=job.precision, segments=job.segments,
        repeats=job.repeats, warmup=job.warmup, in_flight=job.in_flight), barrier, done, conn)


def busy_probe(job: _Job, alone: dict[int, dict[int, SegmentMeasurement]], slots: int,
               timeout_s: float = 600.0) -> float:
    """How many times slower a slot computes with ``slots`` of them busy at once (forked, one
    thread each) than ``alone`` measured it: the largest micro-batch size timed again, the slowest
    slot's time per segment, as `_run_concurrently` takes it. Where other daemons share a CPU
    machine: its cores and memory bandwidth are theirs too (trainer.planning.planner). The
    largest size because it is the one memory bandwidth binds: a local ring's GPT computed 0.9x
    at micro-batches of 1 and 2, 1.0x at 4 and 1.26x at 16 with two slots busy, so the ratio at
    another size would promise plans that fill the machine too much."""
    if "fork" not in mp.get_all_start_methods() or torch.get_num_threads() != 1:
        return 0.0   # as in _run_concurrently: forked slots need one thread each
    size = max(job.batches)
    ctx = mp.get_context("fork")
    barrier, done = ctx.Barrier(slots), ctx.Event()
    results = _fork_and_collect(ctx, _probe_main, [(job, size, barrier, done)] * slots, timeout_s=timeout_s,
                                what="the busy probe", who="a probing slot", on_exit=done.set, join_s=30.0)
    busy_s = sum(max(res[k].forward_s + res[k].backward_s for res in results) for k in results[0])
    alone_s = sum(alone[size][k].forward_s + alone[size][k].backward_s for k in results[0])
    return busy_s / alone_s if alone_s > 0 else 0.0
