"""Segment timing: the model sliced at every cut point, each segment's forward, recompute and
backward timed per micro-batch size (alone or with several micro-batches in flight, as a
pipeline's stage interleaves them), its boundary and saved-activation bytes, and the weights
several segments share."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainer.engine.memory import device_peak, reset_peak, resident_bytes
from trainer.engine.precision import Precision, autocast
from trainer.engine.split_backward import backward_input, backward_weight
from trainer.errors import ConfigError
from trainer.graph.partition import ACTIVATION, StageSlice, TracedModel, slice_stages
from trainer.graph.placement import retarget_graph
from trainer.planning.calibration import SegmentCost, TiedWeights
from trainer.profiler.common import _median, _nbytes, _sync

__all__ = ["IN_FLIGHT", "SegmentMeasurement", "segment_slices", "measure_segments",
           "measure_segments_interleaved", "resident", "tied_weights"]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()

log = logging.getLogger(__name__)
_UNMEASURED: set[str] = set()   # device types whose working bytes could not be measured, said once


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
    input_grad_s: float | None = None   # the split backward's two passes, where the segment has an input gradient
    weight_grad_s: float | None = None
    split_bytes: int | None = None      # held from one pass to the other (the gradients recorded between)
    working_bytes: int | None = None    # a pass's peak beyond its graph (`_working_bytes`)

    def cost(self) -> SegmentCost:
        return SegmentCost(self.forward_s, self.backward_s, self.recompute_s, self.activation_bytes,
                           self.peak_activation_bytes, self.input_grad_s, self.weight_grad_s, self.split_bytes,
                           self.working_bytes)


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
    `batch` (one micro-batch, already on `device`).

    One segment at a time, as a calibration must fit in one slot: each segment's module is moved
    to `device` (see `resident`), fed its input boundary (the previous segment's output, kept on
    the host between segments), measured and moved back, its gradients freed, before the next.
    A repeat runs its forward without autograd, its forward with autograd, then one backward from
    its output (the loss for the last segment, a gradient of ones otherwise). A stage of several
    segments runs them as one backward, so the fixed cost of starting one (measured on a trivial
    graph) is taken off each segment's backward: the segments' times add up to the stage's. With
    `in_flight` = k > 1 a repeat runs k micro-batches as a pipeline's stage interleaves them
    (`measure_segments_interleaved`)."""
    if in_flight < 1:
        raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
    device = torch.device(device)
    wanted = set(range(len(slices)) if segments is None else segments)
    last = max(wanted, default=-1)   # the segments after it need not even run
    start_s = _backward_start_s(device, repeats, warmup)
    out: dict[int, SegmentMeasurement] = {}
    x: torch.Tensor | None = None
    for k, sl in enumerate(slices[:last + 1]):
        with resident(sl.module, device):
            x_in = None if x is None else x.to(device)
            if k in wanted:
                out[k] = _measure_one(sl, batch, x_in, device, precision, repeats, warmup, in_flight,
                                      start_s, is_last=k == len(slices) - 1)
            with torch.no_grad(), autocast(precision, device):
                y = sl.module(**_inputs(sl, batch, x_in))
            # between segments the boundary waits on the host: the device holds one segment's work
            x = y.to("cpu") if device.type != "cpu" else y
    return out


@contextlib.contextmanager
def resident(module: torch.nn.Module, device: torch.device):
    """`module` on `device` for the block, then back where its parameters were, with the
    gradients the block left freed: a device holds one segment (and its training state) at a time."""
    params = list(module.parameters())
    home = params[0].device if params else device
    moved = home != device
    if moved:
        module.to(device)
        retarget_graph(module, home, device)
    try:
        yield module
    finally:
        for p in params:
            p.grad = None
        if moved:
            module.to(home)
            retarget_graph(module, device, home)
        _release_heap(device)


def _release_heap(device: torch.device) -> None:
    """On a CPU, hand the heap this segment freed back to the kernel: glibc keeps it (all of it
    under trainer.launch's large trim and mmap thresholds, for speed; blocks under 1 MiB in a
    calibration run, which returns larger ones as it frees them: trainer.engine.memory), and the
    next segment's tensors do not fit the holes, so each segment would add to the resident size."""
    if device.type != "cpu" or _LIBC is None:
        return
    _LIBC.malloc_trim(0)


def _inputs(sl: StageSlice, batch, x: torch.Tensor | None) -> dict[str, torch.Tensor]:
    kw = {name: batch[name] for name in sl.input_names}
    if sl.takes_activation:
        kw[ACTIVATION] = x
    return kw


def _measure_one(sl: StageSlice, batch, x: torch.Tensor | None, device: torch.device, precision: Precision,
                 repeats: int, warmup: int, in_flight: int, start_s: float, *, is_last: bool) -> SegmentMeasurement:
    def forward(grad: bool) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        """(seconds, output, the input leaf whose gradient the backward computes)."""
        kw = _inputs(sl, batch, x)
        if grad and sl.takes_activation and x.is_floating_point():
            kw[ACTIVATION] = x.detach().requires_grad_(True)   # the gradient flows on to the previous stage
        _sync(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad), autocast(precision, device):
            y = sl.module(**kw)
        _sync(device)
        return time.perf_counter() - t0, y, kw.get(ACTIVATION)

    def root(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the executor's last stage backpropagates its loss; another stage, the gradient it receives
        return (y.float() * 1.0, None) if is_last else (y, torch.ones_like(y))

    def backward(y: torch.Tensor) -> float | None:
        if not y.requires_grad:
            return None
        out, grad = root(y)
        _sync(device)
        t0 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        return _less_start(time.perf_counter() - t0)

    def _less_start(elapsed: float) -> float:
        # start_s is a median from other runs: on a busy host a small segment's whole backward can
        # fall below it, and a backward never costs nothing (0 reads as "free" to the planner)
        return max(elapsed - start_s, 0.1 * elapsed)

    def split(y: torch.Tensor, x_in: torch.Tensor) -> tuple[float, float, int] | None:
        """The two passes of a zero-bubble schedule's split backward, and the bytes held between
        them. The input pass starts one backward per stage like a whole one; the weight pass runs
        one per group of parameters, so its time adds up over segments as it is."""
        if not y.requires_grad:
            return None
        out, grad = root(y)
        params = [p for p in sl.module.parameters() if p.requires_grad]
        _sync(device)
        t0 = time.perf_counter()
        _, pending = backward_input(out, grad, x_in, params)
        _sync(device)
        t1 = time.perf_counter()
        held = pending.held_bytes()
        backward_weight(pending)
        _sync(device)
        return _less_start(t1 - t0), time.perf_counter() - t1, held

    fwd: list[float] = []
    rec: list[float] = []
    bwd: list[float] = []
    parts: list[tuple[float, float, int]] = []
    act_bytes = 0
    splits = sl.takes_activation and x is not None and x.is_floating_point()
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
        f_times = [forward(grad=False)[0] for _ in range(in_flight)]
        graphs = [forward(grad=True) for _ in range(in_flight)]
        r_times = [t for t, _, _ in graphs]
        act_bytes = _nbytes(graphs[0][1])
        b_times, s_times = [], []
        # every other backward is split where there is an input gradient to split off: both kinds
        # measured in the same rounds, at no extra cost to the calibration
        for i in range(in_flight):
            _, y, leaf = graphs.pop(0)   # its graph goes as soon as it is measured
            if splits and (r * in_flight + i) % 2:
                s_times.append(split(y, leaf))
            else:
                b_times.append(backward(y))
            del y, leaf
        if r < warm:
            continue
        fwd += f_times
        rec += r_times
        bwd += [t for t in b_times if t is not None]
        parts += [t for t in s_times if t is not None]
    peak = _peak_bytes(sl, batch, x, device, precision, list(sl.module.parameters()))
    working = _working_bytes(sl, batch, x, device, precision, root)
    # The last stage never recomputes: its FORWARD always keeps the graph.
    forward_s = _median(rec) if is_last else _median(fwd)
    split_part = (_median([a for a, _, _ in parts]), _median([w for _, w, _ in parts]), max(h for _, _, h in parts)
                  ) if parts else (None, None, None)
    return SegmentMeasurement(forward_s, _median(rec), _median(bwd) if bwd else 0.0, act_bytes, peak, *split_part,
                              working)


def _backward_start_s(device: torch.device, repeats: int, warmup: int) -> float:
    """What starting one backward costs, whatever its graph: a one-element graph's backward."""
    a = torch.zeros(1, device=device, requires_grad=True)
    times = []
    for _ in range(warmup + max(repeats, 5)):
        y = a * 1.0
        _sync(device)
        t0 = time.perf_counter()
        y.backward(torch.ones_like(y))
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _median(times[warmup:])


IN_FLIGHT = 4   # micro-batches in flight in an interleaved profile


def measure_segments_interleaved(slices: Sequence[StageSlice], batch: Mapping[str, torch.Tensor], *,
                                 in_flight: int = IN_FLIGHT, **kwargs) -> dict[int, SegmentMeasurement]:
    """`measure_segments` with `in_flight` micro-batches per repeat, interleaved as a pipeline's
    stage runs them (several forwards' graphs alive, each backward after the others' forwards):
    what the profiler uses, since the executor never runs one micro-batch alone."""
    return measure_segments(slices, batch, in_flight=in_flight, **kwargs)


def _peak_bytes(sl: StageSlice, batch, x_in, device: torch.device, precision: Precision, params) -> int:
    mod = sl.module
    kw = {n: batch[n] for n in sl.input_names}
    if sl.takes_activation:
        kw[ACTIVATION] = x_in.detach().requires_grad_(x_in.is_floating_point())
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        reset_peak(device)
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


def _working_bytes(sl: StageSlice, batch, x_in, device: torch.device, precision: Precision,
                   root: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]) -> int | None:
    """What one micro-batch's forward and backward hold at their peak beyond what the forward
    leaves (its graph and output): the transients that saved tensors do not show (a loss's
    logits beside their log-softmax, then the gradients of both), the gradients in flight and the
    one the segment receives (trainer.planning.calibration's `working_bytes`). The rise of the
    device's allocation peak on CUDA, of the process's resident high-water mark on a CPU (where a
    worker hands blocks of 1 MiB and more back as it frees them: trainer.engine.memory); None
    where the kernel keeps no resettable mark."""
    mod = sl.module
    # A worker's later micro-batches add into gradients that exist: their sums' temporaries count,
    # not the first micro-batch's allocation of the gradients (the stage's static bytes).
    fresh = [p for p in mod.parameters() if p.requires_grad and p.grad is None]
    for p in fresh:
        p.grad = torch.zeros_like(p)
    kw = _inputs(sl, batch, x_in)
    if sl.takes_activation and x_in is not None and x_in.is_floating_point():
        kw[ACTIVATION] = x_in.detach().requires_grad_(True)
    try:
        _sync(device)
        if not reset_peak(device):
            if device.type not in _UNMEASURED:
                _UNMEASURED.add(device.type)
                log.warning("cannot measure a pass's working memory here (the kernel does not let this process "
                            "reset its resident high-water mark): the plan's memory leaves it out (twice the "
                            "logits on a loss's stage)")
            return None
        with torch.enable_grad(), autocast(precision, device):
            y = mod(**kw)
        _sync(device)
        after_forward = torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()
        if y.requires_grad:
            out, grad = root(y)
            out.backward(grad)
            del out, grad
        _sync(device)
        peak = device_peak(device)
        del y
        if peak is None or after_forward is None:
            return None
        return max(0, int(peak - after_forward))
    finally:
        for p in fresh:
            p.grad = None
