"""A job's status as the fleet's etcd documents tell it: state, steps, loss history, epochs and
morphs, the queue, and the lines that say why a plan has its shape.

Both varunactl (status, progress) and the leader's end-of-job report (varunad.report) read it,
so it lives below both.
"""

from __future__ import annotations

import time
from typing import Any

from varunad.control.fleet import read_newest, read_progress, usable_spec
from varunad.control.jobs import JobSpec, JobSpecError, JobState
from varunad.control.records import (
    Progress,
    WorkerReport,
    decode_history,
    epoch_ranges,
    merge_history,
    merge_spans,
    steps_trained_twice,
)
from varunad.store import schemas
from varunad.store.contract import Store, StoreError
from varunad.store.keys import Keys

__all__ = ["memory_lines", "stage_memory", "elapsed",
           "UnknownJob", "read_state", "job_status", "job_queue", "plan_lines", "activity"]


_LIVE = ("running", "morphing")   # states in which a job's workers may be running


class UnknownJob(ValueError):
    """No job by that name was submitted (varunactl prints it as its one-line refusal)."""


async def read_state(store: Store, keys: Keys, job: str) -> JobState | None:
    """The job's newest state, None before the leader wrote one."""
    state, _ = await read_newest(store, keys.state(job), JobState.decode, "state", timeout=None)
    return state


async def _notes(store: Store, keys: Keys, job: str) -> list[str]:
    """What the daemons noted about the job's workers (checkpoints they refused, a learning-rate schedule a
    resume started over: varunad.node.log_shipper), oldest first."""
    out: list[str] = []
    for kv in await store.get_prefix(keys.notes_of(job)):
        try:
            notes = schemas.load_json(kv.value)
            out += [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []
        except ValueError:
            continue
    return out


async def _store_failing(store: Store, keys: Keys, job: str, epoch: int) -> str | None:
    """"checkpoints failing since step N: <reason>" while the checkpoint store refuses the writes
    of a worker of the job's current epoch (the earliest outage among them), else None."""
    failing = []
    for kv in await store.get_prefix(keys.workers):
        try:
            record = WorkerReport.decode(kv.value).store_failing(job, epoch)
        except ValueError:
            continue
        if record is not None:
            failing.append(record)
    first = min(failing, key=lambda w: w.store_failing_since, default=None)
    return first.store_failing if first is not None else None


async def job_status(store: Store, keys: Keys, job: str) -> dict[str, Any]:
    """One job as `varunactl status JOB` and the end-of-job report show it (UnknownJob if none)."""
    spec_kv = await store.get(keys.job(job))
    if spec_kv is None:
        raise UnknownJob(f"no job named {job} (see `varunactl jobs`)")
    state = await read_state(store, keys, job) or JobState(job=job)
    try:   # the spec the fleet runs: as submitted, whatever was written over it since
        total = (await usable_spec(store, spec_kv, job, timeout=None))[0].steps
    except (JobSpecError, StoreError):
        total = None
    per_epoch: dict[int, dict[int, float]] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    for kv in await store.get_prefix(keys.history_of(job)):
        try:
            epoch, _member = keys.parse_history(job, kv.key)
            pairs, span = decode_history(kv.value)
        except ValueError:
            continue
        # a step past the job's last is no worker's (a hand's record of step 1e9 was shown as the step)
        per_epoch.setdefault(epoch, {}).update((s, loss) for s, loss in pairs if total is None or s < total)
        if span is not None:
            spans.setdefault(epoch, []).append(span)
    history = merge_history({e: list(v.items()) for e, v in per_epoch.items()})
    # only the ranks the epoch's plan has: a record of another (a hand's, garbage) is no step of it
    shape = state.plan or {}
    world = shape.get("P", 0) * shape.get("D", 0) if all(type(shape.get(k)) is int for k in "PD") else None
    current = [p for p in await read_progress(store, keys, job, world=world, steps=total) if p.epoch == state.epoch]
    # a live member key is a daemon whose lease holds: none, and nothing trains, whatever the state says
    daemons = len(await store.get_prefix(keys.members)) if state.state in _LIVE else None
    # the progress records outlive a fleet lost at once: their rates are the dead workers' last, not now's
    rates = current if daemons != 0 else []
    now = [s + 1 for s in per_epoch.get(state.epoch, {})] + [p.step + 1 for p in current]
    # where the running epoch is, once it has reported: after a resume from an older checkpoint
    # it redoes steps an earlier epoch had reached, and says so rather than the highest step
    step = max(now or [s + 1 for s, _ in history] or [0])
    if state.state == "done" and total is not None:   # done means every step was trained
        step = max(step, total)
    plan = state.plan or {}
    moves = [m for m in state.morphs if not m.restart]   # a restart of the same plan is not a morph
    last = moves[-1] if moves else None
    ranges = epoch_ranges({e: list(v.items()) for e, v in per_epoch.items()})
    redoing = None
    if state.epoch in ranges and state.morphs:
        first, newest = ranges[state.epoch]
        reached = max((b for e, (_, b) in ranges.items() if e < state.epoch), default=-1)
        if newest < reached:   # this epoch resumed from an older checkpoint and is not past it yet
            m = state.morphs[-1]
            redoing = {"first": first, "last": reached, "cause": m.cause or m.reason.split(":", 1)[0]}
    reason = state.reason
    if state.state == "queued" and reason == "submitted":
        reason = next((j["reason"] for j in await job_queue(store, keys) if j["job"] == job), reason)
    # minutes of the same words read as stuck (a probe's loaded host calibrated for 5.5 min): how long the
    # job has calibrated so far (its device kinds together), while its reason says it calibrates
    # (calibration_ended is only set when the job first runs)
    calibrating = (time.time() - state.calibration_started if state.state == "queued" and state.calibration_started
                   and not state.calibration_ended and reason.startswith("calibrating") else None)
    return {
        # `step`: steps done, which is the index (model.iteration) of the next step to train; the loss
        # history and the plots are indexed by step, so `loss` is that of step `step - 1`
        "job": job, "state": state.state, "reason": reason, "step": step, "steps": total, "epoch": state.epoch,
        "calibrating_s": calibrating,
        "activity": activity(state.state, state.change),
        "plan": {"P": plan.get("P"), "D": plan.get("D"), "micro_batch_size": plan.get("micro_batch_size"),
                 "schedule": plan.get("schedule"), "members": plan.get("members", []),
                 "estimated_s": plan.get("estimated_s"), "calibrated": plan.get("calibrated"),
                 "micro_batches": plan.get("micro_batches"), "shares": plan.get("shares"),
                 "alternatives": plan.get("alternatives", []),
                 "ruled_out": plan.get("ruled_out", [])},
        "redoing": redoing,
        "loss": dict(history).get(step - 1, history[-1][1]) if history else None,
        "samples_per_s": sum(p.samples_per_s for p in rates) / len(rates) if rates else None,
        "busy_fraction": min((p.busy_fraction for p in rates), default=None),
        "stages": stage_memory(plan, current),
        "restarts": state.restarts, "error": state.error,
        "store_failing": await _store_failing(store, keys, job, state.epoch) if state.state in _LIVE else None,
        "daemons": daemons,
        # slot -> how many times slower than the fastest of its kind it computes; the stragglers
        # among them are the slots the plan works around (varunad.control.speeds)
        "paces": dict(state.paces), "stragglers": dict(state.stragglers),
        "warnings": await _notes(store, keys, job),
        "epochs": {str(e): list(r) for e, r in sorted(ranges.items())},
        "steps_trained_twice": steps_trained_twice(ranges),
        "epoch_spans": {str(e): list(merge_spans(v)) for e, v in sorted(spans.items())},
        "morphs": [{"reason": m.reason, "from": m.from_shape, "to": m.to_shape, "from_epoch": m.from_epoch,
                    "to_epoch": m.to_epoch, "noticed_at": m.noticed_at, "stopped_at": m.stopped_at,
                    "planned_at": m.planned_at, "duration_s": round(m.duration_s, 3), "checkpoint": m.checkpoint,
                    "restart": m.restart, "cause": m.cause, "source": m.source, "resumed_from": m.resumed_from,
                    "source_why": m.source_why}
                   for m in state.morphs],
        "last_morph": None if last is None else f"{last.from_shape} -> {last.to_shape} because {last.reason}",
        "loss_history": [[s, v] for s, v in history],
        # a job resumed from another's store starts past 0: those steps were never this job's
        "unrecorded": unrecorded(history, min((a for a, _ in ranges.values()), default=0),
                                 total if state.state == "done" else ranges.get(state.epoch, (None,))[0]),
    }


def unrecorded(history: list[tuple[int, float]], start: int, until: int | None) -> list[list[int]]:
    """[first, last] of each run of steps from `start` to before `until` with no loss in the
    (sorted) history: trained, but the daemon holding their losses was lost before it wrote them
    (the checkpoint after them came first, so nobody trained them again)."""
    if not until:
        return []
    gaps, expected = [], start
    for step, _ in history:
        if step >= until:
            break
        if step > expected:
            gaps.append([expected, step - 1])
        expected = max(expected, step + 1)
    if expected < until:
        gaps.append([expected, until - 1])
    return gaps


async def job_queue(store: Store, keys: Keys) -> list[dict[str, Any]]:
    """Every submitted job in submission order, with its state and what a queued one waits for."""
    states = {}
    for kv in await store.get_prefix(keys.states):
        try:
            states[keys.state_job(kv.key)] = JobState.decode(kv.value)
        except (ValueError, JobSpecError):
            continue
    out = []
    for kv in sorted(await store.get_prefix(keys.jobs), key=lambda kv: kv.create_revision):
        try:
            job = keys.job_id(kv.key)
        except ValueError:
            continue
        st = states.get(job)
        try:
            spec = JobSpec.decode(kv.value)
            what = f"{spec.script} batch {spec.batch_size} steps {spec.steps}"
        except JobSpecError as exc:
            what = f"invalid spec: {exc}"
        out.append({"job": job, "state": st.state if st else "queued", "epoch": st.epoch if st else 0,
                    "activity": activity(st.state, st.change) if st else "queued",
                    "reason": st.reason if st else "submitted", "spec": what})
    # the fleet runs one job at a time: say what a job that was only submitted waits for
    running = [j["job"] for j in out if j["state"] in ("running", "morphing")]
    ahead: list[str] = []
    for j in out:
        if j["state"] != "queued":
            continue
        if j["reason"] == "submitted" and running:
            j["reason"] = f"waiting for {running[0]}" + (f" and {len(ahead)} job(s) queued before it"
                                                          if ahead else "")
        elif j["reason"] == "submitted" and ahead:
            # the first queued job is the one the leader plans (it may be calibrating, or
            # waiting for a plan); the rest wait behind it
            j["reason"] = f"waiting behind {ahead[0]}, queued first" + (
                f" ({len(ahead) - 1} more before it)" if len(ahead) > 1 else "")
        ahead.append(j["job"])
    return out


def stage_memory(plan: dict[str, Any], current: list[Progress]) -> list[dict[str, Any]]:
    """Per stage: the planner's memory estimate, the usable memory of its slot (`capacity`) and
    the highest peak its workers measured in the running epoch (None until one reports)."""
    estimates, capacity, ranks = plan.get("stage_memory") or [], plan.get("stage_capacity") or [], plan.get("ranks")
    if not estimates or not isinstance(ranks, list) or len(ranks) != len(estimates):
        return []
    peaks = {p.rank: p.peak_bytes for p in current if p.peak_bytes}
    out = []
    for s, est in enumerate(estimates):
        measured = [peaks[r] for r in ranks[s] if r in peaks]
        out.append({"stage": s, "estimate": est, "capacity": capacity[s] if s < len(capacity) else None,
                    "peak": max(measured) if measured else None})
    return out


def memory_lines(stages: list[dict[str, Any]]) -> list[str]:
    """`varunactl status JOB` and the report: each stage's estimate beside its measured peak."""
    mb = lambda x: "-" if x is None else f"{x / 1e6:.0f} MB"  # noqa: E731
    return [f"memory    stage {st['stage']}: estimate {mb(st['estimate'])}, measured peak {mb(st['peak'])}"
            f", usable {mb(st['capacity'])}" + (" (over)" if st["peak"] and st["capacity"]
                                               and st["peak"] > st["capacity"] else "")
            for st in stages]


def speed_lines(paces: dict[str, float], stragglers: dict[str, float]) -> list[str]:
    """`varunactl status JOB` and the report: the stragglers, then each slot's measured speed."""
    lines = [f"straggler {slot}: computes {factor:.1f}x slower than the fastest slot of its kind"
             + ("; planned around" + (", idle in this plan" if slot not in paces else ""))
             for slot, factor in sorted(stragglers.items(), key=lambda x: -x[1])]
    if paces:
        lines.append("speed     " + ", ".join(f"{slot} {pace:.2f}x" for slot, pace in
                                              sorted(paces.items(), key=lambda x: (-x[1], x[0]))[:12])
                     + " (compute per micro-batch over its kind's fastest)")
    return lines


def activity(state: str, change: str) -> str:
    """The word `varunactl status` and `watch` show for a job: its state, except that a job the
    store holds as "morphing" is "restarting" (the same plan again), "stopping" (a worker failed
    and the leader does not know yet whether a VM went with it) or "morphing" (a new plan). A
    restart is never called a morph, nor a morph a restart."""
    if state != "morphing":
        return state
    return {"restart": "restarting", "stopping": "stopping"}.get(change, "morphing")


def _secs(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.1 else f"{1000 * x:.2f} ms"


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """Why this P x D: its estimate, the next alternatives with theirs, what ruled out the obvious."""
    if not plan.get("P"):
        return []
    m = plan.get("micro_batches")
    est = plan.get("estimated_s")
    lines = [f"why       {plan['P']}x{plan['D']}, micro-batch {plan['micro_batch_size']}"
             + (f" x {'up to ' if plan.get('shares') else ''}{m} per replica" if m else "")
             + (f", schedule {plan['schedule']}" if plan.get("schedule") and plan["P"] > 1 else "")
             + (f": estimated {_secs(est)} per step" if est is not None else "")
             + ("" if plan.get("calibrated", True) else " (no measured calibration: data-parallel only)")]
    if plan.get("shares"):
        lines.append(f"  shares  replicas take {', '.join(map(str, plan['shares']))} examples of each step's "
                     f"{sum(plan['shares'])}: sized for their measured speeds")
    for alt in plan.get("alternatives") or []:
        lines.append(f"  instead {alt['P']}x{alt['D']}, micro-batch {alt['micro_batch_size']} x "
                     f"{alt['micro_batches']}: estimated {_secs(alt['estimated_s'])}")
    lines += [f"  not     {why}" for why in plan.get("ruled_out") or []]
    return lines


def elapsed(seconds: float) -> str:
    """'45s', '5m30s': a wait as a person reads it."""
    whole = max(0, int(seconds))
    return f"{whole}s" if whole < 60 else f"{whole // 60}m{whole % 60:02d}s"
