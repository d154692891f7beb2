"""The job report: pictures of a run and what it cost.

    varunactl report JOB [--out DIR] [--prices FILE] [--store DIR]

The leader also writes it into ``<job store>/report/`` when a job that ran ends. Files:

    loss.png                 loss per step; a dashed marker where each morph took effect
    timeline.png             one measured step (newest epoch, after its warm-up step): a row
                             per worker, forward/recompute/backward/all-reduce as coloured bars
    trace.json               that step as one Chrome trace (open it in Perfetto), every worker
    timeline_predicted.png   the simulator's replay of the job's plan from its calibration
    trace_predicted.json     ... as a Chrome trace
    cost.json                device-hours, cost at spot and on-demand prices, samples per dollar,
                             time lost to morphs
    report.json, report.txt  all of it summarised (report.txt is what varunactl prints)

Inputs: the job's spec, state (plan, morphs, start and finish times), loss history and
calibration from etcd; the workers' traces from ``<job store>/traces/epoch<E>/`` (the daemons
point VARUNA_TRACE_DIR there). A part that cannot be drawn (no traces, no measured calibration,
no price for a device kind) becomes a note in the report, never an error.

Device time. The job holds P x D devices of its plan from the moment that plan is written until
the next plan (a morph) or the end: the stop and re-plan of a morph are counted with the shape
being left, which also holds the VMs meanwhile. Devices are priced by the plan's mix of device
kinds (the newest plan's, for every epoch). Time lost to a morph is the stall plus the steps
redone after resuming from the last checkpoint, at the measured step time (the mean step time
when no step was traced). The stall is measured from the old epoch's last reported step to the
new epoch's first, less one step: so it holds the wait for a lost VM's lease to expire, the stop,
the re-plan, the new workers' start-up and the checkpoint load. Where an epoch's daemons did not
record those times (older daemons), the leader's stop-and-re-plan time stands in, which misses
the lease wait and the start-up. "On demand without morphs" prices the same work on dedicated
VMs, which are not preempted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.calibration import Calibration
from trainer.plot import render_line_chart
from trainer.schedule import build_table
from trainer.simulator import simulate, stage_costs
from trainer.timeline import render_timeline

from varunad.ctl import job_status
from varunad.fleetkeys import FleetKeys
from varunad.jobs import JobSpec, JobState, model_fingerprint
from varunad.prices import DevicePrice, load_prices, price_of
from varunad.records import stall_before
from varunad.store import Store

__all__ = ["FILES", "ReportInputs", "Interval", "MeasuredStep", "collect", "run_intervals", "morph_losses",
           "cost_report", "predict", "pick_measured_step", "build_report", "format_report", "write_end_of_job_report"]

log = logging.getLogger(__name__)

FILES = ("loss.png", "timeline.png", "trace.json", "timeline_predicted.png", "trace_predicted.json", "cost.json",
         "report.json", "report.txt")
_HISTORY_GRACE_S = 1.0  # daemons write the last loss history just after the workers' exit reports


class _Missing(Exception):
    """A part of the report that cannot be made, and why (becomes a note)."""


@dataclass(frozen=True, slots=True)
class ReportInputs:
    spec: JobSpec
    state: JobState
    status: dict[str, Any]  # varunad.ctl.job_status: loss history, epoch step ranges, ...
    calibrations: dict[str, bytes]  # device kind -> the stored calibration of the job's model
    store_dir: str | None
    now: float


async def collect(store: Store, keys: FleetKeys, job: str, *, store_dir: str | None = None) -> ReportInputs:
    """Everything the report reads from etcd (CtlError if there is no such job)."""
    status = await job_status(store, keys, job)
    spec = JobSpec.decode((await store.get(keys.job(job))).value, job=job)
    kv = await store.get(keys.state(job))
    state = JobState.decode(kv.value) if kv is not None else JobState(job=job)
    listing = await store.get_prefix(keys.calibration_of(model_fingerprint(spec)))
    calibrations = {kv.key.rsplit("/", 1)[-1]: kv.value for kv in listing}
    return ReportInputs(spec=spec, state=state, status=status, calibrations=calibrations,
                        store_dir=store_dir or spec.store or state.store or None, now=time.time())


# --- device time and cost ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Interval:
    """The job held `devices` devices (its plan's P x D) from `start` to `end` (wall clock)."""

    epoch: int
    shape: str
    devices: int
    start: float
    end: float

    @property
    def device_hours(self) -> float:
        return self.devices * max(0.0, self.end - self.start) / 3600.0


def _devices(shape: str) -> int:
    m = re.fullmatch(r"(\d+)x(\d+)", shape or "")
    return int(m[1]) * int(m[2]) if m else 0


def run_intervals(state: JobState, now: float) -> list[Interval]:
    """One interval per run plan, oldest first; the last ends when the job did (or `now`)."""
    if not state.epochs:
        return []
    plan_shape = f"{state.plan.get('P')}x{state.plan.get('D')}"
    first = state.morphs[0].from_shape if state.morphs and state.morphs[0].from_shape != "-" else plan_shape
    first_epoch = state.morphs[0].from_epoch if state.morphs else state.epoch
    starts = [(first_epoch, first, state.started_at or (state.morphs[0].noticed_at if state.morphs else now))]
    starts += [(m.to_epoch, m.to_shape, m.planned_at) for m in state.morphs]
    end = (state.finished_at or state.updated_at) if state.terminal else now
    ends = [t for _, _, t in starts[1:]] + [max(end, starts[-1][2])]
    return [Interval(e, shape, _devices(shape), t0, t1) for (e, shape, t0), t1 in zip(starts, ends)]


def morph_losses(state: JobState, epoch_steps: Mapping[str, Sequence[int]],
                 epoch_spans: Mapping[str, Sequence[float]] | None = None,
                 step_s: float | None = None) -> tuple[float, int]:
    """(seconds the job stood still across its morphs, steps redone after a resume).

    `epoch_steps` is job_status's epoch -> [first step, last step], `epoch_spans` its epoch ->
    [wall time of the first step, of the last]. Morphs into an epoch that never ran a step (a
    morph during a morph's start-up) are measured together with the next one that did."""
    ranges = sorted((int(e), int(r[0]), int(r[1])) for e, r in epoch_steps.items())
    redone, reached = 0, -1
    for _, first, last in ranges:
        redone += max(0, min(reached, last) - first + 1)
        reached = max(reached, last)
    spans = {int(e): (float(v[0]), float(v[1])) for e, v in (epoch_spans or {}).items()}
    step_s = step_s if step_s is not None else _steady_step_s(ranges, spans)
    ran = [e for e, _, _ in ranges]
    downtime, pending = 0.0, 0.0
    for m in sorted(state.morphs, key=lambda m: m.to_epoch):
        pending += max(0.0, m.planned_at - m.noticed_at)
        if m.to_epoch not in ran:
            continue
        gap = stall_before(m.to_epoch, ran, spans)
        if gap is not None:   # less the one step that would have run anyway
            pending = max(pending, gap - (step_s or 0.0))
        downtime, pending = downtime + pending, 0.0
    return downtime + pending, redone


def _steady_step_s(ranges: Sequence[tuple[int, int, int]], spans: Mapping[int, tuple[float, float]]
                   ) -> float | None:
    """Seconds per step in the longest epoch with a recorded span (its checkpoints included)."""
    best = max(((last - first, spans[e]) for e, first, last in ranges if e in spans and last > first),
               default=None, key=lambda x: x[0])
    return None if best is None else (best[1][1] - best[1][0]) / best[0]


def cost_report(intervals: Sequence[Interval], device_kinds: Mapping[str, int], prices: Mapping[str, DevicePrice],
                *, steps: int, batch_size: int, downtime_s: float, redone_steps: int,
                step_s: float | None = None, restarts: int = 0) -> dict[str, Any]:
    """Device-hours and dollars of the run; see the module docstring for what is counted.
    `step_s` (a measured step) prices the redone steps; without it, the mean step does, which
    also holds the workers' start-up and checkpoints and so overstates the loss."""
    wall = sum(max(0.0, iv.end - iv.start) for iv in intervals)
    device_hours = sum(iv.device_hours for iv in intervals)
    kinds = {k: n for k, n in device_kinds.items() if n > 0} or {"unknown": 1}
    total = sum(kinds.values())
    rows, missing = [], []
    for kind, n in sorted(kinds.items()):
        dh = device_hours * n / total
        price = price_of(prices, kind)
        if price is None:
            missing.append(kind)
        rows.append({"kind": kind, "plan_devices": n, "device_hours": dh,
                     "spot_per_hour": price and price.spot, "on_demand_per_hour": price and price.on_demand,
                     "spot_usd": price and dh * price.spot, "on_demand_usd": price and dh * price.on_demand,
                     "source": price.source if price else None})
    spot = None if missing else sum(r["spot_usd"] for r in rows)
    on_demand = None if missing else sum(r["on_demand_usd"] for r in rows)
    executed = steps + redone_steps
    mean_step_s = (wall - downtime_s) / executed if executed else None
    lost_s = downtime_s + redone_steps * (step_s or mean_step_s or 0.0)
    lost_dh = device_hours * lost_s / wall if wall > 0 else 0.0
    dedicated = None if on_demand is None or device_hours <= 0 else on_demand * (device_hours - lost_dh) / device_hours
    samples = steps * batch_size
    return {
        "wall_s": wall, "device_hours": device_hours, "by_kind": rows, "missing_prices": missing,
        "spot_usd": spot, "on_demand_usd": on_demand,
        "samples": samples,
        "samples_per_usd_spot": samples / spot if spot else None,
        "samples_per_usd_on_demand": samples / on_demand if on_demand else None,
        "mean_step_s": mean_step_s, "redone_step_s": step_s or mean_step_s,
        # a restart of the same plan after a worker failed is not a morph: counted apart
        "morphs": {"count": max(0, len(intervals) - 1 - restarts), "restarts": restarts,
                   "downtime_s": downtime_s, "redone_steps": redone_steps,
                   "lost_s": lost_s, "lost_fraction": lost_s / wall if wall > 0 else 0.0,
                   "lost_device_hours": lost_dh},
        "on_demand_without_morphs_usd": dedicated,
        "spot_saving_factor": dedicated / spot if dedicated and spot else None,
    }


# --- timelines -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MeasuredStep:
    epoch: int
    step: int
    warm: bool  # False: the only complete step is its epoch's first, which includes warm-up
    events: list[dict[str, Any]]  # the step's complete ("X") events
    meta: list[dict[str, Any]]  # the workers' process/thread names
    workers: int

    @property
    def duration_s(self) -> float:
        t0 = min(float(e["ts"]) for e in self.events)
        t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in self.events)
        return (t1 - t0) / 1e6

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


def pick_measured_step(store_dir: str, expected_workers: Mapping[int, int],
                       checkpoint_every: int | None = None) -> MeasuredStep:
    """The newest epoch's newest step that every worker traced, preferring one after the
    epoch's first (warm-up) step, and one that is not the first after a checkpoint (a staged
    checkpoint is copied into the store while it runs). `expected_workers`: epoch -> P x D
    (else: every worker seen)."""
    epochs = _trace_epochs(store_dir)
    if not epochs:
        raise _Missing(f"no traces under {Path(store_dir) / 'traces'} (the daemons write them there)")
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
        step = (quiet or warm or complete)[-1]
        events = [e for e in spans if e.get("args", {}).get("step") == step]
        return MeasuredStep(epoch, step, bool(warm), events, meta, want)
    raise _Missing(f"no step in {len(epochs)} traced epoch(s) was traced by every worker")


def _chrome_trace(events: list[dict], meta: list[dict], **other: Any) -> dict[str, Any]:
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def _stage_meta(P: int, D: int, what: str) -> list[dict[str, Any]]:
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
    flags and link kinds."""
    if not plan.get("P"):
        raise _Missing("the job has no run plan")
    if not plan.get("calibrated"):
        raise _Missing("the plan came from a synthetic calibration (no measured one): nothing to predict from")
    P, D, mbs, cuts = int(plan["P"]), int(plan["D"]), int(plan["micro_batch_size"]), list(plan.get("cuts", []))
    kinds = plan.get("stage_kinds") or ([next(iter(calibrations))] if len(calibrations) == 1 else None)
    if not kinds:
        raise _Missing("the job state does not say which device kind ran each stage (a plan from an older leader)")
    try:
        cals = [Calibration.from_bytes(calibrations[k]) for k in kinds]
    except KeyError as exc:
        raise _Missing(f"no stored calibration for device kind {exc.args[0]}") from None
    bounds = [0, *(c + 1 for c in cuts), cals[0].n_segments]
    m = int(plan.get("micro_batches") or batch_size // (mbs * D))
    one_host = len(plan.get("members", [])) <= 1
    links = plan.get("link_kinds") or ["intra" if one_host else "inter"] * (P - 1)
    ar = plan.get("allreduce_kinds") or ["intra" if one_host or D == 1 else "inter"] * P
    costs = stage_costs(cals, bounds, mbs, D, links, ar)
    events: list[dict[str, Any]] = []
    result = simulate(build_table(plan.get("schedule") or "varuna", P, m, plan.get("recompute") or True), costs,
                      events=events)
    # The simulator runs a stage's replicas in lock-step: draw each, so rows match the measured step.
    return result.minibatch_s, [{**e, "tid": r} for r in range(D) for e in events]


# --- the report ----------------------------------------------------------------------------------------

def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _loss_section(inputs: ReportInputs, out: Path) -> dict[str, Any]:
    history = inputs.status.get("loss_history") or []
    if not history:
        raise _Missing("no loss was recorded")
    epochs = inputs.status.get("epochs", {})
    # A morph is marked where the job stood when it happened (the step after the old epoch's last),
    # labelled with its cause; the steps redone from the checkpoint after it are shaded.
    markers, redone = [], []
    restarts = sum(1 for m in inputs.state.morphs if m.restart and str(m.to_epoch) in epochs)
    for m in inputs.state.morphs:
        if str(m.to_epoch) not in epochs:
            continue
        resumed = epochs[str(m.to_epoch)][0]
        at = epochs[str(m.from_epoch)][1] + 1 if str(m.from_epoch) in epochs else resumed
        markers.append((at, (m.cause or f"{m.from_shape}>{m.to_shape}").replace(" was lost", " lost")))
        if resumed < at:
            redone.append((resumed, at - 1))
    chart = render_line_chart(out / "loss.png", history, markers=markers, spans=redone,
                              title=f"{inputs.spec.job}  loss per step  ({_plural(len(markers) - restarts, 'morph')}"
                                    + _restarts(restarts) + (", redone steps shaded)" if redone else ")"))
    return {"png": "loss.png", "size": [chart.width, chart.height], "morph_steps": [x for x, _ in markers],
            "redone_spans": redone,
            "first_loss": history[0][1], "last_loss": history[-1][1]}


def _measured_section(inputs: ReportInputs, intervals: Sequence[Interval], out: Path) -> MeasuredStep:
    if not inputs.store_dir:
        raise _Missing("the job's store is unknown: pass --store")
    expected = {iv.epoch: iv.devices for iv in intervals}
    measured = pick_measured_step(inputs.store_dir, expected, inputs.spec.checkpoint_every)
    _write_json(out / "trace.json", _chrome_trace(measured.events, measured.meta, job=inputs.spec.job,
                                                  epoch=measured.epoch, step=measured.step, source="measured"))
    render_timeline([out / "trace.json"], out / "timeline.png", measured.step, title="measured")
    return measured


def _predicted_section(inputs: ReportInputs, out: Path) -> float:
    seconds, events = predict(inputs.state.plan, inputs.calibrations, inputs.spec.batch_size)
    P, D = int(inputs.state.plan["P"]), int(inputs.state.plan["D"])
    _write_json(out / "trace_predicted.json", _chrome_trace(events, _stage_meta(P, D, "predicted"),
                                                            job=inputs.spec.job, source="simulator"))
    render_timeline([out / "trace_predicted.json"], out / "timeline_predicted.png", title="predicted")
    return seconds


def _attempt(notes: list[str], what: str, fn, *args) -> Any:
    """Run one section; what stops it (missing inputs, unreadable files) becomes a note."""
    try:
        return fn(*args)
    except _Missing as exc:
        notes.append(f"{what}: {exc}")
    except (ValueError, OSError, KeyError) as exc:
        notes.append(f"{what} failed: {exc}")
    return None


def build_report(inputs: ReportInputs, out_dir: str | os.PathLike[str], prices: Mapping[str, DevicePrice]
                 ) -> dict[str, Any]:
    """Write every file of the report into `out_dir`; returns report.json's content."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a picture left from an earlier report must not pass for this one's
        (out / name).unlink(missing_ok=True)
    state, status, notes = inputs.state, inputs.status, []
    intervals = run_intervals(state, inputs.now)
    if state.epochs and not state.started_at:
        notes.append("the job state predates start times: device time counts from the first morph")
    loss = _attempt(notes, "loss chart", _loss_section, inputs, out)
    measured = _attempt(notes, "measured timeline", _measured_section, inputs, intervals, out)
    predicted_s = _attempt(notes, "predicted timeline", _predicted_section, inputs, out)
    step_s = measured.duration_s if measured is not None and measured.warm else None
    downtime, redone = morph_losses(state, status.get("epochs", {}), status.get("epoch_spans"), step_s)
    cost = cost_report(intervals, state.plan.get("device_kinds") or _kinds_from(inputs.calibrations), prices,
                       steps=int(status.get("step") or 0), batch_size=inputs.spec.batch_size,
                       downtime_s=downtime, redone_steps=redone, step_s=step_s,
                       restarts=sum(m.restart for m in state.morphs))
    cost["intervals"] = [{"epoch": iv.epoch, "shape": iv.shape, "devices": iv.devices, "start": iv.start,
                          "end": iv.end, "device_hours": iv.device_hours} for iv in intervals]
    if cost["missing_prices"]:
        notes.append(f"no price for device kind {', '.join(cost['missing_prices'])}: add it with --prices FILE")
    _write_json(out / "cost.json", cost)
    doc = {
        "job": inputs.spec.job, "state": state.state, "reason": state.reason, "steps": status.get("step"),
        "batch_size": inputs.spec.batch_size, "shapes": [iv.shape for iv in intervals], "plan": state.plan,
        "loss": loss, "measured": None if measured is None else {
            "epoch": measured.epoch, "step": measured.step, "warm": measured.warm, "workers": measured.workers,
            "step_s": measured.duration_s, "recompute_stages": measured.recompute_stages(),
            "png": "timeline.png", "trace": "trace.json"},
        "predicted": None if predicted_s is None else {
            "step_s": predicted_s, "planner_estimate_s": state.plan.get("estimated_s"),
            "png": "timeline_predicted.png", "trace": "trace_predicted.json"},
        "cost": cost, "notes": notes, "written_at": inputs.now,
        "files": [name for name in FILES[:-2] if (out / name).exists()] + ["report.json", "report.txt"],
    }
    if measured is not None and not measured.warm:
        notes.append(f"only step {measured.step}, the first of epoch {measured.epoch}, was traced by every worker: "
                     "its timeline includes warm-up")
    if measured is not None and predicted_s:
        doc["predicted"]["error"] = predicted_s / measured.duration_s - 1.0
        planned = [s for s, r in enumerate(state.plan.get("recompute") or []) if r]
        if "recompute" in state.plan and planned != measured.recompute_stages():
            notes.append(f"the planner assumed recompute on stages {planned}, the workers recomputed on "
                         f"{measured.recompute_stages()}: the prediction replays the planner's assumption")
        sharing = state.plan.get("daemons_per_host") or 0
        if sharing > 1:
            notes.append(f"{sharing} daemons ran on one host and shared its cores and memory bandwidth (a local "
                         "ring), while the simulator assumes each has its own: expect the measured step to be slower")
    _write_json(out / "report.json", doc)
    (out / "report.txt").write_text(format_report(doc))
    return doc


def _kinds_from(calibrations: Mapping[str, bytes]) -> dict[str, int]:
    """Without the plan's device mix (an older leader), one calibrated kind is the best guess."""
    return {next(iter(calibrations)): 1} if len(calibrations) == 1 else {}


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _restarts(n: int) -> str:
    return f", {_plural(n, 'restart')} after a worker failed" if n else ""


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _cost_lines(cost: dict[str, Any]) -> list[str]:
    w = max([8] + [len(r["kind"]) for r in cost["by_kind"]])   # GPU model names are long
    lines = [f"{'KIND':<{w}} {'DEVICE_H':>9} {'SPOT_$/H':>9} {'ONDEM_$/H':>9} {'SPOT':>10} {'ON_DEMAND':>10}  SOURCE"]
    for r in cost["by_kind"]:
        sp, od = r["spot_per_hour"], r["on_demand_per_hour"]
        lines.append(f"{r['kind']:<{w}} {r['device_hours']:>9.4f} "
                     f"{'-' if sp is None else f'{sp:.3f}':>9} {'-' if od is None else f'{od:.3f}':>9} "
                     f"{_usd(r['spot_usd']):>10} {_usd(r['on_demand_usd']):>10}  {r['source'] or 'no price'}")
    m = cost["morphs"]
    lines += [
        f"total    {cost['device_hours']:.4f} device-hours over {cost['wall_s']:.1f} s: {_usd(cost['spot_usd'])} "
        f"at spot, {_usd(cost['on_demand_usd'])} on demand",
        f"samples  {cost['samples']:,}: {_count(cost['samples_per_usd_spot'])} per $ at spot, "
        f"{_count(cost['samples_per_usd_on_demand'])} per $ on demand",
        f"morphs   {m['count']}{_restarts(m.get('restarts', 0))}: "
        f"{m['lost_s']:.1f} s lost ({100 * m['lost_fraction']:.1f}% of the run: "
        f"{m['downtime_s']:.1f} s stalled + {_plural(m['redone_steps'], 'redone step')})",
    ]
    if cost["spot_saving_factor"] and cost["samples"]:   # nothing trained: nothing to compare
        lines.append(f"saving   the same work on dedicated on-demand VMs (no morphs) would cost "
                     f"{_usd(cost['on_demand_without_morphs_usd'])}: spot is {cost['spot_saving_factor']:.1f}x cheaper")
    return lines


def format_report(doc: dict[str, Any]) -> str:
    """report.txt: the summary varunactl prints."""
    lines = [f"job      {doc['job']}: {doc['state']} ({doc['reason']})",
             f"run      {doc['steps']} steps x batch {doc['batch_size']} as {' -> '.join(doc['shapes']) or '-'}"]
    meas, pred = doc["measured"], doc["predicted"]
    if meas:
        lines.append(f"step     measured {meas['step_s']:.4f} s (step {meas['step']} of epoch {meas['epoch']}, "
                     f"{_plural(meas['workers'], 'worker')}{'' if meas['warm'] else ', includes warm-up'})")
    if pred:
        err = f", {100 * pred['error']:+.1f}% vs measured" if "error" in pred else ""
        lines.append(f"         predicted {pred['step_s']:.4f} s by the simulator{err}")
    from varunad.ctl import plan_lines   # the same explanation as `varunactl status JOB`

    lines += [ln.replace("why      ", "plan     ", 1) for ln in plan_lines(doc.get("plan") or {})]
    lines += _cost_lines(doc["cost"])
    lines.append("files    " + ", ".join(doc["files"]))
    lines += [f"note     {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


async def write_end_of_job_report(store: Store, keys: FleetKeys, job: str, store_dir: str, *,
                                  timeout: float) -> None:
    """The leader's end-of-job report into ``<store_dir>/report``. Never raises: a report is a
    by-product, and its failure is logged, not passed on to the job or the leader."""
    if "://" in store_dir:
        log.info("report: %s is in an object store (%s); run `varunactl report %s` to draw it", job, store_dir, job)
        return
    try:
        await asyncio.sleep(_HISTORY_GRACE_S)
        inputs = await asyncio.wait_for(collect(store, keys, job, store_dir=store_dir), 4 * timeout)
        out = os.path.join(store_dir, "report")
        # Rendering is CPU work on private data (no daemon state is touched): a worker thread keeps
        # it off the event loop so heartbeats and the next job's planning never wait for it.
        doc = await asyncio.to_thread(build_report, inputs, out, load_prices())
        log.info("report: wrote the report of %s to %s%s", job, out,
                 "".join(f"\n  note: {n}" for n in doc["notes"]))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the job's outcome stands
        log.warning("report: could not write the report of %s: %s", job, exc)
