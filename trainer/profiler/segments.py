"""Segment timing: the model sliced at every cut point, each segment's forward, recompute and
backward timed per micro-batch size (alone or with several micro-batches in flight, as a
pipeline's stage interleaves them), its boundary and saved-activation bytes, and the weights
several segments share."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainer.errors import ConfigError
from trainer.engine.precision import Precision, autocast
from trainer.graph.partition import ACTIVATION, StageSlice, TracedModel, slice_stages
from trainer.planning.calibration import SegmentCost, TiedWeights
from trainer.profiler.common import _median, _nbytes, _sync

__all__ = ["IN_FLIGHT", "SegmentMeasurement", "segment_slices", "measure_segments",
           "measure_segments_interleaved", "tied_weights"]


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
