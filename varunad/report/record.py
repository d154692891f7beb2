"""The data of a job's report: what the leader writes when a job ends, and `varunactl report` anywhere.

    <job store>/report/    (the leader)      varunactl report JOB --out DIR   (the same, then the pictures)

    loss.json                loss per step; each morph (where the job stood when it happened, its
                             cause) and the steps redone from the checkpoint after it
    trace.json               one measured step (newest epoch, after its warm-up step) as one Chrome
                             trace of every worker (open it in Perfetto)
    trace_predicted.json     the simulator's replay of the job's plan from its calibration, as a Chrome trace
    cost.json                device-hours, cost at spot and on-demand prices, samples per dollar,
                             time lost to morphs (varunad.report.cost says what is counted)
    report.json, report.txt  all of it summarised, with a row per run plan (shape, steps, samples/s)
                             and each slot's measured speed (the stragglers among them);
                             report.txt is what varunactl prints

Pictures are drawn from these files by `varunad.report.pictures` (matplotlib, the `report`
extra), never here: the leader runs in the control plane of a daemon whose image needs no
plotting library. Inputs: the job's spec, state (plan, morphs, start and finish times), loss
history and calibration from etcd; the workers' traces from ``<job store>/traces/epoch<E>/``.
A part that cannot be made (no traces, no measured calibration, no price for a device kind)
becomes a note in the report, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varunad.control.fleet import usable_spec
from varunad.control.jobs import JobSpec, JobState, script_fingerprint
from varunad.control.status import job_status, memory_lines, plan_lines, speed_lines
from varunad.report.cost import Interval, cost_lines, cost_report, morph_losses, plural, run_intervals
from varunad.report.prices import DevicePrice, load_prices
from varunad.report.traces import MeasuredStep, Missing, chrome_trace, pick_measured_step, predict, stage_meta
from varunad.store.contract import Store
from varunad.store.keys import Keys
from varunad.store.schemas import strict_json

__all__ = ["DATA_FILES", "PICTURES", "ReportInputs", "collect", "build_report", "format_report",
           "write_end_of_job_report"]

log = logging.getLogger(__name__)

DATA_FILES = ("loss.json", "trace.json", "trace_predicted.json", "cost.json", "report.json", "report.txt")
# Drawn from the data by varunactl (varunad.report.pictures); named here so a new report clears old ones.
PICTURES = ("loss.png", "timeline.png", "timeline_predicted.png", "throughput.png", "speed.png")
_HISTORY_GRACE_S = 1.0  # daemons write the last loss history just after the workers' exit reports


@dataclass(frozen=True, slots=True)
class ReportInputs:
    spec: JobSpec
    state: JobState
    status: dict[str, Any]  # varunad.control.status.job_status: loss history, epoch step ranges, ...
    calibrations: dict[str, bytes]  # device kind -> the stored calibration of the job's model
    store_dir: str | None
    now: float


async def collect(store: Store, keys: Keys, job: str, *, store_dir: str | None = None) -> ReportInputs:
    """Everything the report reads from etcd (UnknownJob if there is no such job)."""
    status = await job_status(store, keys, job)
    # the spec the fleet ran: as submitted, whatever was written over its key since
    spec = (await usable_spec(store, await store.get(keys.job(job)), job, timeout=None))[0]
    kv = await store.get(keys.state(job))
    state = JobState.decode(kv.value) if kv is not None else JobState(job=job)
    listing = await store.get_prefix(keys.calibration_of(script_fingerprint(spec)))
    calibrations = {kv.key.rsplit("/", 1)[-1]: kv.value for kv in listing}
    return ReportInputs(spec=spec, state=state, status=status, calibrations=calibrations,
                        store_dir=store_dir or spec.store or state.store or None, now=time.time())


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(strict_json(doc, indent=1))   # a diverged step's loss is null
    os.replace(tmp, path)


# --- sections: each writes its data file and returns its summary for report.json ------------------------

def _loss_section(inputs: ReportInputs, out: Path) -> dict[str, Any]:
    history = inputs.status.get("loss_history") or []
    if not history:
        raise Missing("no loss was recorded")
    epochs = inputs.status.get("epochs", {})
    # A morph is marked where the job stood when it happened (the step after the old epoch's last,
    # where the VM was lost), labelled with its cause; the steps redone from the checkpoint after
    # it (from where the new epoch resumed up to that mark) are a span of their own.
    morphs, redone = [], []
    for m in inputs.state.morphs:
        if str(m.to_epoch) not in epochs:
            continue
        resumed = epochs[str(m.to_epoch)][0]
        at = epochs[str(m.from_epoch)][1] + 1 if str(m.from_epoch) in epochs else resumed
        morphs.append({"step": at, "resumed": resumed, "restart": m.restart, "shapes": [m.from_shape, m.to_shape],
                       "label": (m.cause or f"{m.from_shape}>{m.to_shape}").replace(" was lost", " lost")})
        if resumed < at:
            redone.append([resumed, at - 1])
    _write_json(out / "loss.json", {"job": inputs.spec.job, "history": history, "morphs": morphs, "redone": redone})
    return {"data": "loss.json", "morph_steps": [m["step"] for m in morphs], "redone_spans": redone,
            "first_loss": history[0][1], "last_loss": history[-1][1]}


def _runs(inputs: ReportInputs, intervals: Sequence[Interval]) -> list[dict[str, Any]]:
    """A row per run plan: its shape and the time it held the devices, the steps it ran, when
    its first and last step were reported and the samples per second between them."""
    steps, spans = inputs.status.get("epochs", {}), inputs.status.get("epoch_spans") or {}
    causes = [None] + list(inputs.state.morphs)   # interval i > 0 began with morph i - 1
    rows = []
    for iv, m in zip(intervals, causes):
        first, last = steps.get(str(iv.epoch), (None, None))
        t0, t1 = spans.get(str(iv.epoch), (None, None))
        rate = None
        if first is not None and t0 is not None and last > first and t1 > t0:
            rate = (last - first) * inputs.spec.batch_size / (t1 - t0)
        rows.append({"epoch": iv.epoch, "shape": iv.shape, "devices": iv.devices, "start": iv.start, "end": iv.end,
                     "first_step": first, "last_step": last, "first_step_at": t0, "last_step_at": t1,
                     "samples_per_s": rate,
                     "after": None if m is None else {"cause": m.cause or m.reason.split(":", 1)[0],
                                                      "restart": m.restart, "noticed_at": m.noticed_at}})
    return rows


def _measured_section(inputs: ReportInputs, intervals: Sequence[Interval], out: Path) -> MeasuredStep:
    if not inputs.store_dir:
        raise Missing("the job's store is unknown: pass --store")
    expected = {iv.epoch: iv.devices for iv in intervals}
    measured = pick_measured_step(inputs.store_dir, expected, inputs.spec.checkpoint_every)
    _write_json(out / "trace.json", chrome_trace(measured.events, measured.meta, job=inputs.spec.job,
                                                 epoch=measured.epoch, step=measured.step, source="measured"))
    return measured


def _predicted_section(inputs: ReportInputs, out: Path) -> float:
    seconds, events = predict(inputs.state.plan, inputs.calibrations, inputs.spec.batch_size)
    P, D = int(inputs.state.plan["P"]), int(inputs.state.plan["D"])
    _write_json(out / "trace_predicted.json", chrome_trace(events, stage_meta(P, D, "predicted"),
                                                           job=inputs.spec.job, source="simulator"))
    return seconds


def _attempt(notes: list[str], what: str, fn, *args) -> Any:
    """Run one section; what stops it (missing inputs, unreadable files) becomes a note."""
    try:
        return fn(*args)
    except Missing as exc:
        notes.append(f"{what}: {exc}")
    except (ValueError, OSError, KeyError) as exc:
        notes.append(f"{what} failed: {exc}")
    return None


# --- the report ----------------------------------------------------------------------------------------

def build_report(inputs: ReportInputs, out_dir: str | os.PathLike[str], prices: Mapping[str, DevicePrice]
                 ) -> dict[str, Any]:
    """Write every data file of the report into `out_dir`; returns report.json's content."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in DATA_FILES + PICTURES:  # what an earlier report left must not pass for this one's
        (out / name).unlink(missing_ok=True)
    state, status, notes = inputs.state, inputs.status, []
    intervals = run_intervals(state, inputs.now)
    if state.epochs and not state.started_at:
        notes.append("the job state predates start times: device time counts from the first morph")
    loss = _attempt(notes, "loss", _loss_section, inputs, out)
    measured = _attempt(notes, "measured timeline", _measured_section, inputs, intervals, out)
    predicted_s = _attempt(notes, "predicted timeline", _predicted_section, inputs, out)
    step_s = measured.duration_s if measured is not None and measured.warm else None
    downtime, redone = morph_losses(state, status.get("epochs", {}), status.get("epoch_spans"), step_s)
    cost = cost_report(intervals, state.plan.get("device_kinds") or _kinds_from(inputs.calibrations), prices,
                       steps=int(status.get("step") or 0), batch_size=inputs.spec.batch_size,
                       downtime_s=downtime, redone_steps=redone, step_s=step_s,
                       restarts=sum(m.restart for m in state.morphs))
    # the shapes the job ran as, in order: a restart of the same plan is not a morph, so not a new shape
    shapes = [iv.shape for iv, m in zip(intervals, (None, *state.morphs)) if m is None or not m.restart]
    cost["intervals"] = [{"epoch": iv.epoch, "shape": iv.shape, "devices": iv.devices, "start": iv.start,
                          "end": iv.end, "device_hours": iv.device_hours} for iv in intervals]
    if cost["missing_prices"]:
        notes.append(f"no price for device kind {', '.join(cost['missing_prices'])}: add it with --prices FILE")
    _write_json(out / "cost.json", cost)
    doc = {
        "job": inputs.spec.job, "state": state.state, "reason": state.reason, "steps": status.get("step"),
        "batch_size": inputs.spec.batch_size, "shapes": shapes, "plan": state.plan,
        "memory": inputs.status.get("stages") or [],
        # as the leader last measured them while the job ran (a slot's slowdown against the
        # fastest of its kind); stragglers: the slots its plan was made around
        "speeds": {"paces": dict(status.get("paces") or {}), "stragglers": dict(status.get("stragglers") or {})},
        "runs": _runs(inputs, intervals),
        "calibration": ([state.calibration_started, state.calibration_ended]
                        if state.calibration_started and state.calibration_ended else None),
        "loss": loss, "measured": None if measured is None else {
            "epoch": measured.epoch, "step": measured.step, "warm": measured.warm, "workers": measured.workers,
            "median_of": list(measured.median_of),
            "step_s": measured.duration_s, "recompute_stages": measured.recompute_stages(), "trace": "trace.json"},
        "predicted": None if predicted_s is None else {
            "step_s": predicted_s, "planner_estimate_s": state.plan.get("estimated_s"),
            "trace": "trace_predicted.json"},
        "cost": cost, "notes": notes, "written_at": inputs.now,
        "files": [name for name in DATA_FILES[:-2] if (out / name).exists()] + ["report.json", "report.txt"],
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
        # the plan's facts are the newest epoch's: about another epoch's daemons they say nothing
        sharing = (state.plan.get("daemons_per_host") or 0) if measured.epoch == state.epoch else 0
        if sharing > 1:
            ran = len(state.plan.get("members") or ()) or sharing
            who = f"all {ran} daemons" if ran == sharing else f"{sharing} of the {ran} daemons"
            slowed = [f for f in state.plan.get("stage_slowed") or () if isinstance(f, (int, float))]
            notes.append(f"{who} that ran epoch {measured.epoch} shared one machine, its cores and memory bandwidth "
                         "(a local ring): the prediction counts its cores"
                         + (f" (compute up to {max(slowed):.2g}x slower than calibrated)" if slowed and max(slowed) > 1
                            else "") + " and a calibration measured with them busy, not the daemons and etcd "
                         "running beside the workers")
    _write_json(out / "report.json", doc)
    (out / "report.txt").write_text(format_report(doc))
    return doc


def _kinds_from(calibrations: Mapping[str, bytes]) -> dict[str, int]:
    """Without the plan's device mix (an older leader), one calibrated kind is the best guess."""
    return {next(iter(calibrations)): 1} if len(calibrations) == 1 else {}


def _which_step(meas: dict[str, Any]) -> str:
    """Which step was compared with the prediction: the median of the steady-state steps, or the
    one step there was."""
    over = meas.get("median_of") or []
    if len(over) > 1:
        return (f"step {meas['step']} of epoch {meas['epoch']}, the median of its steady-state steps "
                f"{', '.join(map(str, over))}")
    return f"step {meas['step']} of epoch {meas['epoch']}"


def format_report(doc: dict[str, Any]) -> str:
    """report.txt: the summary varunactl prints."""
    lines = [f"job      {doc['job']}: {doc['state']} ({doc['reason']})",
             f"run      {doc['steps']} steps x batch {doc['batch_size']} as {' -> '.join(doc['shapes']) or '-'}"]
    ran = [r for r in doc.get("runs", ()) if r["first_step"] is not None]
    if ran:
        lines.append("plans    " + "; ".join(
            f"{r['shape']}: steps {r['first_step']}-{r['last_step']}"
            + ("" if r["samples_per_s"] is None else f", {r['samples_per_s']:.3g} samples/s") for r in ran))
    meas, pred = doc["measured"], doc["predicted"]
    if meas:
        lines.append(f"step     measured {meas['step_s']:.4f} s ({_which_step(meas)}, "
                     f"{plural(meas['workers'], 'worker')}{'' if meas['warm'] else ', includes warm-up'})")
    if pred:
        err = f", {100 * pred['error']:+.1f}% vs measured" if "error" in pred else ""
        lines.append(f"         predicted {pred['step_s']:.4f} s by the simulator{err}")
    # the same explanation as `varunactl status JOB`
    lines += [ln.replace("why      ", "plan     ", 1) for ln in plan_lines(doc.get("plan") or {})]
    lines += memory_lines(doc.get("memory") or [])
    speeds = doc.get("speeds") or {}
    lines += speed_lines(speeds.get("paces") or {}, speeds.get("stragglers") or {})
    lines += cost_lines(doc["cost"])
    lines.append("files    " + ", ".join(doc["files"]))
    lines += [f"note     {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


async def write_end_of_job_report(store: Store, keys: Keys, job: str, store_dir: str, *,
                                  timeout: float) -> None:
    """The leader's end-of-job report data into ``<store_dir>/report``. Never raises: a report is a
    by-product, and its failure is logged, not passed on to the job or the leader."""
    if "://" in store_dir:
        log.info("report: %s is in an object store (%s); run `varunactl report %s` for its report", job, store_dir,
                 job)
        return
    try:
        await asyncio.sleep(_HISTORY_GRACE_S)
        inputs = await asyncio.wait_for(collect(store, keys, job, store_dir=store_dir), 4 * timeout)
        out = os.path.join(store_dir, "report")
        # Reading every trace file and replaying the plan is CPU work on private data (no daemon
        # state is touched): a worker thread keeps it off the event loop so heartbeats and the
        # next job's planning never wait for it.
        doc = await asyncio.to_thread(build_report, inputs, out, load_prices())
        log.info("report: wrote the report data of %s to %s (`varunactl report --from %s` draws it)%s", job,
                 out, out, "".join(f"\n  note: {n}" for n in doc["notes"]))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the job's outcome stands
        log.warning("report: could not write the report of %s: %s", job, exc)
