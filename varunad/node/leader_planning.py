"""The leader's planning: a job's first plan, the plan after a morph or restart, a calibration
run when a device kind has no calibration, and whether a re-plan onto new members is worth a morph.

`LeaderPlanning` is a part of `varunad.node.leader.Leader`: it plans with the members that
answer a ping (`varunad.node.peers.SilentMembers`) and the calibrations and links etcd holds
(`varunad.control.plans.make_plan`), writes the plan through the election (the only writer,
[Note: epochs fence everything]) and the job's state through the leader's `_put_state`, and
pushes PlanChanged to the plan's members.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from protocol.messages import PlanChanged
from trainer.planning.calibration import Calibration
from trainer.planning.planner import ModelTooLarge, Plan, PlanError
from varunad.control.decide import Decision, calibration_failed, still_warming
from varunad.control.failures import is_signalled
from varunad.control.fleet import FleetSnapshot, forget_progress, read_fleet
from varunad.control.jobs import JobSpec, JobState, MorphEvent, job_store, script_fingerprint
from varunad.control.links import PROBE_TIMEOUT, apply_links
from varunad.control.plans import (
    PlanDoc,
    calibrations_for,
    describe,
    described_shape,
    machine_slots,
    make_plan,
    profile_slots,
    uniform_calibration,
)
from varunad.control.speeds import base_kind
from varunad.store.contract import StoreError

__all__ = ["LeaderPlanning"]

log = logging.getLogger("varunad.node.leader")   # the leader's log, one logger name for all its lines


def _report_facts(doc: PlanDoc, planned: Plan, snap: FleetSnapshot, slowdowns: dict[str, float]) -> dict:
    """What the end-of-job report needs beyond ``describe`` (which has the per-stage recompute
    flags): devices per kind (to price the run) and the planner's other per-stage choices (to
    replay its prediction in the simulator)."""
    kinds = Counter(snap.members[s.member][0].device_kind for s in doc.slots)
    stage_kinds = [base_kind(st.device_kind) for st in planned.stages]   # a straggler's own kind -> its kind
    return {"device_kinds": dict(kinds), "stage_kinds": [kind for kind, _ in stage_kinds],
            # what each stage's compute per micro-batch should take at its kind's full speed (the
            # leader measures each slot against it)
            "stage_compute_s": [st.compute_s / factor for st, (_, factor) in zip(planned.stages, stage_kinds)],
            "slowdowns": dict(slowdowns),   # the stragglers planned for (slot -> slowdown)
            # per stage, how many times slower than its kind's calibration the plan has it compute
            # (a straggler, cores shared with other workers): the report replays the same
            "stage_slowed": [factor * (planned.contention[s] if planned.contention else 1.0)
                             for s, (_, factor) in enumerate(stage_kinds)],
            "link_kinds": list(planned.link_kinds),
            "allreduce_kinds": list(planned.allreduce_kinds), "micro_batches": planned.micro_batches,
            # why this plan (varunactl status JOB and the report say it): the runners-up and their
            # estimates, and what ruled out the plans a user would try first
            "alternatives": [{"P": c.P, "D": c.D, "micro_batch_size": c.micro_batch_size,
                              "micro_batches": c.micro_batches,
                              "estimated_s": c.simulated_s if c.simulated_s is not None else c.estimate_s}
                             for c in planned.alternatives(3)],
            "ruled_out": list(planned.ruled_out),
            # each stage's memory as the planner bounded it and what its slot let it use: the
            # workers' measured peaks are shown beside them
            "stage_memory": [st.memory_bytes for st in planned.stages],
            "stage_capacity": [st.capacity_bytes for st in planned.stages],
            # daemons sharing a machine (a local ring) share its cores: the report says so beside its prediction
            "daemons_per_host": max(Counter(snap.members[m][0].machine_key for m in doc.members).values(),
                                    default=0)}


class LeaderPlanning:
    async def _calibrations(self, spec: JobSpec, kinds: list[str], *, quiet: bool = False
                            ) -> tuple[dict[str, Calibration], bool, list[str]]:
        """(calibrations, all measured?, kinds still missing). The one place that picks the fallback;
        ``quiet``: without saying so (a plan made ahead, which the real one follows)."""
        fp = script_fingerprint(spec)
        listing = await self.store.get_prefix(self.keys.calibration_of(fp), timeout=self.t)
        stored = {kv.key.rsplit("/", 1)[-1]: kv.value for kv in listing}
        found, missing = calibrations_for(spec, kinds, stored)
        if not missing:
            return found, True, []
        if self.config.calibrate == "profile" and fp not in self.memory.profile_failed:
            return found, False, missing
        if not quiet:
            log.warning("leader: no calibration of %s for %s; planning data-parallel from a synthetic one "
                        "(run with --calibrate profile to measure it)", spec.job, ", ".join(missing))
        cals = {k: uniform_calibration(spec, k) for k in kinds}
        return cals, False, []

    async def _plan_inputs(self, spec: JobSpec, members: list[tuple], *, quiet: bool = False
                           ) -> tuple[dict[str, Calibration], bool] | None:
        """The calibrations to plan ``spec`` on ``members`` with, their measured links applied, and
        whether all were measured; None while a device kind has no calibration."""
        cals, measured, missing = await self._calibrations(spec, sorted({m.device_kind for m, _ in members}),
                                                           quiet=quiet)
        if missing:
            return None
        return apply_links(cals, self.links.measured([m.name for m, _ in members])), measured

    def _plan_ahead(self, job: str, silent: frozenset[str] = frozenset()) -> None:
        """Plan the job's next epoch while the old workers stop (varunad.control.plans keeps the
        plan): `_start` plans again once they have, with what etcd and the pings say then, and
        finds it made when nothing changed meanwhile. At 300 VMs that is 0.15 s of a morph. The
        stop's wait plans ahead again when the members left change (`_replan_ahead`): a lease
        that ends, a member found silent."""
        if self._ahead is not None:
            self._ahead.cancel()
        self._ahead_for = (job, None)
        self._ahead = asyncio.get_running_loop().create_task(self._plan_in_advance(job, silent))

    def _left(self, snap: FleetSnapshot, silent: frozenset[str] | set[str]) -> list[tuple]:
        return [(m, lease) for m, lease in snap.usable()
                if m.name not in silent and not self.silent.known_silent(snap, m.name)]

    def _replan_ahead(self, snap: FleetSnapshot, silent: set[str]) -> None:
        """`snap`: the members (and reports) the stop's wait read."""
        if self._ahead is None or not self._ahead.done() or self._ahead_for is None:
            return
        job, planned_for = self._ahead_for
        if planned_for is not None and frozenset(m.name for m, _ in self._left(snap, silent)) != planned_for:
            self._plan_ahead(job, frozenset(silent))

    async def _plan_in_advance(self, job: str, silent: frozenset[str]) -> None:
        try:
            snap = await read_fleet(self.store, self.keys, timeout=self.t)
            members = self._left(snap, silent)
            self._ahead_for = (job, frozenset(m.name for m, _ in members))
            entry, state = snap.entry(job), snap.states.get(job) or JobState(job=job)
            if entry is None or entry.spec is None or not members:
                return
            inputs = await self._plan_inputs(entry.spec, members, quiet=True)
            if inputs is None:
                return
            cals, measured = inputs
            await asyncio.to_thread(make_plan, entry.spec, members, cals, calibrated=measured, reason="",
                                    memory_scale=state.memory_scale, slowdowns=self._slowdowns())
        except (StoreError, PlanError, ValueError) as exc:
            log.debug("leader: no plan ahead for %s: %s", job, exc)
        except Exception:   # a bug here must not touch the morph: `_start` plans all the same
            log.exception("leader: planning %s ahead failed", job)

    async def _planned_ahead(self) -> None:
        """Until the plan made ahead is done (bounded): planning the same twice at once helps nobody."""
        ahead, self._ahead, self._ahead_for = self._ahead, None, None
        if ahead is not None and not ahead.done():
            await asyncio.wait({ahead}, timeout=2 * self.t)

    async def _candidates(self, snap: FleetSnapshot) -> list[tuple]:
        usable = snap.usable()
        answered = await self.silent.answering(snap, [m.name for m, _ in usable], mark=False)
        for m, _ in usable:
            if m.name not in answered:
                log.warning("leader: %s did not answer a ping; planning without it", m.name)
        return [(m, lease) for m, lease in usable if m.name in answered]

    def _waits_for_links(self, job: str, state: JobState, names: list[str]) -> bool:
        """Whether the job's first plan waits for the probes in flight among `names` (each ends
        within PROBE_TIMEOUT, at once when it fails): first the links, then a calibration run,
        neither disturbing the other. The survey starts more while the job waits, so the wait as
        a whole is bounded too, by PROBE_TIMEOUT: a big fleet's sample (450 pairs at 300 VMs)
        would hold the job for as many probes. A job that ran already (a morph, a restart) never
        waits: it plans with what is measured."""
        since = self.memory.links_since.setdefault(job, self.clock())
        waiting = self.links.waiting(names) if not state.epochs and self.clock() - since < PROBE_TIMEOUT else []
        if not waiting:
            return False
        why = "waiting for the link measurement " + ", ".join(f"{a} <-> {b}" for a, b in waiting)
        if self.memory.waiting.get(job) != why:
            self.memory.waiting[job] = why
            log.info("leader: %s is %s", job, why)
        return True

    async def _start(self, job: str, reason: str) -> bool:
        snap = await read_fleet(self.store, self.keys, timeout=self.t)
        entry = snap.entry(job)
        if entry is None or entry.spec is None:
            return False
        spec = entry.spec
        state = snap.states.get(job) or JobState(job=job)
        if snap.plan is not None and snap.plan.kind == "profile" and snap.plan.job == job:
            report = snap.reports.get(snap.plan.profile_member or "")
            rec = report.of(job, snap.plan_epoch).get(0) if report else None
            if rec is not None and rec.outcome == "failed" and is_signalled(rec.error) \
                    and state.restarts < self.config.max_restarts:
                # a signal from outside (a kill -9), not the script: calibrate again, as a training
                # worker so ended is started again, counted against --max-restarts
                state = state.but(restarts=state.restarts + 1, error=rec.error)
                await self._put_state(state)
                log.warning("leader: the calibration run of %s on %s was killed by a signal: calibrating again "
                            "(restart %d of at most %d)", job, snap.plan.profile_member, state.restarts,
                            self.config.max_restarts)
            elif rec is not None and rec.outcome == "failed":
                # the job's own script ended it, as it would end every worker: fail now, in its words
                await self._finish(snap, job, "failed", calibration_failed(job, snap.plan.profile_member or "",
                                                                           rec.error), error=rec.error)
                return True
            if rec is not None and rec.outcome == "killed":
                log.warning("leader: the calibration run of %s was killed; planning without a measured calibration",
                            job)
                self.memory.profile_failed.add(script_fingerprint(spec))
        # the link wait first, over the usable members: pinging every one of them each cycle of
        # the wait was a fifth of a 300-VM leader's CPU
        if self._waits_for_links(job, state, [m.name for m, _ in snap.usable()]):
            return False
        members = await self._candidates(snap)
        kinds = sorted({m.device_kind for m, _ in members})
        cals: dict[str, Calibration] = {}
        measured = False
        if members:
            names = [m.name for m, _ in members]
            cals, measured, missing = await self._calibrations(spec, kinds)
            if missing:
                return await self._profile(snap, spec, members, state, missing)
            cals = apply_links(cals, self.links.measured(names))
        try:
            if not members:
                raise PlanError("no member offers a usable slot that answers")
            slowdowns = self._slowdowns()
            await self._planned_ahead()
            doc, planned = make_plan(spec, members, cals, calibrated=measured, reason=reason,
                                     memory_scale=state.memory_scale, slowdowns=slowdowns)
        except ModelTooLarge as exc:
            if not state.epochs:
                # more slots of these kinds cannot help, and a job that waits blocks the queue
                # behind it for good: it fails, in numbers, and the user resubmits on bigger VMs
                await self._finish(snap, job, "failed", str(exc))   # its hint is in its words already
                return True
            return await self._no_plan(job, state, exc)
        except PlanError as exc:
            return await self._no_plan(job, state, exc)
        self.memory.waiting.pop(job, None)
        epoch = await self.election.write_plan(doc.encode())
        planned_at = time.time()
        # told at once, not after the state and the plan's explanation (long at 300 VMs) are written
        await self.clients.send_all([(name, snap.members[name][0].endpoint) for name in doc.members],
                                    PlanChanged(epoch=epoch))
        self.silent.clear()   # it served this morph; a later decision pings everyone afresh
        self.memory.epoch_seen[epoch] = self.clock()
        morphs = state.morphs
        info = self.memory.morph.pop(job, None)
        if info is not None or state.epochs:
            stopped = info or dict(reason=reason, from_epoch=state.epoch, noticed_at=planned_at, stopped_at=planned_at,
                                   checkpoint=False, from_shape=described_shape(state.plan or {}))
            morphs = morphs + (MorphEvent(**stopped, to_shape=doc.shape, to_epoch=epoch, planned_at=planned_at),)
            if not stopped.get("restart"):
                self.metrics.morphs.inc()
        # once running again, the state says where the job runs now and why it moved (the morph keeps
        # the whole sentence)
        now = reason
        if not state.epochs and reason.startswith("the calibration run on "):
            # "running (the calibration run on vm1 ended (done))" read as if that were the news
            now = f"running as {doc.shape} on {', '.join(doc.members)}, calibrated on {reason.split()[4]}"
        if info is not None and info.get("cause"):
            now = f"resumed as {doc.shape} on {', '.join(doc.members)} after {info['cause']}"
        elif info is None and state.epochs:   # a morph this leader did not stop (it took over mid-way)
            now = f"resumed as {doc.shape} on {', '.join(doc.members)}: {reason}"
        await self._put_state(state.but(state="running", change="", reason=now, epoch=epoch,
                                        epochs=state.epochs + (epoch,),
                                        plan={**describe(doc, epoch), **_report_facts(doc, planned, snap, slowdowns)},
                                        morphs=morphs[-50:], started_at=state.started_at or planned_at,
                                        store=job_store(spec, self.config.store),
                                        calibration_ended=state.calibration_ended or
                                        (planned_at if state.calibration_started else 0.0)))
        log.info("leader: %s epoch %d: %s on %s (estimated %.3fs per step)\n%s", job, epoch, doc.shape,
                 ", ".join(doc.members), doc.estimated_s, planned.explain())
        await forget_progress(self.store, self.keys, job, len(doc.slots), timeout=self.t)
        return True

    async def _no_plan(self, job: str, state: JobState, exc: PlanError) -> bool:
        """The job waits for a plan (more slots, more memory), saying why in its state."""
        why = f"waiting for a plan: {exc}" + "".join(
            f" (counting {100 * share:.0f}% of a {kind} slot's memory: a stage of this job ran out)"
            for kind, share in sorted(state.memory_scale.items()))
        if self.memory.waiting.get(job) != why:
            self.memory.waiting[job] = why
            await self._put_state(state.but(state="queued" if state.state == "queued" else "morphing",
                                            reason=why))
            log.info("leader: %s is %s", job, why)
        return False

    async def _profile(self, snap: FleetSnapshot, spec: JobSpec, members: list[tuple], state: JobState,
                       missing: list[str]) -> bool:
        member = next(m for m, _ in members if m.device_kind == missing[0])
        busy = profile_slots(member, machine_slots([m for m, _ in members]).get(member.machine_key, member.slots))
        doc = PlanDoc(kind="profile", job=spec.job, reason=f"calibrating {missing[0]} on {member.name}"
                      + (f" (then {busy} slots of its machine busy at once)" if busy else ""),
                      profile_member=member.name, incarnations={member.name: snap.members[member.name][1]},
                      profile_slots=busy)
        await self.election.write_plan(doc.encode())
        await self._put_state(state.but(reason=doc.reason,
                                        calibration_started=state.calibration_started or time.time()))
        return True

    async def _plan_now(self, snap: FleetSnapshot, spec: JobSpec, *, reason: str,
                        memory_scale: dict[str, float] | None) -> PlanDoc | None:
        """The plan the members that answer a ping would run ``spec`` as now, stragglers weighed
        (PlanError when none fits; None while a device kind has no calibration)."""
        members = await self._candidates(snap)
        inputs = await self._plan_inputs(spec, members)
        if inputs is None:
            return None
        cals, measured = inputs
        self._adopt_stragglers(snap.states.get(spec.job))
        doc, _ = make_plan(spec, members, cals, calibrated=measured, reason=reason, memory_scale=memory_scale,
                           slowdowns=self._slowdowns())
        return doc

    async def _consider(self, snap: FleetSnapshot, d: Decision) -> bool:
        assert d.job is not None and snap.plan is not None
        plan, epoch = snap.plan, snap.plan_epoch
        usable = frozenset((m.name, lease) for m, lease in snap.usable())
        self.memory.considered = (epoch, usable)
        entry = snap.entry(d.job)
        if entry is None or entry.spec is None:
            return False
        try:
            scales = snap.states[d.job].memory_scale if d.job in snap.states else None
            doc = await self._plan_now(snap, entry.spec, reason=d.reason, memory_scale=scales)
        except PlanError as exc:
            log.info("leader: no better plan for %s: %s", d.job, exc)
            return False
        if doc is None:
            return False
        current = plan.estimated_s
        gain = (current - doc.estimated_s) / current if current > 0 else 0.0
        same = (doc.shape, doc.members) == (plan.shape, plan.members)
        if same:   # the same plan, only estimated anew (a fresh calibration): nothing to morph to
            log.info("leader: keeping %s as %s on %s: the best plan now is the one it runs (estimated at %.3f s "
                     "per step now, %.3f s when it was made)", d.job, plan.shape, ", ".join(plan.members),
                     doc.estimated_s, current)
            return False
        if gain <= self.config.scale_up_threshold:
            log.info("leader: keeping %s as %s: re-planning onto %s would gain %.1f%% (threshold %.1f%%)",
                     d.job, plan.shape, ", ".join(doc.members), 100 * gain, 100 * self.config.scale_up_threshold)
            return False
        joined = sorted(set(doc.members) - set(plan.members))
        warming = still_warming(joined, snap.members, self.memory, self.clock())
        if warming:   # taken in once their spares have imported torch: the morph then waits for no import
            why = f"{', '.join(warming)} joins {d.job} once its spare workers have imported torch"
            if self.memory.waiting.get(d.job) != why:
                self.memory.waiting[d.job] = why
                log.info("leader: %s", why)
            self.memory.considered = None   # considered again at the next round
            return False
        reason = (f"{', '.join(joined) or 'new VMs'} joined: {doc.shape} on {len(doc.members)} members is estimated "
                  f"{100 * gain:.0f}% faster than {plan.shape}; checkpointing, then re-planning")
        return await self._abort(snap, Decision("abort", reason, d.job, checkpoint=True))
