"""The Profiler: measures what a model's calibration lacks (segments, steps, network), merges it
with the saved calibration of the same key and writes the result."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from trainer.engine.precision import Precision
from trainer.engine.setup import device_of
from trainer.errors import ConfigError
from trainer.graph.partition import capture_model
from trainer.planning.calibration import (
    LINK_KINDS,
    Calibration,
    CalibrationError,
    LinkCost,
    SegmentProfile,
    left_out_of_memory,
)
from trainer.profiler.common import _nbytes, _workspace_bytes
from trainer.profiler.identity import calibration_path, device_kind_of, model_fingerprint
from trainer.profiler.network import measure_network
from trainer.profiler.segments import IN_FLIGHT, _batch_size_of, segment_slices, tied_weights
from trainer.profiler.slots import _Job, _run_concurrently, busy_probe
from trainer.profiler.steps import OptimizerFactory, _optimizer_factory, step_bytes_add
from trainer.worker_env import available_cores

__all__ = ["Profiler"]

log = logging.getLogger("varuna.profiler")

_WORKER_MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")   # set by trainer.launch


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
    `measure_segments_interleaved`: by default IN_FLIGHT on CPU, 1 on a GPU), and `busy_slots`
    (a CPU machine other daemons share: after measuring one slot alone, time the largest
    micro-batch size with that many busy at once: `Calibration.busy_slowdown`).

    The model stays where it was built (the host): one segment at a time visits the device with
    its gradients and its optimizer's state, all freed before the next, so a calibration fits in
    one slot whatever the model's size (`segments.resident`)."""

    def __init__(self, model: nn.Module, get_batch_fn: Callable[..., Mapping[str, torch.Tensor]],
                 device: int | str = -1, gpus_per_node: int | None = None, fp16: bool = False,
                 out_folder: str | os.PathLike[str] = "profiles", pstages_to_profile: Sequence[int] | None = None,
                 from_cache: bool = True, add_to_existing: bool = False, *, precision: Precision | None = None,
                 device_kind: str | None = None, repeats: int = 5, warmup: int = 2,
                 optimizer_factor: float = 2.0, links: Mapping[str, LinkCost] | None = None,
                 allreduce: Mapping[str, LinkCost] | None = None, inter_link: LinkCost | None = None,
                 inter_allreduce: LinkCost | None = None, in_flight: int | None = None,
                 busy_slots: int | None = None, capture_cache: str | os.PathLike[str] | None = None) -> None:
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
        # Other daemons share this CPU machine: measured alone, then timed with that many busy.
        self.busy_slots = busy_slots or 0
        self.precision: Precision = precision or ("fp16" if fp16 else "fp32")
        self.out_folder = Path(out_folder)
        self.pstages_to_profile = None if pstages_to_profile is None else sorted(set(pstages_to_profile))
        self.from_cache, self.add_to_existing = from_cache, add_to_existing
        self.repeats, self.warmup = repeats, warmup
        # A whole model's graphs k times over may not fit a GPU that holds one stage's in training.
        self.in_flight = in_flight if in_flight is not None else IN_FLIGHT if self.device.type == "cpu" else 1
        if self.in_flight < 1:
            raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
        self.global_batch: int | None = None   # set by a calibration run: bounds the micro-batches in flight
        self.optimizer_factor = optimizer_factor
        self._links = dict(links or {})
        self._allreduce = dict(allreduce or {})
        if inter_link is not None:
            self._links["inter"] = inter_link
        if inter_allreduce is not None:
            self._allreduce["inter"] = inter_allreduce
        # kept where the job's workers look (trainer.graph.capture_cache): this VM's first worker loads it
        self.traced = capture_model(model, get_batch_fn(2, device_of(model)), cache_dir=capture_cache)
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
        """The saved calibration of this key, if there is a readable one that counts all a slot's
        memory (one of an older schema is measured again, as a daemon's stored one is)."""
        try:
            data = self.path.read_bytes()
            left_out = left_out_of_memory(data, self.device_kind)
            if left_out is not None:
                log.info("measuring %s again: its schema version left %s out of a slot's memory", self.path, left_out)
                return None
            cal = Calibration.from_bytes(data)
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
        # the model stays where it was built: each segment visits the device alone (segments.resident)
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
                   self._factory, self.optimizer_factor, self.in_flight, self.global_batch)
        try:
            busy_slowdown = busy_load = 0.0
            if self.slots > 1:
                per_size, steps = _run_concurrently(job, self.slots)
            else:
                per_size, steps = job.run()
                if self.busy_slots > 1 and self.device.type == "cpu":
                    busy_slowdown = busy_probe(job, per_size, self.busy_slots)
                    busy_load = self.busy_slots / available_cores() if busy_slowdown else 0.0   # one thread each
            self.measured += len(segments) * len(sizes)
            workspaces = _workspace_bytes(self.device)
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
                profiles.append(replace(src, costs=tuple(existing.cost(k, b) for b in sizes)))
                continue
            step_s, opt_bytes, temporaries = by_seg[k]
            pbytes = sum(_nbytes(p) for p in slices[k].module.parameters())
            profiles.append(SegmentProfile(pbytes, opt_bytes, step_s,
                                           tuple(per_size[b][k].cost() for b in sizes), temporaries))
        return Calibration(model=self.fingerprint, device_kind=self.device_kind, micro_batch_sizes=tuple(sizes),
                           input_bytes=tuple(input_bytes), segments=tuple(profiles), links=links,
                           allreduce=allreduce, tied=tied_weights(slices),
                           step_bytes_add=step_bytes_add(self._factory, self.device), busy_slowdown=busy_slowdown,
                           busy_load=busy_load, worker_bytes=workspaces)

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
        segs.append(replace(src, costs=tuple(costs)))
    inputs = tuple(new.input_bytes[new.size_index(b)] if b in new.micro_batch_sizes
                   else old.input_bytes[old.size_index(b)] for b in sizes)
    return replace(new, micro_batch_sizes=tuple(sizes), input_bytes=inputs, segments=tuple(segs))

