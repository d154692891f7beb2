"""Device time and what it cost: the arithmetic behind cost.json and report.txt's cost lines.

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from varunad.control.jobs import JobState
from varunad.control.records import stall_before, steps_trained_twice
from varunad.report.prices import DevicePrice, price_of

__all__ = ["Interval", "run_intervals", "morph_losses", "cost_report", "cost_lines", "plural", "restarts_text"]


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
    redone = steps_trained_twice(epoch_steps)
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


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def restarts_text(n: int) -> str:
    return f", {plural(n, 'restart')} after a worker failed" if n else ""


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def cost_lines(cost: dict[str, Any]) -> list[str]:
    """report.txt's cost: a row per device kind, then the totals, samples per dollar and morphs."""
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
        "morphs   none" if not m["count"] and not m.get("restarts") else
        f"morphs   {m['count'] or 'none'}{restarts_text(m.get('restarts', 0))}: "
        f"{m['lost_s']:.1f} s lost ({100 * m['lost_fraction']:.1f}% of the run: "
        f"{m['downtime_s']:.1f} s stalled + {plural(m['redone_steps'], 'redone step')})",
    ]
    lines += _saving_lines(cost)
    return lines


def _saving_lines(cost: dict[str, Any]) -> list[str]:
    """What spot saved against dedicated on-demand VMs, only when there is something to compare:
    steps trained, both prices known, and a difference that shows at one decimal ("1.0x cheaper"
    says nothing)."""
    factor, dedicated = cost["spot_saving_factor"], cost["on_demand_without_morphs_usd"]
    if not factor or not cost["samples"] or round(factor, 1) == 1.0:
        return []
    if factor > 1:
        return [f"saving   the same work on dedicated on-demand VMs (no morphs) would cost {_usd(dedicated)}: "
                f"spot is {factor:.1f}x cheaper"]
    m = cost["morphs"]
    # what lost the time, in the words of the "morphs" line above it (a failed job's restart is no morph)
    lost = {(True, False): "the morphs", (False, True): "the restarts",
            (True, True): "the morphs and restarts"}.get((bool(m["count"]), bool(m.get("restarts"))))
    why = f"{lost} lost more than spot's price saved" if lost else "spot's price is not below on-demand's here"
    return [f"saving   none: the same work on dedicated on-demand VMs (no morphs) would cost {_usd(dedicated)}, "
            f"{1 / factor:.1f}x less than at spot ({_usd(cost['spot_usd'])}): {why}"]
