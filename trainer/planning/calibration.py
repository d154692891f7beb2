"""Calibration: the measured cost of every cut-point segment, independent of P and D.

Varuna profiles each segment (the layers between two consecutive potential cut points) once per
micro-batch size, plus the network once per link kind; the simulator and the planner then predict
any P x D from these numbers alone (the paper's "scale-invariant calibration"). A `Calibration` is
keyed by (model fingerprint, device kind) and saved as versioned JSON.

Memory model (shared by the simulator and the planner):
  * a segment's parameters take `param_bytes`, their gradients the same again, and the optimizer
    state `optimizer_bytes`;
  * `activation_bytes` is the tensor at the segment's output boundary: what is sent to the next
    stage and, when recomputing, stashed; its gradient has the same size;
  * `peak_activation_bytes` is what the autograd graph keeps for one micro-batch of the segment
    (a forward with grad, or a recompute), freed by its backward;
  * `working_bytes` is what one micro-batch's forward and backward hold at their peak beyond that
    graph and the segment's output, measured: the temporaries the saved tensors do not show and the
    gradients in flight (on a loss segment the logits beside their log-softmax, then the gradients
    of both: about twice the logits), and the gradient the segment receives. A stage runs one pass
    at a time, so it holds one such set, its largest segment's, on top of what it stashes;
  * `step_bytes` is what the optimizer's step allocates and frees again for the segment's
    parameters (Adam's `sqrt(v)` and its quotient, the gradient norms): measured, since it depends
    on the optimizer's implementation. A for-loop optimizer holds one tensor's temporaries at a
    time, so a stage's are its largest segment's; a foreach one (torch's default on CUDA) holds
    all of them at once, so they add up. `step_bytes_add` says which the calibration measured.
    The step runs once the stage's activations are freed: a stage holds its static bytes plus
    the larger of its activations and its step's temporaries;
  * `worker_bytes` is what every worker holds on the device beyond its tensors, whatever its
    stage, measured: on a GPU the math library's workspaces (cuBLAS keeps one per thread that
    runs a matrix product, the worker's own and autograd's backward thread: 2 x 33.6 MB on an
    H100); on a CPU, whose device is the host, the process itself (the interpreter, torch, the
    script's libraries and data), measured by a daemon's calibration run, which is such a
    process; 0 where a script calibrates in its own process ([Note: memory is a budget] in
    ARCHITECTURE.md).

Links: a send of n bytes takes ``latency_s + n / bandwidth_Bps``. All-reduce of n bytes over a
ring of D replicas takes ``2 (D-1)/D * n / bandwidth_Bps + 2 (D-1) * latency_s`` (reduce-scatter
then all-gather, D-1 steps each), with its own measured constants per link kind. A point-to-point
message also costs CPU time on the stages at both ends (building and queueing the frames, or
taking them off the socket): `send_overhead_s` and `recv_overhead_s`, which keep the stage busy,
while ``latency_s`` is the rest of the one-way time (in flight: the stages can compute meanwhile).

Tied weights: a weight shared by segments (a tied embedding) is summed over the stages that hold
it, in an all-reduce among those stages' workers every step, even at D = 1; `tied` lists each such
set's segments and bytes so that the simulator can charge it.

Schema history: version 1 had no message overheads and no tied sets; such documents still load
(the overheads read as 0 and the tied sets as unknown, i.e. none). Version 2 had no step
temporaries: they read as 0 (what the planner counted before them), adding up. Version 3 had no
busy slowdown: it reads as 0 (unknown: a lone worker is taken to compute as calibrated).
Version 4 had no worker bytes: they read as 0. Version 5 had no split backward times: they read
as unknown (None), and the simulator takes a split backward as two halves. Version 6's worker
bytes on a CPU left out the worker's process: a daemon measures such a calibration again
(`PROCESS_COUNTED_FROM`; varunad.control.plans.calibrations_for). Version 7 had no working
bytes: they read as unknown (counted as 0), and a daemon measures such a calibration again
(`WORKING_COUNTED_FROM`), since its stages' peaks were promised too little.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from trainer.errors import VarunaError

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "LINK_KINDS",
    "CalibrationError",
    "LinkCost",
    "TiedWeights",
    "SegmentCost",
    "SegmentProfile",
    "Calibration",
    "left_out_of_memory",
]

SCHEMA = "varunad.calibration"
SCHEMA_VERSION = 8
# older ones migrate: zero message overheads, no tied sets, no step temporaries, no busy slowdown,
# no worker bytes, no split backward times, a CPU worker's process not in its worker bytes, no
# working bytes
_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
_SPLIT = ("input_grad_s", "weight_grad_s")   # measured together, or not at all
_ADDED_IN_6 = (*_SPLIT, "split_bytes")
_ADDED_IN_8 = ("working_bytes",)
PROCESS_COUNTED_FROM = 7   # the first version whose CPU worker bytes hold the worker's process
WORKING_COUNTED_FROM = 8   # the first version that measures a pass's working bytes
LINK_KINDS = ("intra", "inter")  # same host, across hosts


class CalibrationError(VarunaError, ValueError):
    """A calibration document is malformed or does not cover what was asked of it."""


def _num(owner: str, name: str, value: Any, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CalibrationError(f"{owner}.{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise CalibrationError(f"{owner}.{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


def _int(owner: str, name: str, value: Any, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CalibrationError(f"{owner}.{name} must be an integer, got {value!r}")
    _num(owner, name, value, positive=positive)


@dataclass(frozen=True, slots=True)
class LinkCost:
    latency_s: float
    bandwidth_Bps: float
    send_overhead_s: float = 0.0  # CPU the sending stage spends per message (point-to-point links)
    recv_overhead_s: float = 0.0  # CPU the receiving stage spends per message, once it has arrived

    def __post_init__(self) -> None:
        _num("LinkCost", "latency_s", self.latency_s)
        _num("LinkCost", "bandwidth_Bps", self.bandwidth_Bps, positive=True)
        _num("LinkCost", "send_overhead_s", self.send_overhead_s)
        _num("LinkCost", "recv_overhead_s", self.recv_overhead_s)

    def send_s(self, nbytes: float) -> float:
        """One way, from the start of the send call to the end of the receive."""
        return self.send_overhead_s + self.latency_s + nbytes / self.bandwidth_Bps + self.recv_overhead_s

    def allreduce_s(self, nbytes: float, replicas: int) -> float:
        if replicas <= 1:
            return 0.0
        d = replicas
        return 2 * (d - 1) / d * nbytes / self.bandwidth_Bps + 2 * (d - 1) * self.latency_s


@dataclass(frozen=True, slots=True)
class TiedWeights:
    """One set of tied weights: the segments that hold a copy, and its bytes (one copy)."""

    segments: tuple[int, ...]
    param_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        for k in self.segments:
            _int("TiedWeights", "segments[]", k)
        if len(self.segments) < 2 or list(self.segments) != sorted(set(self.segments)):
            raise CalibrationError(f"TiedWeights.segments must be >= 2 increasing segments, got {self.segments}")
        _int("TiedWeights", "param_bytes", self.param_bytes)


@dataclass(frozen=True, slots=True)
class SegmentCost:
    """One segment at one micro-batch size."""

    forward_s: float
    backward_s: float
    recompute_s: float
    activation_bytes: int
    peak_activation_bytes: int
    # the backward split in its two passes (trainer.engine.split_backward): the input's gradient,
    # then the weights'; None where not measured (a first segment: no input gradient to split off)
    input_grad_s: float | None = None
    weight_grad_s: float | None = None
    # what the split holds from one pass to the other beyond the activations: the gradients
    # recorded where the parameters branch off (None: not measured)
    split_bytes: int | None = None
    # a pass's own peak beyond the graph it keeps (module docstring); None: not measured (an
    # older calibration), counted as 0, as the planner did then
    working_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "recompute_s"):
            _num("SegmentCost", name, getattr(self, name))
        if (self.input_grad_s is None) != (self.weight_grad_s is None):
            raise CalibrationError("SegmentCost: input_grad_s and weight_grad_s are measured together or not at all")
        for name in _SPLIT:
            if getattr(self, name) is not None:
                _num("SegmentCost", name, getattr(self, name))
        for name in ("split_bytes", "working_bytes"):
            if getattr(self, name) is not None:
                _int("SegmentCost", name, getattr(self, name))
        for name in ("activation_bytes", "peak_activation_bytes"):
            _int("SegmentCost", name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class SegmentProfile:
    """One segment: its static memory, optimizer step time, and a cost per micro-batch size
    (aligned with `Calibration.micro_batch_sizes`); `step_bytes`, its optimizer step's temporaries."""

    param_bytes: int
    optimizer_bytes: int
    step_s: float
    costs: tuple[SegmentCost, ...]
    step_bytes: int = 0

    def __post_init__(self) -> None:
        _int("SegmentProfile", "param_bytes", self.param_bytes)
        _int("SegmentProfile", "optimizer_bytes", self.optimizer_bytes)
        _int("SegmentProfile", "step_bytes", self.step_bytes)
        _num("SegmentProfile", "step_s", self.step_s)
        object.__setattr__(self, "costs", tuple(self.costs))
        if not self.costs or not all(isinstance(c, SegmentCost) for c in self.costs):
            raise CalibrationError("SegmentProfile.costs must be a non-empty sequence of SegmentCost")

    @property
    def static_bytes(self) -> int:
        """Weights, their gradients and the optimizer state."""
        return 2 * self.param_bytes + self.optimizer_bytes


def _links(owner: str, value: Mapping[str, LinkCost]) -> Mapping[str, LinkCost]:
    if set(value) != set(LINK_KINDS):
        raise CalibrationError(f"{owner} must have exactly the link kinds {LINK_KINDS}, got {sorted(value)}")
    if not all(isinstance(v, LinkCost) for v in value.values()):
        raise CalibrationError(f"{owner} values must be LinkCost")
    return MappingProxyType({k: value[k] for k in LINK_KINDS})


@dataclass(frozen=True, slots=True)
class Calibration:
    """Everything measured for one (model fingerprint, device kind)."""

    model: str
    device_kind: str
    micro_batch_sizes: tuple[int, ...]
    input_bytes: tuple[int, ...]  # stage 0's input per micro-batch, per micro-batch size
    segments: tuple[SegmentProfile, ...]
    links: Mapping[str, LinkCost]
    allreduce: Mapping[str, LinkCost]
    version: int = field(default=SCHEMA_VERSION)
    tied: tuple[TiedWeights, ...] = ()  # weights shared by several segments
    step_bytes_add: bool = True  # the segments' step temporaries are held at once (foreach), not in turn
    # Where other daemons share a CPU machine: with `busy_load` threads per core busy (its slots
    # computing at once), a slot computed `busy_slowdown` times slower than this calibration
    # says (shared cores and memory bandwidth; 0 = not measured). trainer.planning.planner.
    busy_slowdown: float = 0.0
    busy_load: float = 0.0
    worker_bytes: int = 0  # held by every worker on the device beyond its tensors (module doc)

    def __post_init__(self) -> None:
        if self.version != SCHEMA_VERSION:
            raise CalibrationError(
                f"calibration schema version {self.version} is not supported (this build writes {SCHEMA_VERSION} "
                f"and reads {', '.join(map(str, _READABLE_VERSIONS))})",
                hint="re-run the profiler",
            )
        for name in ("model", "device_kind"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise CalibrationError(f"Calibration.{name} must be a non-empty string")
        sizes = tuple(self.micro_batch_sizes)
        for b in sizes:
            _int("Calibration", "micro_batch_sizes[]", b, positive=True)
        if not sizes or list(sizes) != sorted(set(sizes)):
            raise CalibrationError(f"micro_batch_sizes must be non-empty, increasing and unique, got {sizes}")
        object.__setattr__(self, "micro_batch_sizes", sizes)
        object.__setattr__(self, "input_bytes", tuple(self.input_bytes))
        if len(self.input_bytes) != len(sizes):
            raise CalibrationError("input_bytes needs one value per micro-batch size")
        for v in self.input_bytes:
            _int("Calibration", "input_bytes[]", v)
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments or not all(isinstance(s, SegmentProfile) for s in self.segments):
            raise CalibrationError("Calibration.segments must be a non-empty sequence of SegmentProfile")
        for k, seg in enumerate(self.segments):
            if len(seg.costs) != len(sizes):
                raise CalibrationError(
                    f"segment {k} has {len(seg.costs)} costs for {len(sizes)} micro-batch sizes"
                )
        object.__setattr__(self, "links", _links("Calibration.links", self.links))
        object.__setattr__(self, "allreduce", _links("Calibration.allreduce", self.allreduce))
        object.__setattr__(self, "tied", tuple(self.tied))
        for t in self.tied:
            if not isinstance(t, TiedWeights):
                raise CalibrationError("Calibration.tied must be a sequence of TiedWeights")
            if t.segments[-1] >= len(self.segments):
                raise CalibrationError(f"tied weights name segment {t.segments[-1]} of {len(self.segments)}")
        if not isinstance(self.step_bytes_add, bool):
            raise CalibrationError(f"Calibration.step_bytes_add must be a bool, got {self.step_bytes_add!r}")
        _num("Calibration", "busy_slowdown", self.busy_slowdown)
        _num("Calibration", "busy_load", self.busy_load)
        _int("Calibration", "worker_bytes", self.worker_bytes)

    def __hash__(self) -> int:  # the mapping fields are read-only proxies
        return hash((self.model, self.device_kind, self.micro_batch_sizes, self.segments))

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.device_kind)

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    def size_index(self, micro_batch_size: int) -> int:
        try:
            return self.micro_batch_sizes.index(micro_batch_size)
        except ValueError:
            raise CalibrationError(
                f"micro-batch size {micro_batch_size} was not calibrated for {self.key}",
                hint=f"use one of {list(self.micro_batch_sizes)} or re-run the profiler with it",
            ) from None

    def cost(self, segment: int, micro_batch_size: int) -> SegmentCost:
        return self.segments[segment].costs[self.size_index(micro_batch_size)]

    def step_bytes(self, first: int, end: int) -> int:
        """The optimizer step's temporaries on a stage of segments first..end-1."""
        steps = [s.step_bytes for s in self.segments[first:end]]
        return sum(steps) if self.step_bytes_add else max(steps, default=0)

    # --- serialisation --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        link = lambda c: {f: getattr(c, f) for f in LinkCost.__slots__}  # noqa: E731
        return {
            "schema": SCHEMA,
            "version": self.version,
            "model": self.model,
            "device_kind": self.device_kind,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "input_bytes": list(self.input_bytes),
            "segments": [
                {
                    "param_bytes": s.param_bytes,
                    "optimizer_bytes": s.optimizer_bytes,
                    "step_s": s.step_s,
                    "step_bytes": s.step_bytes,
                    "costs": [
                        {f: getattr(c, f) for f in SegmentCost.__slots__} for c in s.costs
                    ],
                }
                for s in self.segments
            ],
            "links": {k: link(v) for k, v in self.links.items()},
            "allreduce": {k: link(v) for k, v in self.allreduce.items()},
            "tied": [{"segments": list(t.segments), "param_bytes": t.param_bytes} for t in self.tied],
            "step_bytes_add": self.step_bytes_add,
            "busy_slowdown": self.busy_slowdown,
            "busy_load": self.busy_load,
            "worker_bytes": self.worker_bytes,
        }

    @classmethod
    def from_dict(cls, doc: Any) -> Calibration:
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA and doc.get("version") not in _READABLE_VERSIONS:
            raise CalibrationError(
                f"calibration schema version {doc.get('version')!r} is not supported (this build reads "
                f"{', '.join(map(str, _READABLE_VERSIONS))})", hint="re-run the profiler")
        version = doc.get("version") if isinstance(doc, dict) and isinstance(doc.get("version"), int) else 0
        v1 = version == 1
        names = {"schema", "version", "model", "device_kind", "micro_batch_sizes", "input_bytes", "segments",
                 "links", "allreduce"}
        names |= set() if v1 else {"tied"}
        names |= {"step_bytes_add"} if version >= 3 else set()
        names |= {"busy_slowdown", "busy_load"} if version >= 4 else set()
        names |= {"worker_bytes"} if version >= 5 else set()
        cost_fields = (set(SegmentCost.__slots__) - (set() if version >= 6 else set(_ADDED_IN_6))
                       - (set() if version >= 8 else set(_ADDED_IN_8)))
        top = _fields(doc, "calibration", names)
        if top["schema"] != SCHEMA:
            raise CalibrationError(f"not a calibration document (schema {top['schema']!r})")
        link_fields = {"latency_s", "bandwidth_Bps"} | (set() if v1 else {"send_overhead_s", "recv_overhead_s"})
        segs = []
        for k, s in enumerate(_list(top["segments"], "segments")):
            sd = _fields(s, f"segments[{k}]", {"param_bytes", "optimizer_bytes", "step_s", "costs"}
                         | ({"step_bytes"} if version >= 3 else set()))
            costs = tuple(
                SegmentCost(**_fields(c, f"segments[{k}].costs[{j}]", cost_fields))
                for j, c in enumerate(_list(sd["costs"], f"segments[{k}].costs"))
            )
            segs.append(SegmentProfile(sd["param_bytes"], sd["optimizer_bytes"], sd["step_s"], costs,
                                       sd.get("step_bytes", 0)))

        def links(name: str) -> dict[str, LinkCost]:
            d = _fields(top[name], name, set(LINK_KINDS))
            return {k: LinkCost(**_fields(v, f"{name}.{k}", link_fields)) for k, v in d.items()}

        tied = tuple(
            TiedWeights(**_fields(t, f"tied[{i}]", {"segments", "param_bytes"}))
            for i, t in enumerate(_list(top.get("tied", []), "tied"))
        )

        return cls(
            model=top["model"],
            device_kind=top["device_kind"],
            micro_batch_sizes=tuple(_list(top["micro_batch_sizes"], "micro_batch_sizes")),
            input_bytes=tuple(_list(top["input_bytes"], "input_bytes")),
            segments=tuple(segs),
            links=links("links"),
            allreduce=links("allreduce"),
            tied=tied,   # a version 1 document is migrated: no overheads, no tied sets
            step_bytes_add=top.get("step_bytes_add", True),
            busy_slowdown=top.get("busy_slowdown", 0.0),
            busy_load=top.get("busy_load", 0.0),
            worker_bytes=top.get("worker_bytes", 0),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Calibration:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"calibration is not valid JSON: {exc}") from None
        return cls.from_dict(doc)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)  # readers never see half a file

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_bytes(Path(path).read_bytes())

    # --- synthetic calibrations (tests, benchmarks, planning before profiling) -----------------

    @classmethod
    def uniform(
        cls,
        *,
        model: str,
        device_kind: str,
        segments: int,
        micro_batch_sizes: Sequence[int],
        forward_s: float,
        backward_s: float,
        recompute_s: float | None = None,
        activation_bytes: int,
        peak_activation_bytes: int,
        param_bytes: int,
        optimizer_bytes: int,
        step_s: float = 0.0,
        input_bytes: int = 0,
        links: Mapping[str, LinkCost],
        allreduce: Mapping[str, LinkCost] | None = None,
        tied: Sequence[TiedWeights] = (),
        step_bytes: int = 0,
        step_bytes_add: bool = True,
    ) -> Calibration:
        """Identical segments whose per-sample costs and activations scale linearly with the
        micro-batch size (forward_s etc. are per sample)."""
        rec = forward_s if recompute_s is None else recompute_s
        costs = tuple(
            SegmentCost(forward_s * b, backward_s * b, rec * b, activation_bytes * b, peak_activation_bytes * b)
            for b in micro_batch_sizes
        )
        seg = SegmentProfile(param_bytes, optimizer_bytes, step_s, costs, step_bytes)
        return cls(
            model=model,
            device_kind=device_kind,
            micro_batch_sizes=tuple(micro_batch_sizes),
            input_bytes=tuple(input_bytes * b for b in micro_batch_sizes),
            segments=(seg,) * segments,
            links=links,
            allreduce=links if allreduce is None else allreduce,
            tied=tuple(tied),
            step_bytes_add=step_bytes_add,
        )


def left_out_of_memory(data: bytes, device_kind: str) -> str | None:
    """What a stored calibration (its bytes, of `device_kind`) leaves out of a slot's memory by
    the schema version it was written in, where it must be measured again; None where nothing,
    or where it names no version (what is wrong with it is `from_bytes`'s to say)."""
    try:
        version = json.loads(data).get("version")
    except (ValueError, AttributeError):
        return None
    if not isinstance(version, int) or isinstance(version, bool):
        return None
    if (device_kind == "cpu" or device_kind.startswith("cpu-")) and version < PROCESS_COUNTED_FROM:
        return "the worker's process"
    if version < WORKING_COUNTED_FROM:
        return "a pass's working memory (a loss's logits and their gradients)"
    return None


def _fields(doc: Any, where: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise CalibrationError(f"{where} must be an object, got {type(doc).__name__}")
    missing, extra = names - set(doc), set(doc) - names
    if missing or extra:
        raise CalibrationError(f"{where}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return doc


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise CalibrationError(f"{where} must be a list, got {type(value).__name__}")
    return value
