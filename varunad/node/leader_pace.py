"""The leader's view of how fast each slot of the running job computes, and the re-plan around a
straggler (`varunad.control.speeds` has the measurements and the rules).

`LeaderPace` is a part of `varunad.node.leader.Leader`. Every progress interval
(``varunad.control.records.progress_interval``) while a job runs, it reads the ranks' progress,
measures each slot against what the plan expected of its stage, and records the paces and
stragglers in the job's state (``status`` shows them). When a slot is slower than the running
plan assumed (a new straggler, or one slower than planned), it plans again; the job morphs
(after a checkpoint, like a scale-up) only when the new plan is estimated faster, by more than ``scale_up_threshold``, than the running plan at the measured
speeds. A straggler the running plan gives a smaller share of the batch is still measured against
its stage's healthy replicas, and when it is one no longer the leader plans again the same way: a
slot that lagged for a while must not keep a small share for the rest of a long job. Against flapping, besides the
hysteresis of `SlotSpeeds`: a straggler the plan left idle is not measured, so its recovery (or
its forgetting) never morphs the job by itself, the next plan made for any reason uses it again;
and a morph around a straggler is at least ``QUIET_S`` after the previous one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from trainer.planning.planner import PlanError
from varunad.control.decide import Decision, LeaderMemory
from varunad.control.fleet import FleetSnapshot, read_progress
from varunad.control.jobs import JobState
from varunad.control.plans import PlanDoc
from varunad.control.records import progress_interval
from varunad.control.speeds import Expected, SlotSpeeds

__all__ = ["LeaderPace", "expected_of", "speeds_moved"]

log = logging.getLogger("varunad.node.leader")   # the leader's log, one logger name for all its lines

PACES_EVERY = 5.0   # seconds between writes of the paces alone to the job's state
QUIET_S = 60.0   # the least time between two morphs around stragglers: speeds that swing must not keep a job morphing


def expected_of(plan: PlanDoc, facts: dict, snap: FleetSnapshot) -> dict[int, Expected]:
    """rank -> what the plan expects of it, from the run plan and the facts the leader recorded
    with it (``stage_compute_s``); empty for a plan whose facts lack them (an older leader's)."""
    compute = facts.get("stage_compute_s")
    if plan.plan is None or not isinstance(compute, list):
        return {}
    where = plan.plan.positions()
    machines = Counter(snap.members[s.member][0].machine_key for s in plan.slots if s.member in snap.members)
    # Other daemons on the machine count too, planned or not: their spares import and their
    # calibrations run on its cores, and a plan moved onto one of them computes no faster (a 1x1
    # job on `varunactl up 2` was moved from one daemon to the other and back as a straggler).
    daemons = Counter(m.machine_key for m, _ in snap.members.values())
    out = {}
    for s in plan.slots:
        stage = where[s.rank][0]
        member = snap.members.get(s.member)
        if member is None or stage >= len(compute) or not isinstance(compute[stage], (int, float)):
            continue
        out[s.rank] = Expected(f"{s.member}/{s.slot}", member[0].device_kind, float(compute[stage]), stage,
                               shared=max(machines[member[0].machine_key], daemons[member[0].machine_key]) > 1)
    return out


def _names(slowdowns: dict[str, float]) -> str:
    return ", ".join(f"{slot} ({factor:.1f}x slower)" for slot, factor in sorted(slowdowns.items()))


class LeaderPace:
    speeds: SlotSpeeds
    memory: LeaderMemory
    _next_pace: float = 0.0
    _pace_considered: tuple[int, tuple] | None = None
    _pace_adopted: bool = False
    _pacing: bool = False   # a job runs: the loop wakes for each measurement
    _quiet_until: float = 0.0   # no morph around a straggler before then (monotonic clock)
    _paces_due: float = 0.0

    def _slowdowns(self) -> dict[str, float]:
        return self.speeds.slowdowns()

    def _adopt_stragglers(self, state: JobState | None) -> None:
        """Once per leader: the stragglers its predecessor found for the job (its state), taken in
        before this leader's first plan of it, not after (a plan onto a known straggler was
        followed half a second later by a morph off it)."""
        if state is not None and not self._pace_adopted:
            self._pace_adopted = True
            self.speeds.adopt(state.stragglers, self.clock())

    async def _pace(self, snap: FleetSnapshot) -> bool:
        """Measure the running job's slots; True when it started a morph around a straggler."""
        plan = snap.plan
        now = self.clock()
        self._pacing = plan is not None and plan.kind == "run" and bool(plan.job)
        if not self._pacing or now < self._next_pace:
            return False
        self._next_pace = now + progress_interval(self.config.progress_interval, plan.plan.world_size)
        state = snap.states.get(plan.job)
        if state is None or state.epoch != snap.plan_epoch or state.state != "running":
            return False
        self._adopt_stragglers(state)
        entry = snap.entry(plan.job)
        progress = await read_progress(self.store, self.keys, plan.job, timeout=self.t, world=plan.plan.world_size,
                                       steps=entry.spec.steps if entry is not None and entry.spec is not None else None)
        # the epoch's newest step: an epoch that stops stepping is stuck (varunad.control.stall)
        self.memory.steps.see(snap.plan_epoch, max((p.step for p in progress if p.epoch == snap.plan_epoch),
                                                   default=-1), now)
        expected = expected_of(plan, state.plan, snap)
        if not expected:
            return False
        changed = self.speeds.observe(snap.plan_epoch, expected, progress, now, calibrated=plan.calibrated)
        paces, stragglers = dict(self.speeds.paces), dict(self.speeds.stragglers)
        self.metrics.slot_paces(paces, stragglers)
        if changed:
            if stragglers:
                log.warning("leader: %s: stragglers: %s", plan.job, _names(stragglers))
            else:
                log.info("leader: %s: no straggler any more", plan.job)
        # the job's state is a document of its own history: rewritten for a new straggler at once,
        # for paces that moved at most every PACES_EVERY seconds
        if set(state.stragglers) != set(stragglers) or (_moved(state.paces, paces) and now >= self._paces_due):
            self._paces_due = now + PACES_EVERY
            state = state.but(paces=paces, stragglers=stragglers)
            await self._put_state(state)
        wanted = self._slowdowns()
        assumed = state.plan.get("slowdowns") or {}
        key = (snap.plan_epoch, tuple(sorted(wanted.items())))
        judged = _judged(expected.values(), assumed)
        if not speeds_moved(wanted, assumed, judged) or key == self._pace_considered or now < self._quiet_until:
            return False
        self._pace_considered = key
        morphed = await self._replan_for_speed(snap, state, wanted, assumed, judged)
        if morphed:
            self._quiet_until = self.clock() + QUIET_S
        return morphed

    async def _replan_for_speed(self, snap: FleetSnapshot, state: JobState, wanted: dict[str, float],
                                assumed: dict[str, float], judged: set[str]) -> bool:
        plan = snap.plan
        entry = snap.entry(state.job)
        if plan is None or entry is None or entry.spec is None:
            return False
        try:
            doc = await self._plan_now(snap, entry.spec, reason="", memory_scale=state.memory_scale)
        except PlanError as exc:
            log.info("leader: no plan around the stragglers of %s: %s", state.job, exc)
            return False
        if doc is None:
            return False
        # the running plan at the measured speeds: its slowest slot sets the pace of every step
        used = [f"{s.member}/{s.slot}" for s in plan.slots]
        worst = max([wanted.get(slot, 1.0) / assumed.get(slot, 1.0) for slot in used] + [1.0])
        current = plan.estimated_s * worst
        gain = (current - doc.estimated_s) / current if current > 0 else 0.0
        if (doc.plan, _placement(doc)) == (plan.plan, _placement(plan)) or gain <= self.config.scale_up_threshold:
            log.info("leader: keeping %s as %s: planning around %s would gain %.1f%% (threshold %.1f%%)",
                     state.job, plan.shape, _names(wanted) or "no straggler", 100 * gain,
                     100 * self.config.scale_up_threshold)
            return False
        measured = self.speeds.stragglers
        slow = [f"{slot} computes {measured.get(slot, factor):.1f}x slower"
                for slot, factor in sorted(wanted.items())]
        why = ", ".join(slow) + " than the fastest slot of its kind" if slow else ""
        back = [slot for slot in sorted(assumed) if slot in judged and slot not in wanted]
        if back:
            why += ("; " if why else "") + ", ".join(back) + " computes at full speed again"
        reason = (f"{why}: {doc.shape} on {', '.join(doc.members)} is estimated {100 * gain:.0f}% faster than "
                  f"{plan.shape} at the measured speeds; checkpointing, then re-planning")
        return await self._abort(snap, Decision("abort", reason, state.job, checkpoint=True))


def speeds_moved(wanted: dict[str, float], assumed: dict[str, float], judged: set[str]) -> bool:
    """Whether the measured slowdowns (``wanted``, slot -> factor) call for planning again against
    those the running plan assumed: a slot slower than planned, or a slot of ``judged`` that was
    planned slow (a smaller share of the batch) and is a straggler no longer. An idle straggler
    is not measured, so its recovery waits for the next plan made for another reason."""
    worse = any(factor > assumed.get(slot, 1.0) for slot, factor in wanted.items())
    recovered = any(factor > wanted.get(slot, 1.0) for slot, factor in assumed.items() if slot in judged)
    return worse or recovered


def _judged(expected: Iterable[Expected], assumed: dict[str, float]) -> set[str]:
    """The slots of the plan whose speed is measured against a replica of their stage that the
    plan did not take to be slow: only their recovery is one (two stragglers of one stage, each
    the other's reference, measure alike and would look recovered, and the job would morph back
    and forth)."""
    rows = list(expected)
    return {e.slot for e in rows
            if any(o.stage == e.stage and o.slot != e.slot and o.slot not in assumed for o in rows)}


def _placement(doc: PlanDoc) -> tuple[tuple[int, str, int], ...]:
    return tuple(sorted((s.rank, s.member, s.slot) for s in doc.slots))


def _moved(before: dict[str, float], now: dict[str, float]) -> bool:
    """Whether the recorded paces are worth writing again: a slot came or went, or one moved by 10%."""
    if set(before) != set(now):
        return True
    return any(abs(now[k] - before[k]) > 0.1 * max(before[k], 1e-9) for k in now)
