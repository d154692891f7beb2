"""The profiler: measure a model once and write its scale-invariant `Calibration`.

    profiler = Profiler(model, get_batch_fn, out_folder="profiles")
    profiler.set_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))   # optional
    calibration = profiler.profile_all([1, 2, 4, 8])

What is measured (medians over `repeats` runs after `warmup` runs):

* per cut-point segment (the model sliced at *every* cut point, one module per segment) and per
  micro-batch size: the forward without autograd (`forward_s`, a FORWARD of a recomputing
  stage; on the last segment, which only the last stage runs and never recomputes, the forward
  with autograd), the forward with autograd (`recompute_s`: a RECOMPUTE, and the FORWARD of a
  stage that keeps its graph), and a real autograd backward given an upstream gradient of the output's
  shape (`backward_s`; on the last segment, the loss's backward as the executor does it), with
  several micro-batches in flight as a running pipeline interleaves them
  (`measure_segments_interleaved`: a backward after other micro-batches' forwards, as the
  executor runs it, not straight after its own). The
  input activation is the real boundary tensor of the previous segment on a sample batch;
  `activation_bytes` is the size of the segment's output boundary (its gradient has the same
  size); `peak_activation_bytes` is what autograd saves for one micro-batch (on CPU the distinct
  storages packed by `torch.autograd.graph.saved_tensors_hooks`, parameters excluded; on CUDA the
  rise of `max_memory_allocated` during that forward);
* per segment: parameter bytes (a weight shared by several segments, like a tied embedding, is
  counted in each: every stage using it holds a copy), optimizer-state bytes (measured after a
  step of the optimizer given to `set_optimizer`, otherwise `optimizer_factor` x the parameter
  bytes: 2 for Adam), and `step_s`: what the engine's STEP does for those parameters (its
  squared gradient norms, the finiteness check, then the optimizer's step, on copies so that
  the model is left untouched; on CPU scaled so that the segments' times add up to one STEP of
  all of them, which pays a call's fixed costs once);
* tied weights (one tensor used by several segments, like a tied embedding and LM head): the
  segments holding each and its bytes (`Calibration.tied`), for the all-reduce that keeps the
  copies equal at any D;
* the network, in two helper processes on loopback (so no launcher and no process group of the
  caller is needed): a `PeerChannel` ping-pong fitted to ``latency + bytes / bandwidth`` for
  the "intra" link, with the CPU time a send call takes and a receive of a message that has
  already arrived (`send_overhead_s`, `recv_overhead_s`: stage busy time, the medians over the
  sizes that fit one frame) taken out of the latency; and gloo `all_reduce` between the two,
  fitted to the ring formula of `LinkCost.allreduce_s` at D = 2 (larger rings follow from the
  formula). "inter" gets the same numbers unless `inter_link` / `inter_allreduce` give measured
  cross-host costs (this machine cannot measure a link it does not have).

On CPU the workers of one host share its cores' time, caches and memory bandwidth, so a slot of a
busy host is slower than a lone worker: `gpus_per_node=n` measures with n slots busy at once
(n forked processes doing the same measurements; each number is the slowest slot's, since the
cores of a VM are not equally fast and lock-step replicas or a pipeline's bottleneck wait for
the slowest) and names the device kind 'cpu-<n>slots'.

The result depends on neither P nor D. It is keyed by (model fingerprint, device kind): the
fingerprint hashes the parameter and buffer names, shapes and dtypes, the captured graph's op
sequence (with constant arguments), the cut points and the precision, never the
weights' values. It is saved as `<out_folder>/calibration-<fingerprint>-<device kind>.json`;
`from_cache=True` returns a saved calibration of the same key that covers the sizes asked for,
and `add_to_existing=True` measures only what a saved one lacks and merges the two.

CPU timings depend on the allocator: workers run with glibc's trimming and mmap thresholds
raised (`trainer.launch.worker_environment`), which removes thousands of page faults a step.
Profile in that environment too (the daemon's VARUNA_PROFILE run is a worker; a script can be
started with `python -m trainer.launch -P 1`); the profiler logs a warning otherwise.

The measurement functions (`measure_segments[_interleaved]`, `measure_network`,
`model_fingerprint`) work on their own, so a daemon's worker can call them without the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
from torch import fx, nn

from protocol.frames import CHUNK_BYTES
from trainer.planning.calibration import (
    LINK_KINDS,
    Calibration,
    CalibrationError,
    LinkCost,
    SegmentCost,
    SegmentProfile,
    TiedWeights,
)
from trainer.errors import ConfigError, VarunaError
from trainer.launch import free_ports
from trainer.graph.partition import ACTIVATION, StageSlice, TracedModel, capture_model, slice_stages
from trainer.engine.precision import Precision, autocast

__all__ = [
    "ProfilerError",
    "Profiler",
    "SegmentMeasurement",
    "model_fingerprint",
    "device_kind_of",
    "segment_slices",
    "measure_segments",
    "measure_segments_interleaved",
    "measure_steps",
    "measure_network",
    "tied_weights",
    "calibration_path",
]

log = logging.getLogger("varuna.profiler")

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_WORKER_MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")   # set by trainer.launch
_LINK_SIZES = (1 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
_ALLREDUCE_SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
_AR_PARAM_NUMEL = 1 << 18   # 1 MiB of fp32 per parameter when the all-reduce is timed
_ONE_FRAME = CHUNK_BYTES   # larger messages go in several parts


class ProfilerError(VarunaError, RuntimeError):
    """A measurement could not be taken (a helper process failed or timed out)."""


# -- identity ----------------------------------------------------------------------------------------

def _target_name(node: fx.Node) -> str:
    fn = node.target
    if node.op == "call_function" and hasattr(fn, "__qualname__") and not isinstance(fn, torch._ops.OperatorBase):
        return f"{getattr(fn, '__module__', '')}.{fn.__qualname__}"   # operator.getitem and the like
    return str(fn)   # aten ops print as 'aten.linear.default'; no address in either


def model_fingerprint(model: nn.Module, *, traced: TracedModel | None = None,
                      sample: Mapping[str, torch.Tensor] | None = None, precision: str = "fp32") -> str:
    """A stable hex digest of what decides the model's costs: the names, shapes and dtypes of its
    parameters and buffers, its captured graph's op sequence (aten ops with their constant
    arguments, so layer settings such as a dropout rate count), its cut points and the
    precision. Weights' values do not count. Give the captured model, or a sample batch to
    capture it with."""
    if traced is None:
        if sample is None:
            raise ConfigError("model_fingerprint needs the captured model or a sample batch to capture it with")
        traced = capture_model(model, sample)
    h = hashlib.sha256()
    h.update(f"precision={precision}\n".encode())
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    gm = traced.graph_module
    for node in gm.graph.nodes:
        consts = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (int, float, str, bool, type(None)))]
        h.update(f"{node.op}|{_target_name(node)}|{consts}\n".encode())
    h.update(("markers=" + ",".join(traced.marker_names)).encode())
    return h.hexdigest()[:32]


def _device_of(model: nn.Module) -> torch.device:
    t = next(iter(model.parameters()), None)
    return t.device if t is not None else torch.device("cpu")


def device_kind_of(device: torch.device, slots: int = 1) -> str:
    """The CUDA device's name (e.g. 'NVIDIA H200'), or 'cpu' for a host running one CPU worker
    and 'cpu-<n>slots' for a CPU slot of a host running n workers at once (they share its cores'
    time, caches and memory bandwidth, so a slot is slower than a lone worker)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type if slots <= 1 else f"{device.type}-{slots}slots"


def calibration_path(out_folder: str | os.PathLike[str], fingerprint: str, device_kind: str) -> Path:
    kind = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind)
    return Path(out_folder) / f"calibration-{fingerprint}-{kind}.json"


# -- segments ------------------------------------------------------------------------------------------

def segment_slices(traced: TracedModel) -> list[StageSlice]:
    """One module per cut-point segment: the graph sliced at every cut point."""
    return slice_stages(traced, list(range(len(traced.markers))))


@dataclass(frozen=True, slots=True)
class SegmentMeasurement:
    """One segment at one micro-batch size (seconds are medians)."""

    forward_s: float
    recompute_s: float
    backward_s: float
    activation_bytes: int
    peak_activation_bytes: int

    def cost(self) -> SegmentCost:
        return SegmentCost(self.forward_s, self.backward_s, self.recompute_s,
                           self.activation_bytes, self.peak_activation_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tied_weights(slices: Sequence[StageSlice]) -> tuple[TiedWeights, ...]:
    """Parameters that several segments hold (one storage: a tied embedding and LM head), as the
    segments holding each and its bytes."""
    holders: dict[int, tuple[list[int], int]] = {}
    for k, sl in enumerate(slices):
        for p in sl.module.parameters():
            segs, nbytes = holders.setdefault(p.untyped_storage().data_ptr(), ([], _nbytes(p)))
            if k not in segs:
                segs.append(k)
    return tuple(TiedWeights(tuple(segs), nbytes) for segs, nbytes in holders.values() if len(segs) > 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class _SavedBytes:
    """Bytes autograd keeps for backward: distinct storages packed by saved-tensor hooks,
    parameters (which stay alive anyway) excluded."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.total += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. wrappers)
            self.total += _nbytes(t)
        return t


def _batch_size_of(batch: Mapping[str, torch.Tensor]) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim():
            return v.shape[0]
    raise ConfigError("get_batch_fn returned no batch-first tensor")


def measure_segments(slices: Sequence[StageSlice], batch: Mapping[str, torch.Tensor], *,
                     device: torch.device | str = "cpu", precision: Precision = "fp32",
                     segments: Iterable[int] | None = None, repeats: int = 5, warmup: int = 2,
                     in_flight: int = 1) -> dict[int, SegmentMeasurement]:
    """Time the forward, recompute and backward of each segment in `segments` (default: all) on
    `batch` (one micro-batch, already on `device`). The slices' modules must be on `device`.

    Every repeat runs the whole chain of segments, in context: a forward without autograd and
    one with autograd, timed at each boundary, then one backward of the loss through the whole
    graph, timed by hooks on the boundary tensors (a hook fires when the gradient of its
    segment's output is complete). A stage of several segments runs them as one module and
    one backward too, so the segments' times add up to the stage's; measuring each segment
    in isolation instead adds the overhead of a separate backward per segment (~8% on the GPT
    blocks here). With `in_flight` = k > 1 a repeat runs k micro-batches as a pipeline's stage
    interleaves them (`measure_segments_interleaved`). Gradients accumulate into the parameters'
    `.grad`; callers reset them."""
    if in_flight < 1:
        raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
    device = torch.device(device)
    n = len(slices)
    wanted = sorted(set(range(n)) if segments is None else set(segments))

    def kwargs_for(k: int, x: torch.Tensor | None) -> dict[str, torch.Tensor]:
        kw = {name: batch[name] for name in slices[k].input_names}
        if slices[k].takes_activation:
            kw[ACTIVATION] = x
        return kw

    def chain(grad: bool) -> tuple[list[float], list[torch.Tensor]]:
        outs: list[torch.Tensor] = []
        x = None
        _sync(device)
        stamps = [time.perf_counter()]
        with torch.set_grad_enabled(grad), autocast(precision, device):
            for k in range(n):
                x = slices[k].module(**kwargs_for(k, x))
                _sync(device)
                stamps.append(time.perf_counter())
                outs.append(x)
        return [b - a for a, b in zip(stamps, stamps[1:])], outs

    def backward(outs: list[torch.Tensor]) -> list[float | None]:
        """Each segment's share of one backward through the chain (None: no gradient reached it)."""
        done: dict[int, float] = {}     # boundary k -> when the gradient of segment k's output was complete

        def stamp(k: int):
            def hook(_grad):
                _sync(device)
                done[k] = time.perf_counter()
            return hook

        handles = [outs[k].register_hook(stamp(k)) for k in range(n - 1) if outs[k].requires_grad]
        try:
            _sync(device)
            done[n - 1] = time.perf_counter()
            (outs[-1].float() * 1.0).backward()   # the loss, as the executor's last stage does
            _sync(device)
            end = time.perf_counter()
        finally:
            for h in handles:
                h.remove()
        out: list[float | None] = []
        for k in range(n):
            start, stop = done.get(k), done.get(k - 1, end) if k > 0 else end
            out.append(None if start is None else max(stop - start, 0.0))
        return out

    fwd: list[list[float]] = [[] for _ in range(n)]
    rec: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    act_bytes = [0] * n
    # `repeats` and `warmup` count micro-batches, in rounds of k: the same number of samples
    # (and about the same time) whatever k is
    rounds, warm = -(-repeats // in_flight), -(-warmup // in_flight)
    for r in range(warm + rounds):
        # k micro-batches in flight, in the order a pipeline's stage runs them: forwards without
        # the graph (a recomputing stage's FORWARDs), then forwards that keep it, all k graphs
        # alive at once (RECOMPUTEs ahead of their BACKWARDs, or the FORWARDs of a stage that
        # keeps activations), then the backwards oldest first. A backward then reads what its
        # forward saved after other micro-batches' work went through the caches, as in a
        # running pipeline; one micro-batch at a time finds it still cached and under-estimates.
        f_times = [chain(grad=False)[0] for _ in range(in_flight)]
        graphs = [chain(grad=True) for _ in range(in_flight)]
        r_times = [t for t, _ in graphs]
        act_bytes = [_nbytes(y) for y in graphs[0][1]]
        b_times = []
        while graphs:
            b_times.append(backward(graphs.pop(0)[1]))
        if r < warm:
            continue
        for k in range(n):
            fwd[k] += [t[k] for t in f_times]
            rec[k] += [t[k] for t in r_times]
            bwd[k] += [t[k] for t in b_times if t[k] is not None]
    params = [p for sl in slices for p in sl.module.parameters()]
    boundary = _boundaries(slices, kwargs_for, device, precision)
    out: dict[int, SegmentMeasurement] = {}
    for k in wanted:
        peak = _peak_bytes(slices[k], batch, boundary[k], device, precision, params)
        # The last stage never recomputes: its FORWARD always keeps the graph.
        forward_s = _median(rec[k]) if k == n - 1 else _median(fwd[k])
        backward_s = _median(bwd[k]) if bwd[k] else 0.0
        out[k] = SegmentMeasurement(forward_s, _median(rec[k]), backward_s, act_bytes[k], peak)
    return out


IN_FLIGHT = 4   # micro-batches in flight in an interleaved profile


def measure_segments_interleaved(slices: Sequence[StageSlice], batch: Mapping[str, torch.Tensor], *,
                                 in_flight: int = IN_FLIGHT, **kwargs) -> dict[int, SegmentMeasurement]:
    """`measure_segments` with `in_flight` micro-batches per repeat, interleaved as a pipeline's
    stage runs them (several forwards' graphs alive, each backward after the others' forwards):
    what the profiler uses, since the executor never runs one micro-batch alone."""
    return measure_segments(slices, batch, in_flight=in_flight, **kwargs)


def _boundaries(slices, kwargs_for, device, precision) -> list[torch.Tensor | None]:
    """Each segment's input activation (None for those that take none), without autograd."""
    out: list[torch.Tensor | None] = []
    x = None
    with torch.no_grad(), autocast(precision, device):
        for k, sl in enumerate(slices):
            out.append(x if sl.takes_activation else None)
            x = sl.module(**kwargs_for(k, x))
    return out


def _peak_bytes(sl: StageSlice, batch, x_in, device: torch.device, precision: Precision, params) -> int:
    mod = sl.module
    kw = {n: batch[n] for n in sl.input_names}
    if sl.takes_activation:
        kw[ACTIVATION] = x_in.detach().requires_grad_(x_in.is_floating_point())
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.enable_grad(), autocast(precision, device):
            y = mod(**kw)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del y
        return int(max(peak, 0))
    counter = _SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
            torch.enable_grad(), autocast(precision, device):
        y = mod(**kw)
    del y
    return int(counter.total)


# -- optimizer step ------------------------------------------------------------------------------------

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _engine_step(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """What the engine's STEP does for these parameters besides its all-reduces: the squared
    gradient norms (the engine's own function, so the two cannot drift apart), the finiteness
    check on their sum, then the optimizer's step."""
    from trainer.engine.precision import squared_norms

    math.isfinite(sum(squared_norms([p.grad for p in params if p.grad is not None])))
    optimizer.step()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                total += _nbytes(v)
    return total


def measure_steps(groups: Sequence[Sequence[nn.Parameter]], factory: OptimizerFactory | None, *,
                  optimizer_factor: float = 2.0, repeats: int = 5, warmup: int = 2,
                  device: torch.device | str = "cpu") -> list[tuple[float, int]]:
    """(step seconds, optimizer-state bytes) per parameter group, on copies of the parameters
    with random gradients. Without a factory, AdamW's step is timed and the state is
    `optimizer_factor` x the parameter bytes. On CPU the groups' repeats are interleaved (like
    `measure_segments`), which holds every group's copies at once; on a GPU one group at a time."""
    device = torch.device(device)
    given = factory is not None
    factory = factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    gen = torch.Generator().manual_seed(0)

    def setup(group):
        copies = []
        for p in group:
            c = p.detach().clone().requires_grad_(True)
            c.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float32) * 1e-3).to(device, p.dtype)
            copies.append(c)
        return copies, factory(copies) if copies else None

    def timed(copies, opt) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _engine_step(copies, opt)
        _sync(device)
        return time.perf_counter() - t0

    def result(group, opt, times) -> tuple[float, int]:
        if opt is None:
            return 0.0, 0
        if given:   # measured, 0 included: plain SGD keeps no state
            return _median(times), _state_bytes(opt)
        return _median(times), int(round(optimizer_factor * sum(_nbytes(p) for p in group)))

    if device.type == "cpu":
        states = [setup(g) for g in groups]
        times: list[list[float]] = [[] for _ in groups]
        for r in range(warmup + repeats):
            for i, (copies, opt) in enumerate(states):
                if opt is not None:
                    t = timed(copies, opt)
                    if r >= warmup:
                        times[i].append(t)
        return [result(g, opt, ts) for g, (_, opt), ts in zip(groups, states, times)]
    out = []
    for group in groups:
        copies, opt = setup(group)
        ts = [timed(copies, opt) for _ in range(warmup + repeats)][warmup:] if opt is not None else []
        out.append(result(group, opt, ts))
        del copies, opt
    return out


def _optimizer_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory building an optimizer of the same class and settings over other parameters."""
    cls, defaults = type(optimizer), dict(optimizer.defaults)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        try:
            return cls(params, **defaults)
        except TypeError:  # a constructor that does not take all of its defaults back
            return cls(params, lr=defaults.get("lr", 1e-3))

    return make


# -- all of a model's compute measurements, alone or with every slot of the host busy -----------------

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

    def run(self, between: Callable[[], object] | None = None
            ) -> tuple[dict[int, dict[int, SegmentMeasurement]], list[tuple[float, int]]]:
        """Segments, then (after `between()`: the slots meet there) optimizer steps."""
        per_size = {b: measure_segments_interleaved(self.slices, batch, device=self.device, precision=self.precision,
                                                    segments=self.segments, repeats=self.repeats, warmup=self.warmup,
                                                    in_flight=self.in_flight)
                    for b, batch in self.batches.items()}
        if between is not None:
            between()
        groups = [list(self.slices[k].module.parameters()) for k in self.segments]
        steps = measure_steps(groups, self.factory, optimizer_factor=self.optimizer_factor,
                              repeats=self.repeats, warmup=self.warmup, device=self.device)
        # A stage runs one STEP over all of its segments: one call's fixed costs, not one per
        # segment. Scale the segments' times so that together they make one STEP of them all
        # (on CPU, where measure_steps holds every group's copies anyway; a GPU may not fit them).
        union = list({id(p): p for g in groups for p in g}.values())
        total = sum(t for t, _ in steps)
        if self.device.type == "cpu" and len(groups) > 1 and union and total > 0:
            (whole, _), = measure_steps([union], self.factory, optimizer_factor=self.optimizer_factor,
                                        repeats=self.repeats, warmup=self.warmup, device=self.device)
            steps = [(t * min(1.0, whole / total), b) for t, b in steps]
        return per_size, steps

    def filler(self) -> None:
        """Some of the same work, results dropped: keeps a finished slot busy for the others."""
        b = min(self.batches)
        measure_segments(self.slices, self.batches[b], device=self.device, precision=self.precision,
                         segments=self.segments[:1], repeats=1, warmup=0)


def _slot_main(job: _Job, threads: int, barrier, done, conn) -> None:
    try:
        torch.set_num_threads(threads)
        barrier.wait(timeout=60)
        # The workers of a host step their optimizers at the same moment (the step's all-reduce
        # lines them up), and the step is bound by memory bandwidth: time it with every slot
        # stepping too, not beside another slot's compute.
        result = job.run(between=lambda: barrier.wait(timeout=1800))
        conn.send(result)
        while not done.is_set():
            job.filler()
    except BaseException as exc:  # reported to the parent, which raises
        try:
            conn.send(f"{type(exc).__name__}: {exc}")
        except Exception:
            pass
    finally:
        conn.close()


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
            per_size[b][k] = SegmentMeasurement(
                max(m.forward_s for m in ms), max(m.recompute_s for m in ms),
                max(m.backward_s for m in ms), ms[0].activation_bytes, ms[0].peak_activation_bytes)
    steps = [(max(res[1][i][0] for res in results), results[0][1][i][1]) for i in range(len(results[0][1]))]
    return per_size, steps


# -- network -------------------------------------------------------------------------------------------

def fit_affine(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(a, b) with t ~ a + b * n, least squares in relative error, a >= 0 and b > 0."""
    w = [1.0 / max(t, 1e-9) ** 2 for t in times]
    sw = sum(w)
    sn = sum(wi * n for wi, n in zip(w, sizes))
    st = sum(wi * t for wi, t in zip(w, times))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = sw * snn - sn * sn
    a, b = (0.0, 0.0) if det == 0 else ((st * snn - sn * snt) / det, (sw * snt - sn * st) / det)
    if a < 0:
        a = 0.0
        b = snt / snn if snn else 0.0
    if b <= 0:  # no measurable size dependence: a very fast link
        b = 1e-12
    return a, b


def _network_main(argv: Sequence[str]) -> None:
    """Entry point of one network helper process: `rank ports sizes ar_sizes repeats warmup`
    as JSON in argv[0]; rank 0 prints its timings as one JSON line."""
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    res = _network_measure(spec["rank"], spec["ports"], spec["sizes"], spec["ar_sizes"],
                           spec["repeats"], spec["warmup"])
    print(json.dumps(res), flush=True)


def _network_measure(rank, ports, sizes, ar_sizes, repeats, warmup) -> dict[str, list[float]]:
    import torch.distributed as dist

    from trainer.engine.comm import PeerChannel
    from trainer.net.netaddr import bound_gloo_backend

    ep = [f"tcp://127.0.0.1:{p}" for p in ports[:2]]
    chan = PeerChannel(bind=ep[rank], prev=ep[0] if rank else None, nxt=None if rank else ep[1],
                       job="profile", epoch=0, stage=rank, timeout_s=60.0)
    link: list[float] = []
    send_cpu: list[float] = []
    recv_cpu: list[float] = []
    pair_cpu: list[float] = []   # the whole process's CPU (ZeroMQ's I/O thread too) per round trip
    mb = 0
    for n in sizes:
        x = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        times, sends = [], []
        for r in range(warmup + repeats):
            if rank == 0:
                if r == warmup:
                    cpu0 = time.process_time()
                t0 = time.perf_counter()
                chan.send("act", mb, x)
                t1 = time.perf_counter()
                chan.recv("grad", mb)
                if r >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
                    sends.append(t1 - t0)
            else:
                y = chan.recv("act", mb)
                chan.send("grad", mb, y)
            mb += 1
        if rank == 0:
            pair_cpu.append((time.process_time() - cpu0) / repeats)
        # A receive of a message that has already arrived: the CPU the receiving stage spends.
        pause = 4 * _median(times) + 2e-3 if rank == 0 else 0.0
        recvs = []
        for r in range(warmup + repeats):
            if rank == 0:
                chan.send("act", mb, x)
                time.sleep(pause)
                t0 = time.perf_counter()
                chan.recv("grad", mb)
                if r >= warmup:
                    recvs.append(time.perf_counter() - t0)
            else:
                chan.send("grad", mb, chan.recv("act", mb))
            mb += 1
        if rank == 0:
            link.append(_median(times))
            send_cpu.append(_median(sends))
            recv_cpu.append(_median(recvs))
    # Let the last echo leave before closing.
    if rank == 1:
        chan.recv("act", mb)
    else:
        chan.send("act", mb, torch.zeros(1))
    chan.close()

    # The engine's own reduction (GradReducer: flat buckets, concatenated, summed, written back),
    # over gradients of layer-sized parameters, so that its copies and bucketing are timed too.
    from trainer.engine.data_parallel import GradReducer

    store = dist.TCPStore("127.0.0.1", ports[2], 2, rank == 0, timeout=timedelta(seconds=60))
    # bound to loopback: the host name's address may need a DNS lookup (trainer.net.netaddr)
    dist.init_process_group(bound_gloo_backend("127.0.0.1"), store=store, rank=rank, world_size=2)
    try:
        ar: list[float] = []
        for n in ar_sizes:
            numel = max(n // 4, 1)
            params = [nn.Parameter(torch.zeros(min(_AR_PARAM_NUMEL, numel - i)))
                      for i in range(0, numel, _AR_PARAM_NUMEL)]
            reducer = GradReducer(params, None, 2)
            times = []
            for r in range(warmup + repeats):
                for q in params:
                    q.grad = torch.ones_like(q)
                dist.barrier()
                t0 = time.perf_counter()
                reducer.reduce()
                if r >= warmup:
                    times.append(time.perf_counter() - t0)
            ar.append(_median(times))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # rank 1's lists of the link are empty: only rank 0 times
    return {"link": link, "send_cpu": send_cpu, "recv_cpu": recv_cpu, "pair_cpu": pair_cpu, "allreduce": ar}


def _network_child(spec: dict, conn) -> None:
    try:
        torch.set_num_threads(1)
        conn.send(_network_measure(spec["rank"], spec["ports"], spec["sizes"], spec["ar_sizes"],
                                   spec["repeats"], spec["warmup"]))
    except BaseException as exc:  # reported to the parent, which raises
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _run_helpers_forked(specs: list[dict], timeout_s: float) -> list[dict]:
    """Fork (no import of torch again, no re-run of the caller's main module, like DataLoader
    workers); each helper sends back its timings or its error."""
    return _fork_and_collect(mp.get_context("fork"), _network_child, [(spec,) for spec in specs],
                             timeout_s=timeout_s, what="network measurement", who="network helper")


def _fork_and_collect(ctx, target, args: list[tuple], *, timeout_s: float, what: str, who: str,
                      on_exit=None, join_s: float = 5.0) -> list:
    """Fork one process per entry of `args`, running target(*a, conn); each sends one result, or
    its error as a string, which raises ProfilerError here. `on_exit` runs before the children
    are joined (e.g. to release ones that keep working until all have reported)."""
    pipes = [ctx.Pipe(duplex=False) for _ in args]
    procs = [ctx.Process(target=target, args=(*a, w), daemon=True) for a, (_, w) in zip(args, pipes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        for p in procs:
            p.start()
    for _, w in pipes:
        w.close()
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for (r, _), p in zip(pipes, procs):
            if not r.poll(max(0.0, deadline - time.monotonic())):
                raise ProfilerError(f"{what} did not finish within {timeout_s:.0f}s")
            try:
                got = r.recv()
            except EOFError:
                p.join(timeout=5.0)
                raise ProfilerError(f"{who} exited with code {p.exitcode}") from None
            if isinstance(got, str):
                raise ProfilerError(f"{who} failed: {got}")
            results.append(got)
    finally:
        if on_exit is not None:
            on_exit()
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _run_helpers_spawned(specs: list[dict], timeout_s: float) -> list[dict]:
    """Fresh interpreters (where fork is unavailable); plain subprocesses rather than
    multiprocessing, so the caller's main module is never re-imported."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from trainer.profiler import _network_main; _network_main(sys.argv[1:])"
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for spec in specs]
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ProfilerError(f"network measurement did not finish within {timeout_s:.0f}s") from None
            if p.returncode:
                tail = err.decode(errors="replace").strip().splitlines()[-5:]
                raise ProfilerError(f"network helper exited with code {p.returncode}: " + " | ".join(tail))
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def measure_network(*, sizes: Sequence[int] = _LINK_SIZES, allreduce_sizes: Sequence[int] = _ALLREDUCE_SIZES,
                    repeats: int = 7, warmup: int = 2, timeout_s: float = 120.0,
                    io_threads_busy: bool = False) -> tuple[LinkCost, LinkCost]:
    """(send cost, all-reduce cost) between two helper processes on loopback: a PeerChannel
    ping-pong (one way = half the round trip) and the engine's gradient all-reduce (GradReducer
    over gloo) at D = 2, each fitted.
    Needs no launcher and leaves the caller's process groups and sockets alone.

    The per-message overheads are the send call's time and a receive of an arrived message.
    `io_threads_busy` (CPU workers that fill the host's cores) counts ZeroMQ's I/O threads as
    well: their CPU then competes with the stages' compute, so the receive overhead becomes what
    the process spends per round trip (one message each way) beyond the send call."""
    ports = free_ports(3)
    specs = [{"rank": r, "ports": ports, "sizes": list(sizes), "ar_sizes": list(allreduce_sizes),
              "repeats": repeats, "warmup": warmup} for r in range(2)]
    # A forked helper would inherit this process's default process group, if it has one; it
    # initialises its own.
    import torch.distributed as dist

    forkable = "fork" in mp.get_all_start_methods() and not (dist.is_available() and dist.is_initialized())
    run = _run_helpers_forked if forkable else _run_helpers_spawned
    got = run(specs, timeout_s)[0]
    a, b = fit_affine(list(sizes), got["link"])
    # The stages' own CPU per message, from the sizes that fit one frame (larger ones add copies
    # that scale with the bytes, which the bandwidth term covers); the rest of the one-way time
    # (the fit's constant, which includes both) is in flight.
    small = [i for i, n in enumerate(sizes) if n <= _ONE_FRAME] or [0]
    send_oh = _median([got["send_cpu"][i] for i in small])
    recv_oh = _median([got["recv_cpu"][i] for i in small])
    if io_threads_busy:
        recv_oh = max(recv_oh, _median([got["pair_cpu"][i] for i in small]) - send_oh)
    link = LinkCost(latency_s=max(0.0, a - send_oh - recv_oh), bandwidth_Bps=1.0 / b,
                    send_overhead_s=send_oh, recv_overhead_s=recv_oh)
    a, b = fit_affine(list(allreduce_sizes), got["allreduce"])
    allreduce = LinkCost(latency_s=a / 2, bandwidth_Bps=1.0 / b)   # ring at D=2: n / bw + 2 * latency
    return link, allreduce


# -- the profiler ------------------------------------------------------------------------------------

class Profiler:
    """Varuna's profiler: `Profiler(model, get_batch_fn, ...)`, `set_optimizer(...)` (optional),
    then `profile_all(micro_batch_sizes)` returns (and saves) the model's `Calibration`.

    `get_batch_fn(size, device)` returns one micro-batch dict of `size` examples. `device` -1 is
    the CPU, an int a CUDA ordinal (a string is taken as a torch device). `gpus_per_node` is the
    number of worker slots per host: on CPU, that many forked processes (one torch thread each:
    call `torch.set_num_threads(1)` first) measure at once and each number is the slowest's, so
    the calibration is that of a slot of a fully busy host (device kind 'cpu-<n>slots'); on CUDA
    it is accepted for Varuna compatibility and segments are measured one after another.
    `pstages_to_profile` limits the measurement to those segments; the others come from the saved
    calibration of the same key. Keyword-only extras: `precision`, `device_kind` (defaults to
    'cpu' or the CUDA device name), `repeats`/`warmup`, `optimizer_factor` (state bytes per
    parameter byte when no optimizer is set), `links`/`allreduce` (a LinkCost per link kind:
    skip measuring the network), `inter_link`/`inter_allreduce` (cross-host costs; by
    default "inter" gets the loopback numbers), and `in_flight` (micro-batches per repeat of
    `measure_segments_interleaved`: by default IN_FLIGHT on CPU, 1 on a GPU)."""

    def __init__(self, model: nn.Module, get_batch_fn: Callable[..., Mapping[str, torch.Tensor]],
                 device: int | str = -1, gpus_per_node: int | None = None, fp16: bool = False,
                 out_folder: str | os.PathLike[str] = "profiles", pstages_to_profile: Sequence[int] | None = None,
                 from_cache: bool = True, add_to_existing: bool = False, *, precision: Precision | None = None,
                 device_kind: str | None = None, repeats: int = 5, warmup: int = 2,
                 optimizer_factor: float = 2.0, links: Mapping[str, LinkCost] | None = None,
                 allreduce: Mapping[str, LinkCost] | None = None, inter_link: LinkCost | None = None,
                 inter_allreduce: LinkCost | None = None, in_flight: int | None = None) -> None:
        if repeats < 1 or warmup < 0:
            raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
        self.model = model
        self.get_batch_fn = get_batch_fn
        self.device = _device(device)
        if gpus_per_node is not None and gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        self.gpus_per_node = gpus_per_node
        # On CPU the slots of a host share its cores and memory: measure with all of them busy.
        self.slots = (gpus_per_node or 1) if self.device.type == "cpu" else 1
        self.precision: Precision = precision or ("fp16" if fp16 else "fp32")
        self.out_folder = Path(out_folder)
        self.pstages_to_profile = None if pstages_to_profile is None else sorted(set(pstages_to_profile))
        self.from_cache, self.add_to_existing = from_cache, add_to_existing
        self.repeats, self.warmup = repeats, warmup
        # A whole model's graphs k times over may not fit a GPU that holds one stage's in training.
        self.in_flight = in_flight if in_flight is not None else IN_FLIGHT if self.device.type == "cpu" else 1
        if self.in_flight < 1:
            raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
        self.optimizer_factor = optimizer_factor
        self._links = dict(links or {})
        self._allreduce = dict(allreduce or {})
        if inter_link is not None:
            self._links["inter"] = inter_link
        if inter_allreduce is not None:
            self._allreduce["inter"] = inter_allreduce
        self.traced = capture_model(model, get_batch_fn(2, _device_of(model)))
        self.fingerprint = model_fingerprint(model, traced=self.traced, precision=self.precision)
        self.device_kind = device_kind or device_kind_of(self.device, self.slots)
        self.n_segments = len(self.traced.markers) + 1
        if self.pstages_to_profile and not all(0 <= k < self.n_segments for k in self.pstages_to_profile):
            raise ConfigError(f"pstages_to_profile {self.pstages_to_profile} must lie in 0..{self.n_segments - 1}")
        if self.device.type == "cpu" and sys.platform.startswith("linux") \
                and not all(v in os.environ for v in _WORKER_MALLOC):
            log.warning("profiling outside the workers' environment (%s unset): CPU timings will not be "
                        "those of the workers; start the script with `python -m trainer.launch -P 1`",
                        " / ".join(_WORKER_MALLOC))
        self._factory: OptimizerFactory | None = None
        self.measured = 0            # segment x size measurements this profiler took
        self.network_measured = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.fingerprint, self.device_kind)

    @property
    def path(self) -> Path:
        return calibration_path(self.out_folder, self.fingerprint, self.device_kind)

    def set_optimizer(self, optimizer: torch.optim.Optimizer, init_loss_scale: float = 2.0**20,
                      min_loss_scale: float = 1.0) -> None:
        """Time the STEP with this optimizer's class and settings (the loss-scale arguments are
        accepted for Varuna compatibility)."""
        self._factory = _optimizer_factory(optimizer)

    def cached(self) -> Calibration | None:
        """The saved calibration of this key, if there is a readable one."""
        try:
            cal = Calibration.load(self.path)
        except FileNotFoundError:
            return None
        except CalibrationError as exc:
            log.warning("ignoring unreadable calibration %s: %s", self.path, exc)
            return None
        return cal if cal.key == self.key and cal.n_segments == self.n_segments else None

    def profile_all(self, microbatch_sizes: Sequence[int]) -> Calibration:
        sizes = sorted({int(b) for b in microbatch_sizes})
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"micro-batch sizes must be positive integers, got {list(microbatch_sizes)}")
        existing = self.cached()
        covered = existing is not None and set(sizes) <= set(existing.micro_batch_sizes)
        if self.from_cache and covered:
            log.info("calibration of %s on %s from %s", self.fingerprint, self.device_kind, self.path)
            return _restrict(existing, sizes)
        segments = self.pstages_to_profile or list(range(self.n_segments))
        partial = len(segments) < self.n_segments
        if partial and not covered:
            raise CalibrationError(
                f"profiling only segments {segments} needs a saved calibration with the others at sizes {sizes}",
                hint=f"profile every segment once (pstages_to_profile=None) into {self.out_folder}")
        todo = sizes
        if self.from_cache and self.add_to_existing and existing is not None and not partial:
            todo = [b for b in sizes if b not in existing.micro_batch_sizes]  # what the cache lacks
        merge = existing is not None and (partial or self.add_to_existing)
        fresh = self._measure(todo, segments, existing if merge else None,
                             reuse_network=self.from_cache or partial)
        cal = _merge(existing, fresh, segments) if merge else fresh
        self.out_folder.mkdir(parents=True, exist_ok=True)
        cal.save(self.path)
        return _restrict(cal, sizes)

    # -- internals -----------------------------------------------------------------------------

    def _measure(self, sizes: list[int], segments: list[int], existing: Calibration | None, *,
                 reuse_network: bool) -> Calibration:
        slices = segment_slices(self.traced)
        was_training = self.model.training
        saved_grads = {id(p): p.grad for p in self.model.parameters()}
        self.model.to(self.device)
        for s in slices:   # they hold the buffers model.to replaced, not the moved ones
            s.module.to(self.device)
        self.model.train()
        batches, input_bytes = {}, []
        for b in sizes:
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in self.get_batch_fn(b, self.device).items()}
            if _batch_size_of(batch) != b:
                raise ConfigError(f"get_batch_fn({b}, ...) returned a batch of {_batch_size_of(batch)} examples")
            batches[b] = batch
            input_bytes.append(sum(_nbytes(v) for v in batch.values() if isinstance(v, torch.Tensor)))
        job = _Job(slices, batches, segments, self.device, self.precision, self.repeats, self.warmup,
                   self._factory, self.optimizer_factor, self.in_flight)
        try:
            if self.slots > 1:
                per_size, steps = _run_concurrently(job, self.slots)
            else:
                per_size, steps = job.run()
            self.measured += len(segments) * len(sizes)
        finally:
            for p in self.model.parameters():
                p.grad = saved_grads.get(id(p))
            self.model.train(was_training)
        links, allreduce = self._network(existing if reuse_network else None)
        profiles = []
        by_seg = dict(zip(segments, steps))
        for k in range(self.n_segments):
            if k not in by_seg:  # filled from the saved calibration by _merge
                src = existing.segments[k]
                profiles.append(SegmentProfile(src.param_bytes, src.optimizer_bytes, src.step_s,
                                               tuple(existing.cost(k, b) for b in sizes)))
                continue
            step_s, opt_bytes = by_seg[k]
            pbytes = sum(_nbytes(p) for p in slices[k].module.parameters())
            profiles.append(SegmentProfile(pbytes, opt_bytes, step_s,
                                           tuple(per_size[b][k].cost() for b in sizes)))
        return Calibration(model=self.fingerprint, device_kind=self.device_kind, micro_batch_sizes=tuple(sizes),
                           input_bytes=tuple(input_bytes), segments=tuple(profiles), links=links,
                           allreduce=allreduce, tied=tied_weights(slices))

    def _network(self, existing: Calibration | None) -> tuple[dict[str, LinkCost], dict[str, LinkCost]]:
        links, allreduce = dict(self._links), dict(self._allreduce)
        if "intra" not in links or "intra" not in allreduce:
            if existing is not None:
                links.setdefault("intra", existing.links["intra"])
                allreduce.setdefault("intra", existing.allreduce["intra"])
            else:
                # CPU workers share the host's cores with ZeroMQ's I/O threads
                link, ar = measure_network(repeats=max(self.repeats, 5), warmup=max(self.warmup, 2),
                                           io_threads_busy=self.device.type == "cpu")
                self.network_measured = True
                links.setdefault("intra", link)
                allreduce.setdefault("intra", ar)
        for table in (links, allreduce):
            table.setdefault("inter", table["intra"])
            unknown = set(table) - set(LINK_KINDS)
            if unknown:
                raise ConfigError(f"unknown link kinds {sorted(unknown)}; expected {LINK_KINDS}")
        return links, allreduce


def _device(device: int | str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        return torch.device("cpu") if device < 0 else torch.device(f"cuda:{device}")
    if device in ("-1", ""):
        return torch.device("cpu")
    return torch.device(f"cuda:{device}" if device.isdigit() else device)


def _restrict(cal: Calibration, sizes: Sequence[int]) -> Calibration:
    if tuple(sizes) == cal.micro_batch_sizes:
        return cal
    idx = [cal.size_index(b) for b in sizes]
    segs = tuple(replace(s, costs=tuple(s.costs[i] for i in idx)) for s in cal.segments)
    return replace(cal, micro_batch_sizes=tuple(sizes), input_bytes=tuple(cal.input_bytes[i] for i in idx),
                   segments=segs)


def _merge(old: Calibration, new: Calibration, measured: Sequence[int]) -> Calibration:
    """The union of two calibrations of one key: `new`'s numbers win for the segments it
    measured; sizes only `old` has keep old's numbers (segments' static costs from `new`)."""
    sizes = sorted(set(old.micro_batch_sizes) | set(new.micro_batch_sizes))
    segs = []
    for k in range(old.n_segments):
        src = new.segments[k] if k in measured else old.segments[k]
        costs = []
        for b in sizes:
            if b in new.micro_batch_sizes and (k in measured or b not in old.micro_batch_sizes):
                costs.append(new.cost(k, b))
            else:
                costs.append(old.cost(k, b))
        segs.append(SegmentProfile(src.param_bytes, src.optimizer_bytes, src.step_s, tuple(costs)))
    inputs = tuple(new.input_bytes[new.size_index(b)] if b in new.micro_batch_sizes
                   else old.input_bytes[old.size_index(b)] for b in sizes)
    return replace(new, micro_batch_sizes=tuple(sizes), input_bytes=inputs, segments=tuple(segs))

