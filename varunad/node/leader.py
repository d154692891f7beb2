"""The leader: decide from one fleet snapshot what the job queue needs, and do it.

``varunad.control.decide.decide`` is a pure function of a ``FleetSnapshot`` (plus what this leader
remembers, such as when it first saw an epoch): it returns one ``Decision`` whose ``sentence`` says
what and why. ``Leader`` runs the loop (watch members, jobs, cancel requests, worker reports and the plan;
debounce; read a snapshot; decide; act) while this daemon holds leadership. Every write it makes
goes through ``Election.write_as_leader`` (the plan through ``write_plan``, with its writer record), so
a deposed leader changes nothing.

A morph has two phases. First a ``stop`` plan (new epoch) asks the old epoch's workers to stop,
after a checkpoint when every member of the old plan is alive (a member that left cannot
checkpoint, and its peers are blocked on it); the leader waits, bounded, until every live member
reports those workers gone (daemons SIGKILL the ones that do not stop within their grace).
Then a ``run`` plan for the members that answer a ping: its epoch is its etcd revision, and
every worker resumes from the newest complete checkpoint with the same global batch.

The loop and its actions (morph, abort, finish, record) share the leader's memory and fence every
write the same way; planning (a job's start, a calibration run, whether a re-plan pays) is the
part in ``varunad.node.leader_planning``, and the pure part is ``varunad.control.decide``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import replace

from protocol.messages import StopWorkers
from trainer.errors import ANOTHER_MODEL
from varunad.cluster.election import Election, NotLeader
from varunad.control.decide import (
    Decision,
    LeaderMemory,
    cause_of,
    decide,
    epoch_failure,
    replanning_on,
    store_failing,
    was_lost,
    who_and_cause,
)
from varunad.control.failures import classify, ended_early, memory_backoff
from varunad.control.fleet import (
    FleetSnapshot,
    JobEntry,
    read_fleet,
    read_members_and_reports,
    read_newest,
    read_progress,
)
from varunad.control.jobs import JobState, job_store
from varunad.control.links import LinkSurvey
from varunad.control.plans import PlanDoc, describe, described_shape
from varunad.control.records import encode_history
from varunad.control.resume import NO_CHECKPOINT_YET, ResumeSource, complete_manifest, resume_source
from varunad.control.speeds import SlotSpeeds
from varunad.node.config import DaemonConfig
from varunad.node.leader_pace import LeaderPace
from varunad.node.leader_planning import LeaderPlanning
from varunad.node.metrics import DaemonMetrics
from varunad.node.peers import PeerClients, SilentMembers
from varunad.store.contract import Store, StoreError, Watch
from varunad.store.keys import Keys

__all__ = ["Leader"]

log = logging.getLogger(__name__)

# the member part of a history key that holds losses a checkpoint carried, not a daemon's
CHECKPOINT_HISTORY = "checkpoint"


def _final_checkpoint(store: str, steps: int) -> bool | None:
    """Whether the checkpoint of the job's last step is complete (its manifest is written last);
    None when the store is not a path the leader can look at (an object store URL)."""
    if "://" in store:
        return None
    return complete_manifest(store, steps) is not None


class _Deposed(Exception):
    pass


class Leader(LeaderPlanning, LeaderPace):
    """Runs while this daemon leads; cancelled when it stops leading."""

    def __init__(self, *, config: DaemonConfig, store: Store, keys: Keys, election: Election,
                 clients: PeerClients, clock: Callable[[], float] = time.monotonic,
                 metrics: DaemonMetrics | None = None) -> None:
        self.config = config
        self.store = store
        self.keys = keys
        self.election = election
        self.clients = clients
        self.clock = clock
        self.memory = LeaderMemory()
        self.silent = SilentMembers(clients, ttl=config.ttl)   # pings, and who stayed silent in this morph
        self._store_paused: int | None = None   # the epoch whose workers the checkpoint store held last cycle
        self.metrics = metrics if metrics is not None else DaemonMetrics()
        self._changed = asyncio.Event()
        self._last_sentence = ""
        self._unreadable_since: float | None = None   # when reading the fleet began to fail (one warning per outage)
        self._reports: set[asyncio.Task[None]] = set()  # end-of-job reports being written
        # job -> (revision, state) of this term's newest write of its state: a later value is not a
        # leader's (read_fleet), and this one is written back
        self._own_states: dict[str, tuple[int, JobState]] = {}
        self._ahead: asyncio.Task[None] | None = None   # the next epoch planned while the old one stops
        self._ahead_for: tuple[str, frozenset[str] | None] | None = None   # (job, the members it planned on)
        self.speeds = SlotSpeeds(threshold=config.straggler_threshold, window=config.straggler_window,
                                 forget_s=config.straggler_forget)
        self.links = LinkSurvey(store, keys, timeout=config.retry_timeout, put=election.write_as_leader,
                                term=lambda: election.state.term, clock=clock)

    @property
    def t(self) -> float:
        return self.config.retry_timeout

    # -- the loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        watchers = [asyncio.get_running_loop().create_task(self._watch(prefix, is_prefix))
                    for prefix, is_prefix in ((self.keys.members, True), (self.keys.jobs, True),
                                              (self.keys.cancels, True), (self.keys.workers, True),
                                              (self.keys.plan, False), (self.keys.links, True))]
        try:
            while True:
                try:
                    acted = await self.cycle()
                except _Deposed as exc:
                    log.warning("leader: stopping: %s", exc)
                    return
                if acted:
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._pause()):
                        await self._changed.wait()
                if self._changed.is_set():
                    await asyncio.sleep(self.config.debounce)  # let related changes arrive together
                self._changed.clear()
        finally:
            if self._ahead is not None:
                self._ahead.cancel()
            for w in watchers:
                w.cancel()
            for w in watchers:
                with contextlib.suppress(asyncio.CancelledError):
                    await w

    def _pause(self) -> float:
        """How long the loop may wait for a change: ``loop_wait``, or less while a job runs, so that
        each slot's speed is measured at every progress write (LeaderPace), not every other."""
        if not self._pacing:
            return self.config.loop_wait
        return min(self.config.loop_wait, max(0.05, self._next_pace - self.clock()))

    async def _watch(self, key: str, is_prefix: bool) -> None:
        while True:
            watch: Watch = self.store.watch_prefix(key) if is_prefix else self.store.watch(key)
            try:
                await watch.start(timeout=self.t)
                self._changed.set()  # something may have changed while no watch ran
                while True:
                    if await watch.next(timeout=None) is not None:
                        self._changed.set()
            except StoreError as exc:
                log.debug("watch of %s broke (%s); starting another", key, exc)
                await asyncio.sleep(min(1.0, self.config.loop_wait))
            finally:
                await watch.cancel()

    async def cycle(self) -> bool:
        """One snapshot, one decision, its execution. True when it changed something."""
        if not self.election.is_leader():
            raise _Deposed("this daemon no longer leads")
        self.metrics.leader_cycles.inc()
        try:
            snap = await read_fleet(self.store, self.keys, timeout=self.t, own_states=self._own_states)
        except StoreError as exc:
            first = self._unreadable_since is None
            self._unreadable_since = self._unreadable_since or self.clock()
            # a cycle runs every few tens of milliseconds: one warning per outage, not twenty a second
            log.log(logging.WARNING if first else logging.DEBUG,
                    "leader: cannot read the fleet from etcd (%s); deciding nothing until it answers", exc)
            return False
        if self._unreadable_since is not None:
            log.warning("leader: etcd answers again after %.1fs", self.clock() - self._unreadable_since)
            self._unreadable_since = None
        await self._restore_states(snap)
        await self._survey_links(snap)
        now = self.clock()
        if snap.plan is not None and snap.plan.kind in ("run", "profile"):
            # a run's start and stall bounds, and a calibration's, count from here
            self.memory.epoch_seen.setdefault(snap.plan_epoch, now)
        if snap.plan is not None and snap.plan.kind == "run":
            # workers paused by the checkpoint store get the whole start timeout once it is back
            paused = store_failing(snap)
            if paused or self._store_paused == snap.plan_epoch:
                self.memory.epoch_seen[snap.plan_epoch] = now
            self._store_paused = snap.plan_epoch if paused else None
        await self._await_restoring(snap, now)
        decision = decide(snap, self.memory, now=now, start_timeout=self.config.start_timeout,
                          outage_until=self._outage_until(), stall_timeout=self.config.stall_timeout)
        sentence = decision.sentence
        # One line per decision; a decision repeated cycle after cycle (waiting for slots, say) once.
        log.log(logging.DEBUG if sentence == self._last_sentence else logging.INFO, "%s", sentence)
        self._last_sentence = sentence
        if decision.action == "wait":
            self._pacing = False   # nothing to measure while waiting: the loop waits loop_wait, not 50 ms
        try:
            acted = await self._execute(decision, snap)
            if not acted and decision.action == "nothing":
                acted = await self._pace(snap)   # nothing else to do: how fast each slot computes
            return acted
        except NotLeader as exc:
            raise _Deposed(str(exc)) from None
        except StoreError as exc:
            log.warning("leader: etcd failed while acting (%s); will decide again", exc)
            await asyncio.sleep(min(1.0, self.config.loop_wait))
            return False

    async def _survey_links(self, snap: FleetSnapshot) -> None:
        """Measure the links between idle members that have none for their addresses (varunad.control.links)."""
        plan = snap.plan
        # members whose workers still run (a stopping epoch's too), and those a plan gives work
        busy = {m for m, r in snap.reports.items() if r.alive()}
        if plan is not None and plan.kind == "run":
            busy |= set(plan.members)
        elif plan is not None and plan.kind == "profile" and plan.profile_member:
            busy.add(plan.profile_member)
        try:
            await self.links.survey({m.name: m for m, _ in snap.usable()}, busy)
        except StoreError as exc:
            log.warning("leader: link survey: %s", exc)

    async def _await_restoring(self, snap: FleetSnapshot, now: float) -> None:
        """Note the planned members whose key is missing or unreadable while the lease they were
        planned under lives (varunad.control.outage): a stray delete or put, which their daemon
        undoes at once. A lease that ended, or that etcd cannot vouch for now, is no such member."""
        plan = snap.plan
        missing = [m for m in plan.members if m not in snap.members] if plan is not None and plan.kind == "run" else []

        async def lives(m: str) -> bool:
            lease = plan.incarnations.get(m)
            try:
                return bool(lease) and await self.store.time_to_live(lease, timeout=self.t) is not None
            except StoreError as exc:
                log.debug("leader: cannot ask etcd about %s's lease (%s)", m, exc)
                return False
        # at once: after a mass loss every missing member is asked about, and each answer is a round trip
        alive = [m for m, ok in zip(missing, await asyncio.gather(*map(lives, missing))) if ok]
        # bounded: a daemon that cannot write its own key for a TTL is not one to plan on
        grace = self.config.ttl + self.config.loop_wait
        self.memory.restoring_until = {m: self.memory.restoring_until.get(m, now + grace) for m in alive}

    def _outage_until(self) -> float:
        """Until when absent members are awaited (varunad.control.outage): two TTLs after this daemon last
        saw etcd fail (a renewal failed, or its lease lapsed and it registered again)."""
        trouble = self.election.membership.trouble_at
        return trouble + 2 * self.config.ttl + self.config.loop_wait if trouble else 0.0

    async def _execute(self, d: Decision, snap: FleetSnapshot) -> bool:
        if d.action in ("nothing", "wait"):
            return False
        if d.action == "idle":
            await self.election.write_plan(PlanDoc.idle(d.reason).encode())
            return True
        assert d.job is not None
        if d.action == "fail":
            await self._finish(snap, d.job, "failed", d.reason, error=d.reason)
            return True
        if d.action == "cancel":
            await self._stop_if_running(snap, d.job, checkpoint=False, reason="cancelled")
            await self._finish(snap, d.job, "cancelled", d.reason)
            return True
        if d.action == "done":
            return await self._done(snap, d)
        if d.action == "adopt":
            state = snap.states[d.job]
            plan = snap.plan
            assert plan is not None
            epochs = tuple(sorted(set(state.epochs) | {snap.plan_epoch}))
            await self._put_state(state.but(state="running", epoch=snap.plan_epoch, epochs=epochs,
                                            plan=describe(plan, snap.plan_epoch), reason=plan.reason))
            return True
        if d.action == "abort":
            return await self._abort(snap, d)
        if d.action == "await_stop":
            plan = snap.plan
            assert plan is not None
            taken_over = time.time()
            if not await self._wait_stopped(plan.stop_epoch):
                log.warning("leader: workers of epoch %d did not all stop in time; planning without waiting",
                            plan.stop_epoch)
            # why the epoch stopped is the stop plan's reason ("vm1 was lost ..."): a leader that
            # took over mid-morph (etcd restarted) recorded the morph, and said for the rest of the
            # job, "workers of epoch 10 still run on vm1"
            return await self._start(d.job, await self._finishing(snap, d.job, plan.reason or d.reason, taken_over))
        if d.action == "start":
            return await self._start(d.job, await self._finishing(snap, d.job, d.reason, time.time()))
        if d.action == "consider":
            return await self._consider(snap, d)
        raise ValueError(f"unknown decision {d.action}")

    # -- job state ----------------------------------------------------------------------------------------

    async def _state(self, job: str) -> JobState:
        state, revision = await read_newest(self.store, self.keys.state(job), JobState.decode, "state",
                                            timeout=self.t)
        mine = self._own_states.get(job)
        if mine is not None and revision != mine[0]:   # changed by a hand since: read_fleet says so
            return mine[1]
        return state if state is not None else JobState(job=job)

    async def _put_state(self, state: JobState) -> None:
        try:
            revision = await self.election.write_as_leader(self.keys.state(state.job), state.encode())
        except StoreError:
            # written or not, etcd did not say: the next cycle takes what etcd holds
            self._own_states.pop(state.job, None)
            raise
        self._own_states[state.job] = (revision, state)

    async def _restore_states(self, snap: FleetSnapshot) -> None:
        """Write back this term's states that a hand or a tool changed or deleted since (read_fleet):
        the job went on as the leader's state says, and status says so again."""
        for job in sorted(snap.overwritten):
            log.warning("leader: state/%s was changed by someone other than the leader; writing back the "
                        "leader's (%s)", job, snap.states[job].state)
            try:
                await self._put_state(snap.states[job])
            except NotLeader as exc:
                raise _Deposed(str(exc)) from None
            except StoreError as exc:
                log.warning("leader: could not write back state/%s (%s); will try again", job, exc)

    async def _finish(self, snap: FleetSnapshot, job: str, outcome: str, reason: str, *, error: str | None = None) -> None:
        if self._ahead_for is not None and self._ahead_for[0] == job:   # no next epoch to plan ahead
            self._ahead_for = None
        state = await self._state(job)
        await self._put_state(state.but(state=outcome, reason=reason, error=error, finished_at=time.time()))
        if snap.plan is not None and snap.plan.job == job and snap.plan.kind != "idle":
            await self.election.write_plan(PlanDoc.idle(f"{job} is {outcome}").encode())
        log.info("leader: job %s is %s: %s", job, outcome, reason)
        entry = snap.entry(job)
        if state.epochs and entry is not None and entry.spec is not None:
            self._write_report(job, self._store_of(state, entry))

    def _write_report(self, job: str, store_dir: str) -> None:
        """Record the job's report data (losses, morphs, traces, cost) into its store, in the
        background: the report reads etcd and files, none of which may hold up the loop or fail
        the job (write_end_of_job_report logs its own failures). `varunactl report` draws the
        pictures from it: no plotting library in the daemon."""
        try:
            from varunad.report import write_end_of_job_report  # loaded when first needed
        except Exception as exc:  # a broken report must not break the leader
            log.warning("leader: no report for %s: %s", job, exc)
            return
        task = asyncio.get_running_loop().create_task(
            write_end_of_job_report(self.store, self.keys, job, store_dir, timeout=self.t))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    # -- stopping -----------------------------------------------------------------------------------------

    async def _stop_if_running(self, snap: FleetSnapshot, job: str, *, checkpoint: bool, reason: str) -> None:
        plan = snap.plan
        if plan is None or plan.job != job or plan.kind not in ("run", "profile", "stop"):
            return
        target = snap.plan_epoch if plan.kind != "stop" else plan.stop_epoch
        await self._write_stop(snap, job, target, checkpoint=checkpoint, reason=reason)
        await self._wait_stopped(target)

    async def _write_stop(self, snap: FleetSnapshot, job: str, epoch: int, *, checkpoint: bool, reason: str) -> None:
        # Without a checkpoint the epoch is broken (a member lost, a worker failed, a cancel): no
        # worker can reach another step boundary, so daemons kill them at once (kill=True).
        await self.election.write_plan(
            PlanDoc.stop(job, epoch, checkpoint=checkpoint, reason=reason, kill=not checkpoint).encode())
        msg = StopWorkers(job=job, epoch=epoch, reason=reason[:1000], checkpoint=checkpoint)
        await self.clients.send_all([(name, member.endpoint) for name, (member, _) in snap.members.items()], msg)

    async def _wait_stopped(self, epoch: int) -> bool:
        """Until no live member reports a worker of ``epoch`` or older alive (bounded). Without a
        checkpoint too the bound is ``stop_grace``: survivors save their state from memory first
        (the daemons SIGKILL a worker that does not say it is doing so after ``abort_grace``)."""
        limit = self.config.stop_grace + 2 * self.t + 5.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        # A vanished VM's last report says its workers are alive until its lease runs out: one that
        # does not answer a ping is not waited for (its workers died with it). The pings run beside
        # the reading of reports: at 300 VMs a round of them outlasted most survivors' stop.
        silent: set[str] = set()
        pinging: asyncio.Task[set[str]] | None = None
        asked: list[str] = []
        next_ping = loop.time()   # at once: the survivors' save takes about as long as a ping timeout
        try:
            while loop.time() < deadline:
                if pinging is not None and pinging.done():
                    gone = set(asked) - pinging.result() if pinging.exception() is None else set()
                    if gone - silent:
                        log.info("leader: not waiting for %s: it does not answer a ping", ", ".join(sorted(gone - silent)))
                    silent |= gone
                    pinging = None
                self._changed.clear()
                try:
                    snap = await read_members_and_reports(self.store, self.keys, timeout=self.t)
                except StoreError as exc:
                    log.debug("leader: reading reports while waiting for a stop: %s", exc)
                else:
                    alive = [m for m, r in snap.reports.items()
                             if m in snap.members and m not in silent and r.alive(epoch)]
                    if not alive:
                        return True
                    self._replan_ahead(snap, silent)
                    # a member leaving on a notice closes its socket once its workers are gone: it is
                    # not pinged (its report and then its key say when it is done)
                    staying = [m for m in alive if not snap.members[m][0].draining]
                    if staying and pinging is None and loop.time() >= next_ping:
                        asked = staying
                        pinging = loop.create_task(self.silent.answering(snap, staying, mark=True, again=True))
                        next_ping = loop.time() + 1.0
                if not self.election.is_leader():
                    raise NotLeader("lost leadership while waiting for workers to stop")
                # the next report (the leader's watch of them sets _changed), or a tenth of a second
                wake = [loop.create_task(self._changed.wait())] + ([pinging] if pinging is not None else [])
                try:
                    await asyncio.wait(wake, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake[0].cancel()
            return False
        finally:
            if pinging is not None:
                pinging.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pinging

    async def _done(self, snap: FleetSnapshot, d: Decision) -> bool:
        """Every worker exited 0: the job is done only if they trained its last step and its
        checkpoint is complete; a script that ended early fails the job, saying where."""
        assert d.job is not None
        entry = snap.entry(d.job)
        if entry is None or entry.spec is None:
            await self._finish(snap, d.job, "done", d.reason)
            return True
        steps = entry.spec.steps
        reports = [snap.reports.get(s.member) for s in snap.plan.slots] if snap.plan is not None else []
        reached = max((r.step + 1 for rep in reports if rep is not None
                       for r in rep.of(d.job, snap.plan_epoch).values()), default=0)
        final = await self._final_checkpoint_of(snap, d.job)
        if final or (final is None and reached >= steps):
            await self._finish(snap, d.job, "done", f"trained all {steps} steps; the checkpoint of the last one "
                                                    "is complete")
            return True
        if reached >= steps:
            why = (f"the workers trained all {steps} steps but the checkpoint of step {steps} is not complete "
                   f"in the store (see `varunactl logs {d.job}`)")
        else:
            why = f"{ended_early(reached, steps)}: its workers exited with code 0"
        await self._finish(snap, d.job, "failed", why, error=why)
        return True

    def _store_of(self, state: JobState | None, entry: JobEntry | None) -> str:
        """Where the job's checkpoints are: the store its state records, else its spec's ("" without either)."""
        if state is not None and state.store:
            return state.store
        return job_store(entry.spec, self.config.store) if entry is not None and entry.spec is not None else ""

    async def _final_checkpoint_of(self, snap: FleetSnapshot, job: str) -> bool | None:
        """`_final_checkpoint` of ``job`` as ``snap`` records it (None without a spec or a path to look at)."""
        entry = snap.entry(job)
        if entry is None or entry.spec is None:
            return None
        store = self._store_of(snap.states.get(job), entry)
        # off the loop: the manifest and its files' sizes are read from the store, which may hang (NFS)
        return await asyncio.to_thread(_final_checkpoint, store, entry.spec.steps)

    async def _abort(self, snap: FleetSnapshot, d: Decision) -> bool:
        assert d.job is not None and snap.plan is not None
        job, plan, epoch, reason = d.job, snap.plan, max(snap.plan_epoch, d.stop_epoch), d.reason
        noticed = time.time()
        state = snap.states[job]
        who, what = who_and_cause(d.reason) if d.failure else ("", "")
        # the stop first: every survivor's save waits for it, and the state only tells people
        await self._write_stop(snap, job, epoch, checkpoint=d.checkpoint, reason=d.reason)
        self._plan_ahead(job)
        await self._put_state(state.but(state="morphing", change="stopping" if d.failure else "morph", reason=(
            f"a worker failed ({who}): stopping the epoch, then checking which VMs answer" if d.failure else d.reason)))
        if not await self._wait_stopped(epoch):
            log.warning("leader: not every worker of epoch %d reported stopping; planning without them", epoch)
        stopped = time.time()
        after = await read_fleet(self.store, self.keys, timeout=self.t)   # the fleet once the epoch stopped
        restart = False
        lost: list[str] = list(d.lost)
        if d.failure:
            # every worker has said why it ended by now: the raise, not a neighbour's broken connection
            root = epoch_failure(after, plan, job, epoch)
            if root is not None and root != d.reason:
                log.info("leader: %s: the root failure of epoch %d: %s (first seen: %s)", job, epoch, root, d.reason)
                reason = root
                d = replace(d, reason=root)
                who, what = who_and_cause(root)
        cause = cause_of(reason)
        if await self._final_checkpoint_of(after, job):
            # The last step's checkpoint was complete before the loss (or a survivor's save from
            # memory completed it): nothing is left to train, and a next epoch would train 0 steps,
            # counted as a restart. A script's own failure after its loop (an evaluation, an
            # export) does not fail a job whose training is whole either; its words stay in the logs.
            steps = after.entry(job).spec.steps   # type: ignore[union-attr]
            await self._finish(after, job, "done", f"trained all {steps} steps; the checkpoint of the last one is "
                                                   f"complete ({cause} after it: nothing left to re-plan)")
            return True
        if d.failure:
            answered = await self.silent.answering(after, plan.members, mark=True)
            lost = sorted(set(plan.members) - answered)
            state = await self._state(job)
            # the worker's own words (often gloo's, from a peer that vanished) stay in this log and in
            # `varunactl logs`; the job's reason says what happened in ours
            log.info("leader: %s: %s", job, d.reason)
            if lost:
                log.info("leader: %s did not answer a ping: not counting the failure as a restart", ", ".join(lost))
                # A vanished VM breaks its neighbours' workers before its lease expires: name the cause.
                cause = was_lost(lost)
                they = "it stopped answering; its" if len(lost) == 1 else "they stopped answering; their"
                reason = f"{cause} ({they} peer {who}): {replanning_on(after.members, lost)}"
            else:
                verdict = classify(d.reason, state.error if state.restarts else None)
                # a full or read-only store can outlast any budget of restarts: not counted
                outage = verdict == "outage"
                restarts = state.restarts + (0 if outage else 1)
                if verdict == "fail":
                    again = " again on a fresh start" if state.restarts else ""
                    await self._finish(snap, job, "failed",
                                       f"{what} ({who}{again}): not retried, starting again would fail the same "
                                       f"way; fix the script or the job and submit it again under a new --name"
                                       + await asyncio.to_thread(_resume_hint, state.store, d.reason), error=d.reason)
                    return True
                if restarts > self.config.max_restarts:
                    await self._finish(snap, job, "failed", f"gave up after {state.restarts} restarts: {what} ({who})",
                                       error=d.reason)
                    return True
                # a stage that ran out would run out again in the same plan: plan with less of its kind's memory
                backoff = (memory_backoff(d.reason, state.plan, state.memory_scale, await self._peaks(job, epoch))
                           if verdict == "memory" else None)
                scales = state.memory_scale if backoff is None else {**state.memory_scale, backoff.kind: backoff.scale}
                if not outage:
                    await self._put_state(state.but(restarts=restarts, error=d.reason, memory_scale=scales))
                restart = backoff is None
                cause = ("the checkpoint store refused a write" if outage else
                         "a stage ran out of memory" if backoff is not None else "a worker failed")
                if backoff is not None:
                    reason = f"{backoff.words} ({who}, restart {restarts} of at most {self.config.max_restarts})"
                    log.warning("leader: %s: %s", job, reason)
                else:
                    reason = (f"{what} ({who}): starting the same plan again from the newest checkpoint "
                              + ("(a checkpoint store outage: free space or remount it; not counted as a restart)"
                                 if outage else f"(restart {restarts} of at most {self.config.max_restarts})"))
        # from here until it runs again, status and watch call it what it is: a restart or a morph
        await self._put_state((await self._state(job)).but(change="restart" if restart else "morph", reason=reason))
        # after a checkpoint at the step boundary, no VM was lost: a member that left, left
        gone = [] if d.checkpoint else sorted(set(lost) | {m for m in plan.members if m not in after.members})
        resumed = await self._resume_source(after, job, plan, gone)
        await self._keep_losses(job, resumed)
        self.memory.morph[job] = dict(reason=reason, from_shape=plan.shape, from_epoch=epoch, noticed_at=noticed,
                                      stopped_at=stopped, checkpoint=d.checkpoint, restart=restart, cause=cause,
                                      source=resumed.source, resumed_from=-1 if resumed.step is None else resumed.step,
                                      source_why=resumed.why)
        if resumed.words:
            log.info("leader: %s resumes %s", job, resumed.words)
        return await self._start(job, reason)

    async def _finishing(self, snap: FleetSnapshot, job: str, reason: str, since: float) -> str:
        """The reason to start ``job`` with: a stop plan of the job that this leader did not write
        (the leader before it was lost mid-morph) is a morph to finish, recorded by `_took_over`."""
        stop = snap.plan
        if stop is None or stop.kind != "stop" or stop.job != job or job in self.memory.morph:
            return reason
        return await self._took_over(snap, job, stop, stop.reason or reason, since)

    async def _took_over(self, snap: FleetSnapshot, job: str, stop: PlanDoc, reason: str, since: float) -> str:
        """The morph record of a stop the previous leader wrote (it left, or lost its lease, mid-morph):
        where the next epoch resumes and which of the stopped epoch's VMs left meanwhile (a probe's
        leader got a notice during a join's morph: the record said neither, and 'resumed from -1').
        Its start is when this leader took it over: the previous leader's moment went with it."""
        after = await read_fleet(self.store, self.keys, timeout=self.t)
        state = after.states.get(job) or snap.states.get(job)
        ran = (state.plan or {}) if state is not None else {}
        members = ran.get("members") if isinstance(ran.get("members"), list) else []
        gone = sorted(m for m in members if isinstance(m, str) and m not in after.members)
        # the VMs the stop's own words name (the one leaving) are not news
        news = [m for m in gone if not re.search(rf"(?<![\w.-]){re.escape(m)}(?![\w.-])", reason)]
        if news:
            reason = f"{reason}; {', '.join(news)} left meanwhile"
        resumed = await self._resume_source(after, job, None, () if stop.checkpoint else gone)
        await self._keep_losses(job, resumed)
        self.memory.morph[job] = dict(
            reason=reason, from_shape=described_shape(ran), from_epoch=stop.stop_epoch, noticed_at=since,
            stopped_at=time.time(), checkpoint=stop.checkpoint, restart=False, cause=cause_of(reason),
            source=resumed.source, resumed_from=-1 if resumed.step is None else resumed.step, source_why=resumed.why)
        return reason

    async def _keep_losses(self, job: str, resumed: ResumeSource) -> None:
        """The losses the checkpoint the next epoch resumes from carries, into the loss history of
        the epoch that trained them: where the daemon that held them died before writing them,
        they are nowhere else (status names what is still missing)."""
        if not resumed.losses or resumed.losses_epoch <= 0:
            return
        try:
            await self.store.put(self.keys.history_entry(job, resumed.losses_epoch, CHECKPOINT_HISTORY,
                                                         resumed.step or 0),
                                 encode_history(resumed.losses), timeout=self.t)
        except StoreError as exc:
            log.warning("leader: could not keep the losses of %s's checkpoint %s in its history (%s)",
                        job, resumed.step, exc)

    async def _peaks(self, job: str, epoch: int) -> dict[int, int]:
        """rank -> the memory peak each worker of ``epoch`` last reported (none that did not)."""
        return {p.rank: p.peak_bytes for p in await read_progress(self.store, self.keys, job)
                if p.epoch == epoch and p.peak_bytes}

    async def _resume_source(self, snap: FleetSnapshot, job: str, plan: PlanDoc | None,
                             gone: Collection[str]) -> ResumeSource:
        """Where the next epoch will resume, read from the store once the old workers are gone, the
        VMs ``gone`` with them (``plan``: the old run plan, None where only its stop is known)."""
        entry = snap.entry(job)
        store = self._store_of(snap.states.get(job), entry)
        if not store:
            return ResumeSource("", None, "")
        found = await asyncio.to_thread(resume_source, store, plan, gone)
        every = entry.spec.checkpoint_every if entry is not None and entry.spec is not None else 0
        if found.source != "scratch" or not every:
            return found
        # a job that trained past two checkpoints' steps and finds none: the store lost them (a
        # probe's `rm -rf` of a store under a running job read like a first start)
        state = snap.states.get(job)
        epochs = set(state.epochs) if state is not None else set()
        trained = max((p.step + 1 for p in await read_progress(self.store, self.keys, job) if p.epoch in epochs),
                      default=0)
        if trained < 2 * every:
            return found
        lost = (f"its store {store} holds no complete checkpoint, though the job trained to step {trained} with a "
                f"checkpoint every {every}: they were deleted, or never written")
        log.warning("leader: %s resumes from scratch: %s", job, lost)
        return replace(found, why=lost if found.why == NO_CHECKPOINT_YET else f"{found.why}; {lost}")


def _resume_hint(store: str | None, error: str = "") -> str:
    """What a failed job's next submission can resume from: its store's checkpoints, only where it
    holds a complete one (a probe's failed jobs were promised checkpoints their stores never had),
    and none where they are another model's (a probe's job given a GPT's store was told to use it again)."""
    if not store:
        return ""
    if ANOTHER_MODEL in error:
        return f" (its store {store} holds another model's checkpoints: give the job a --store of its own)"
    found = resume_source(store, None, ())
    if found.source == "scratch":
        return " (its store holds no complete checkpoint: a new job starts from scratch)"
    at = f" (newest: step {found.step})" if found.step is not None and found.source else ""
    return f" (with --store {store} it resumes from this one's checkpoints{at})"
