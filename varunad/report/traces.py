"""Chrome traces in a report: the measured step, the simulator's prediction, and reading trace files.

The workers under a daemon trace their first steps of each epoch into
``<job store>/traces/epoch<E>/trace-rank*.json`` (trainer.engine.trace). The report keeps one step of
them as trace.json (every worker, one file: open it in Perfetto) and the simulator's replay of
the plan as trace_predicted.json; `varunad.report.draw` draws both as timelines. Plain JSON and
numpy only: no torch, no matplotlib.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.planning.calibration import Calibration
from trainer.planning.schedule import DEFAULT_SCHEDULE, build_table
from trainer.planning.simulator import simulate, stage_costs

__all__ = ["WARMUP", "Missing", "MeasuredStep", "pick_measured_step", "chrome_trace", "stage_meta", "predict",
           "load_events", "select_step"]


# traced steps of an epoch left out of the steady state (the daemons trace an epoch's first five)
WARMUP = 2


class Missing(Exception):
    """A part of the report that cannot be made, and why (becomes a note, never an error)."""


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    epoch: int
    step: int
    warm: bool  # False: the only complete step is its epoch's first, which includes warm-up
    events: list[dict[str, Any]]  # the step's complete ("X") events
    meta: list[dict[str, Any]]  # the workers' process/thread names
    workers: int
    # the steady-state steps whose median step time this one has (itself only when no other qualified)
    median_of: tuple[int, ...] = ()

    @property
    def duration_s(self) -> float:
        return _duration_s(self.events)

    def recompute_stages(self) -> list[int]:
        return sorted({int(e["pid"]) for e in self.events if e.get("cat") == "recompute"})


def _trace_epochs(store_dir: str) -> list[tuple[int, Path]]:
    root = Path(store_dir) / "traces"
    found = [(int(m[1]), p) for p in root.glob("epoch*") if (m := re.fullmatch(r"epoch(\d+)", p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _read_trace_dir(directory: Path) -> tuple[list[dict], list[dict]]:
    """(complete events, metadata events) of every readable trace file in `directory`."""
    spans, meta = [], []
    for f in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):  # a worker killed mid-write leaves only its .tmp, but be safe
            continue
        for e in doc.get("traceEvents", []) if isinstance(doc, dict) else []:
            if isinstance(e, dict) and e.get("ph") == "X":
                spans.append(e)
            elif isinstance(e, dict) and e.get("ph") == "M":
                meta.append(e)
    return spans, meta


def _duration_s(events: list[dict[str, Any]]) -> float:
    return (max(float(e["ts"]) + float(e.get("dur", 0)) for e in events) - min(float(e["ts"]) for e in events)) / 1e6


def pick_measured_step(store_dir: str, expected_workers: Mapping[int, int],
                       checkpoint_every: int | None = None) -> MeasuredStep:
    """A steady-state step of the newest epoch that every worker traced: among its complete
    steps after the first WARMUP traced ones (their caches, allocator and connections still
    warming up), and not the first after a checkpoint (a staged checkpoint is copied into the
    store while it runs), the one with the median step time. Where no step qualifies, the
    newest after the epoch's first, else the first itself (``warm`` False). `expected_workers`:
    epoch -> P x D (else: every worker seen)."""
    epochs = _trace_epochs(store_dir)
    if not epochs:
        raise Missing(f"no traces under {Path(store_dir) / 'traces'} (the daemons write them there)")
    for epoch, directory in epochs:
        spans, meta = _read_trace_dir(directory)
        by_step: dict[int, set] = {}
        for e in spans:
            step = e.get("args", {}).get("step")
            if step is not None:
                by_step.setdefault(int(step), set()).add((e["pid"], e["tid"]))
        want = expected_workers.get(epoch) or len(set().union(*by_step.values()) if by_step else ())
        complete = sorted(s for s, w in by_step.items() if len(w) >= want)
        if not complete:
            continue
        warm = [s for s in complete if s != min(by_step)]
        quiet = [s for s in warm if not checkpoint_every or s % checkpoint_every]
        steady = [s for s in quiet if s >= min(by_step) + WARMUP]
        if not steady:
            step = (quiet or warm or complete)[-1]
            events = [e for e in spans if e.get("args", {}).get("step") == step]
            return MeasuredStep(epoch, step, bool(warm), events, meta, want, (step,))
        by_time = sorted(steady, key=lambda s: (_duration_s([e for e in spans if e["args"].get("step") == s]), s))
        step = by_time[(len(by_time) - 1) // 2]   # the lower median: a step that ran, not an average
        events = [e for e in spans if e.get("args", {}).get("step") == step]
        return MeasuredStep(epoch, step, True, events, meta, want, tuple(steady))
    raise Missing(f"no step in {len(epochs)} traced epoch(s) was traced by every worker")


def chrome_trace(events: list[dict], meta: list[dict], **other: Any) -> dict[str, Any]:
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def stage_meta(P: int, D: int, what: str) -> list[dict[str, Any]]:
    meta = []
    for s in range(P):
        meta += [{"name": "process_name", "ph": "M", "pid": s, "args": {"name": f"stage {s} ({what})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": s, "args": {"sort_index": s}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": s, "tid": r, "args": {"name": f"replica {r}"}}
                 for r in range(D)]
    return meta


def predict(plan: Mapping[str, Any], calibrations: Mapping[str, bytes], batch_size: int
            ) -> tuple[float, list[dict[str, Any]]]:
    """(simulated mini-batch seconds, its actions as Chrome trace events, every replica) of the
    plan the leader chose, replayed as the planner replayed it: same calibration, cuts, recompute
    flags, link kinds and slowed stages (stragglers, shared cores)."""
    if not plan.get("P"):
        raise Missing("the job has no run plan")
    if not plan.get("calibrated"):
        raise Missing("the plan came from a synthetic calibration (no measured one): nothing to predict from")
    P, D, mbs, cuts = int(plan["P"]), int(plan["D"]), int(plan["micro_batch_size"]), list(plan.get("cuts", []))
    kinds = plan.get("stage_kinds") or ([next(iter(calibrations))] if len(calibrations) == 1 else None)
    if not kinds:
        raise Missing("the job state does not say which device kind ran each stage (a plan from an older leader)")
    try:
        cals = [Calibration.from_bytes(calibrations[k]) for k in kinds]
    except KeyError as exc:
        raise Missing(f"no stored calibration for device kind {exc.args[0]}") from None
    bounds = [0, *(c + 1 for c in cuts), cals[0].n_segments]
    m = int(plan.get("micro_batches") or batch_size // (mbs * D))
    one_host = len(plan.get("members", [])) <= 1
    links = plan.get("link_kinds") or ["intra" if one_host else "inter"] * (P - 1)
    ar = plan.get("allreduce_kinds") or ["intra" if one_host or D == 1 else "inter"] * P
    costs = stage_costs(cals, bounds, mbs, D, links, ar)
    slowed = plan.get("stage_slowed")
    if isinstance(slowed, list) and len(slowed) == P and all(isinstance(f, (int, float)) and f > 0 for f in slowed):
        costs = tuple(c.slowed(float(f)) for c, f in zip(costs, slowed))
    events: list[dict[str, Any]] = []
    result = simulate(build_table(plan.get("schedule") or DEFAULT_SCHEDULE, P, m, plan.get("recompute") or True), costs,
                      events=events)
    # The simulator runs a stage's replicas in lock-step: draw each, so rows match the measured step.
    return result.minibatch_s, [{**e, "tid": r} for r in range(D) for e in events]


# --- reading trace files (varunactl report --traces, tests) ----------------------------------------------

def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return files


def load_events(trace_files: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """All complete ("X") events of the given files (directories are searched for *.json).
    ValueError, saying which file, when there is none or one cannot be read."""
    files = _expand(trace_files)
    if not files:
        raise ValueError("no trace files found: pass a --trace-dir directory or its .json files")
    events: list[dict[str, Any]] = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read trace file {f}: {exc}") from None
        raw = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
        events += [e for e in raw if isinstance(e, dict) and e.get("ph") == "X"]
    return events


def select_step(events: list[dict[str, Any]], step: int | str | None) -> tuple[list[dict[str, Any]], int | None]:
    """The events of `step` (None: all, "last": the highest tagged step) and the step chosen."""
    if step is None:
        return events, None
    steps = {e.get("args", {}).get("step") for e in events} - {None}
    if step == "last":
        if not steps:
            return events, None  # untagged traces: all of them
        step = max(steps)
    chosen = [e for e in events if e.get("args", {}).get("step") == step]
    if not chosen:
        raise ValueError(f"no events for step {step}; steps in these traces: {sorted(steps) or 'none tagged'}")
    return chosen, int(step)
