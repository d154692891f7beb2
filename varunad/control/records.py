"""What daemons report to etcd about their workers: per-member worker reports, progress, loss history.

* ``workers/<member>`` (on the member's lease): the daemon's workers of the newest epoch it ran
  and how each ended. The leader decides from these whether an epoch is done, failed, or stopped.
* ``progress/<job>/<rank>``: the newest step of one worker (throttled: ``progress_interval``).
* ``history/<job>/<epoch>/<member>/<chunk>``: the (step, loss) pairs of the daemon's lowest rank
  in that epoch, ``HISTORY_CHUNK`` steps to a key (varunad.node.reporter), kept by the daemons of
  the plan's first and last ranks. The loss is agreed by every
  worker in the step's all-reduce, so either holds the whole history; ``merge_history`` keeps,
  per step, the newest epoch's value.
  With them, the wall-clock span from its first step's report to its newest: the gap between
  one epoch's last step and the next one's first is what a morph really cost, the wait for a
  lost VM's lease and the new workers' start-up included.

Outcomes of a worker: ``running``; ``done`` (exit 0); ``stopped`` (exit 75, asked to stop);
``killed`` (SIGKILLed by its daemon after a stop's grace period: not the script's fault);
``failed`` (anything else, with the tail of its output).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from varunad.store import schemas

__all__ = ["OUTCOMES", "WorkerRecord", "WorkerReport", "Progress", "encode_history", "decode_history",
           "merge_history", "epoch_ranges", "steps_trained_twice", "merge_spans", "stall_before",
           "progress_interval"]

OUTCOMES = ("starting", "running", "done", "stopped", "killed", "failed")

# Progress writes the fleet makes per second at most, whatever its size: every rank's record once
# per interval was 300 writes/s at 300 VMs, and the leader reads them all each interval.
PROGRESS_WRITES_PER_S = 100.0


def progress_interval(configured: float, world_size: int) -> float:
    """Seconds between a rank's progress writes (and the leader's readings of them) in a job of
    `world_size` ranks: the daemon's ``--progress-interval``, longer for a big job."""
    return max(configured, world_size / PROGRESS_WRITES_PER_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRecord:
    rank: int
    slot: int
    pid: int = 0
    outcome: str = "starting"
    exit_code: int | None = None
    error: str = ""
    step: int = -1  # last step this worker reported
    started_at: float = 0.0
    # the checkpoint store refuses this worker's writes since the checkpoint of this step (-1: it
    # does not), for `store_error`; the worker keeps training or holds its state and retries
    store_failing_since: int = -1
    store_error: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"worker outcome {self.outcome!r} is not one of {OUTCOMES}")
        if self.store_failing_since < -1:
            raise ValueError(f"store_failing_since is a step or -1, got {self.store_failing_since}")
        if self.rank < 0 or self.slot < 0 or not math.isfinite(self.started_at):
            raise ValueError(f"a worker's rank and slot are >= 0 and its start a time, got rank {self.rank}, "
                             f"slot {self.slot}, started_at {self.started_at}")

    @property
    def store_failing(self) -> str:
        """"checkpoints failing since step N: <reason>", or "" while the store takes its writes."""
        if self.store_failing_since < 0:
            return ""
        return f"checkpoints failing since step {self.store_failing_since}: {self.store_error}"

    @property
    def alive(self) -> bool:
        return self.outcome in ("starting", "running")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerReport:
    member: str
    job: str | None = None
    epoch: int = 0
    workers: tuple[WorkerRecord, ...] = ()
    first_step_at: float = 0.0  # wall clock of the first progress of this epoch (benchmarks)
    started_at: float = 0.0  # wall clock the workers of this epoch were started

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(
            w if isinstance(w, WorkerRecord) else schemas.build(WorkerRecord, w) for w in self.workers))
        if not (math.isfinite(self.first_step_at) and math.isfinite(self.started_at)):
            raise ValueError(f"a worker report's times must be finite, got {self.first_step_at}, {self.started_at}")

    def alive(self, up_to_epoch: int | None = None) -> bool:
        """Whether workers (of ``up_to_epoch`` or older, when given) still run here."""
        if up_to_epoch is not None and self.epoch > up_to_epoch:
            return False
        return any(w.alive for w in self.workers)

    def store_failing(self, job: str, epoch: int) -> WorkerRecord | None:
        """The worker of ``job``'s ``epoch`` here whose store outage began first (None: none has one)."""
        failing = [w for w in self.of(job, epoch).values() if w.store_failing_since >= 0]
        return min(failing, key=lambda w: (w.store_failing_since, w.rank), default=None)

    def of(self, job: str, epoch: int) -> dict[int, WorkerRecord]:
        if self.job != job or self.epoch != epoch:
            return {}
        return {w.rank: w for w in self.workers}

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerReport:
        return schemas.decode(cls, data, "worker report")


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    job: str
    epoch: int
    rank: int
    step: int
    loss: float
    samples_per_s: float
    busy_fraction: float
    member: str = ""
    at: float = 0.0
    peak_bytes: int = 0   # the most memory the worker held since its stage was built, as the plan counts it: on a
    # GPU its tensors, on a CPU its whole process (trainer.engine.memory; 0: not measured)
    compute_s: float = 0.0   # the stage's compute per micro-batch in this step, waits left out (0: not measured)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Progress:
        """A record as read from etcd, where a hand may have written it: the numbers a worker can
        report, or ValueError (a step of 1e9 made the leader restart a healthy epoch as stuck, and
        status print it). The loss may be anything: a diverged run's is NaN."""
        p = schemas.decode(cls, data, "progress")
        counts = {"epoch": p.epoch, "rank": p.rank, "step": p.step, "peak_bytes": p.peak_bytes}
        rates = {"samples_per_s": p.samples_per_s, "compute_s": p.compute_s, "at": p.at}
        if any(v < 0 for v in counts.values()) or not all(math.isfinite(v) and v >= 0 for v in rates.values()) \
                or not 0.0 <= p.busy_fraction <= 1.0:
            raise ValueError(f"progress out of range: {counts | rates | {'busy_fraction': p.busy_fraction}}")
        return p


Span = tuple[float, float]   # wall-clock seconds of an epoch's first and newest reported step


def encode_history(pairs: Iterable[tuple[int, float]], span: Span | None = None) -> bytes:
    doc: dict[str, Any] = {"steps": [[int(s), float(v)] for s, v in sorted(pairs)]}
    if span is not None:
        doc["span"] = [float(span[0]), float(span[1])]
    return json.dumps(doc).encode()


def decode_history(data: bytes) -> tuple[list[tuple[int, float]], Span | None]:
    """(the (step, loss) pairs, the span or None: entries written before spans existed have none)."""
    doc = schemas.load_json(data)
    if not isinstance(doc, dict):
        raise ValueError("history is not a JSON object")
    steps = doc.get("steps", [])
    # steps as written (whole numbers from 0): a float step was cut, and 1e999 raised OverflowError,
    # which crashed `varunactl status` and lost the job's report
    if not isinstance(steps, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
            and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool) for pair in steps):
        raise ValueError("history is malformed: its steps are not [[step, loss], ...] with whole steps >= 0")
    pairs = [(s, float(v)) for s, v in steps]
    span = doc.get("span")
    if span is None:
        return pairs, None
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(t, (int, float)) for t in span)
            and span[0] <= span[1]):
        raise ValueError(f"history span is malformed: {span!r}")
    return pairs, (float(span[0]), float(span[1]))


def merge_spans(spans: Iterable[Span]) -> Span | None:
    """One epoch's span from its daemons' (each saw the same steps, a little earlier or later)."""
    spans = list(spans)
    return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None


def stall_before(epoch: int, ran: Iterable[int], spans: Mapping[int, Span]) -> float | None:
    """Wall seconds from the last step of the newest epoch before `epoch` that ran a step to
    `epoch`'s first step: how long training stood still across the morph(s) between them, a
    lost VM's lease wait and the new workers' start-up included. None when either has no span."""
    before = max((e for e in ran if e < epoch), default=None)
    if before is None or before not in spans or epoch not in spans:
        return None
    return spans[epoch][0] - spans[before][1]


def merge_history(per_epoch: Mapping[int, Iterable[tuple[int, float]]]) -> list[tuple[int, float]]:
    """One loss per step: a step redone after a morph takes the newer epoch's value."""
    merged: dict[int, float] = {}
    for epoch in sorted(per_epoch):
        for step, loss in per_epoch[epoch]:
            merged[step] = loss
    return sorted(merged.items())


def epoch_ranges(per_epoch: Mapping[int, Iterable[tuple[int, float]]]) -> dict[int, tuple[int, int]]:
    """Epoch -> (first step, last step) it ran."""
    out = {}
    for epoch, pairs in per_epoch.items():
        steps = [s for s, _ in pairs]
        if steps:
            out[epoch] = (min(steps), max(steps))
    return out


def steps_trained_twice(ranges: Mapping[int | str, Sequence[int]]) -> int:
    """Steps an epoch trained that an earlier epoch had already trained (it resumed from behind),
    from epoch -> (first step, last step) as `epoch_ranges` gives it (JSON's string keys too)."""
    redone, reached = 0, -1
    for _, (first, last) in sorted((int(e), (int(r[0]), int(r[1]))) for e, r in ranges.items()):
        redone += max(0, min(reached, last) - first + 1)
        reached = max(reached, last)
    return redone
