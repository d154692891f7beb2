"""The leader's decisions: from one fleet snapshot (and what this leader remembers, such as when it
first saw an epoch) the one thing the job queue needs next, as a ``Decision`` whose ``sentence``
says what and why. Pure: no store, no clock of its own, no I/O; ``varunad.node.leader`` acts on them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from varunad.control.failures import cause as failure_cause
from varunad.control.failures import ended_early, is_out_of_memory, is_transient
from varunad.control.fleet import FleetSnapshot, JobEntry
from varunad.control.outage import judge_members
from varunad.control.plans import PlanDoc
from varunad.control.records import WorkerRecord, WorkerReport
from varunad.control.stall import StepWatch

__all__ = ["Decision", "LeaderMemory", "calibration_failed", "decide", "epoch_failure", "error_summary", "lease_ended", "replanning_on",
           "was_lost", "who_and_cause",
           "cause_of", "store_failing"]


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # nothing | idle | fail | cancel | start | done | abort | await_stop | adopt | consider | wait
    reason: str
    job: str | None = None
    checkpoint: bool = False  # abort: ask the workers to checkpoint first
    failure: bool = False  # abort: a worker failed (counts as a restart unless a member was lost)
    # abort: the plan's members whose lease ended. Named here, since they may have registered again
    # (under the same names) by the time the leader asks where the next epoch resumes
    lost: tuple[str, ...] = ()
    # abort: the newest epoch whose workers to stop, where it is newer than the plan's (etcd's
    # history went back: `_history_went_back`)
    stop_epoch: int = 0

    @property
    def sentence(self) -> str:
        verbs = {
            "nothing": "does nothing", "wait": "waits", "idle": "clears the plan", "fail": f"fails {self.job}",
            "cancel": f"cancels {self.job}", "start": f"plans {self.job}", "done": f"finishes {self.job}",
            "abort": f"stops the workers of {self.job}" + (" after a checkpoint" if self.checkpoint else ""),
            "await_stop": f"waits for the workers of {self.job} to stop", "adopt": f"records the plan of {self.job}",
            "consider": f"considers re-planning {self.job}",
        }
        return f"the leader {verbs.get(self.action, self.action)} because {self.reason}"


@dataclass
class LeaderMemory:
    """What this leader saw, kept only while it leads (a new leader starts empty)."""

    epoch_seen: dict[int, float] = field(default_factory=dict)  # epoch -> monotonic time first seen
    considered: tuple[int, frozenset[tuple[str, int]]] | None = None  # (epoch, usable (member, lease))
    waiting: dict[str, str] = field(default_factory=dict)  # job -> reason last recorded for waiting
    profile_failed: set[str] = field(default_factory=set)
    # job -> the MorphEvent fields known when it stopped (the new plan adds to_shape, to_epoch, planned_at)
    morph: dict[str, dict] = field(default_factory=dict)
    links_since: dict[str, float] = field(default_factory=dict)  # job -> when its first plan began to wait for links
    warming_since: dict[tuple[str, int], float] = field(default_factory=dict)  # (member, lease) -> first seen warming
    # the running epoch's newest step, from its progress records (LeaderPace; varunad.control.stall)
    steps: StepWatch = field(default_factory=StepWatch)
    # member -> until when its key, missing while its planned lease lives, is awaited back (varunad.control.outage)
    restoring_until: dict[str, float] = field(default_factory=dict)


# How long a scale-up waits for a joined VM's spare workers to import torch (DaemonMember.warming):
# a VM whose spares never get ready (a broken one, an old daemon's) is taken in after this anyway.
JOIN_WARM_WAIT = 30.0


def still_warming(joined, members, memory: LeaderMemory, now: float, wait: float = JOIN_WARM_WAIT) -> list[str]:
    """The VMs of `joined` a scale-up waits for: their spares still import torch, and the leader
    first saw them so less than `wait` seconds ago. `members` maps a name to (member, lease)."""
    out = []
    for name in joined:
        member, lease = members[name]
        if getattr(member, "warming", False) and now - memory.warming_since.setdefault((name, lease), now) < wait:
            out.append(name)
    return out


_LAST_OUTPUT = "; last output:"
# The last line of a Python traceback: "ValueError: ...", "trainer.errors.ConfigError: ...",
# with the "[rank2]: " torch.distributed puts before each line of a worker's traceback.
_EXCEPTION_LINE = re.compile(r"(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|StoreOutage)\b(: .*)?")


def error_summary(text: str) -> str:
    """One line for a failed worker's error: the supervisor's first line ("rank 0 on vm1 exited
    with code 1; last output:") and, from the output after it, the exception that ended the
    script (the last line of its traceback), else its exit code and the last line it printed."""
    lines = text.strip().splitlines()
    if not lines:
        return ""
    head, output = lines[0], [ln.strip() for ln in lines[1:] if ln.strip()]
    if head.endswith(_LAST_OUTPUT) and not output:
        return f"{head[:-len(_LAST_OUTPUT)]} (no output)"[:300]
    if not head.endswith(_LAST_OUTPUT):
        return head[:300]
    cause = next((ln for ln in reversed(output) if _EXCEPTION_LINE.fullmatch(ln)), None)
    if cause is None:
        # no exception: the script chose its exit (sys.exit(3)) and its last line is whatever it
        # printed last ("step 5 loss 2.31"), which must not read as the reason
        end = re.search(r"exited with code (-?\d+)|killed by (SIG[A-Z0-9]+)", head)
        how = (f"exit code {end.group(1)}" if end.group(1) else f"killed by {end.group(2)}") if end else None
        cause = f"{how} after printing: {output[-1]}" if how else output[-1]
    return f"{head[:-len(_LAST_OUTPUT)]}: {cause}"[:300]


def calibration_failed(job: str, member: str, error: str) -> str:
    """The reason a job fails when its calibration run failed. That run is the job's own script,
    started as a worker is, so what ended it (a bad argument, a missing import, an exception
    before training) would end every worker too: planning without a calibration would only start
    workers that fail the same way, later and in other words."""
    summary = error_summary(error)
    if is_out_of_memory(summary):
        # not the script's fault: one slot held a segment at the largest micro-batch sizes
        how = "the kernel's OOM killer ended it" if "OOM killer" in summary else failure_cause(summary)
        return (f"the calibration run of {job} on {member} ran out of memory ({how}): it runs "
                f"the model segment by segment on one slot, at each micro-batch size up to the batch's; give "
                f"that VM more memory, or submit with a smaller fixed --chunk-size (its output: "
                f"varunactl logs {job})")
    return (f"the calibration run of {job} on {member} failed: {failure_cause(summary) or 'no output'}; "
            f"its workers would fail the same way: fix the script or its arguments and submit it again under a "
            f"new --name (its whole output: varunactl logs {job})")


def _current(snap: FleetSnapshot) -> JobEntry | None:
    for entry in snap.jobs:
        st = snap.states.get(entry.job)
        if st is not None and st.state in ("running", "morphing"):
            return entry
    return None


def _queued(snap: FleetSnapshot) -> JobEntry | None:
    for entry in snap.jobs:
        st = snap.states.get(entry.job)
        if entry.spec is not None and (st is None or st.state == "queued"):
            return entry
    return None


def decide(snap: FleetSnapshot, memory: LeaderMemory, *, now: float, start_timeout: float,
           outage_until: float = 0.0, stall_timeout: float = 0.0) -> Decision:
    """What to do next, from the snapshot alone (and when this leader first saw each epoch)."""
    for entry in snap.jobs:
        st = snap.states.get(entry.job)
        if entry.error is not None and not (st is not None and st.terminal):
            return Decision("fail", f"its spec is invalid: {entry.error}", entry.job)
    for job in sorted(snap.cancels):
        st = snap.states.get(job)
        if snap.entry(job) is not None and not (st is not None and st.terminal):
            return Decision("cancel", "varunactl cancel asked for it", job)

    plan, epoch = snap.plan, snap.plan_epoch
    cur = _current(snap)
    past = _epoch_past_plan(snap)
    if past is not None:
        return _history_went_back(snap, cur, *past)
    if cur is None:
        nxt = _queued(snap)
        if nxt is None:
            if plan is not None and plan.kind != "idle":
                return Decision("idle", "no job is running or queued")
            return Decision("nothing", "no job is queued")
        if plan is not None and plan.kind == "profile" and plan.job == nxt.job:
            return _profile_progress(snap, nxt, plan, epoch, memory, now, stall_timeout)
        return Decision("start", f"started: {nxt.job} was next in the queue", nxt.job)

    job = cur.job
    state = snap.states[job]
    if plan is not None and plan.kind == "profile" and plan.job == job:
        # a morph onto a kind without a calibration waits for it as a start does: "start" again
        # wrote a new calibration plan each cycle, whose workers replaced the run just begun
        return _profile_progress(snap, cur, plan, epoch, memory, now, stall_timeout)
    if plan is None or plan.job != job or plan.kind in ("idle", "profile"):
        return Decision("start", f"{job} is {state.state} but no plan runs it", job)
    if plan.kind == "stop":
        alive = sorted(m for m, r in snap.reports.items() if m in snap.members and r.alive(plan.stop_epoch))
        if alive:
            return Decision("await_stop", f"workers of epoch {plan.stop_epoch} still run on {', '.join(alive)}", job)
        return Decision("start", f"the workers of epoch {plan.stop_epoch} have stopped", job)

    # A run plan for the current job.
    if state.epoch != epoch:
        return Decision("adopt", f"plan epoch {epoch} runs {job} but its state says epoch {state.epoch}", job)
    records = _records(snap, job, epoch)
    if records and all(r is not None and r.outcome == "done" for _, r in records.values()):
        return Decision("done", f"every worker of epoch {epoch} finished", job)
    why = _root_failure(records)
    if why is not None:
        return Decision("abort", why, job, failure=True)
    verdict = judge_members(plan, epoch, snap.members, snap.reports, now=now, outage_until=outage_until,
                            restoring_until=memory.restoring_until)
    if verdict.gone:
        return Decision("abort", f"{was_lost(verdict.gone)} ({lease_ended(verdict.gone)}): "
                                 f"{replanning_on(snap.members, verdict.gone)}", job, lost=tuple(verdict.gone))
    if verdict.awaited:
        return Decision("wait", f"etcd was unavailable: waiting up to {outage_until - now:.0f}s for "
                                f"{', '.join(verdict.awaited)} to register again before counting it lost", job)
    if verdict.restoring:
        return Decision("wait", f"the member key of {', '.join(verdict.restoring)} is missing or unreadable but "
                                f"its lease lives: waiting up to "
                                f"{max(memory.restoring_until[m] for m in verdict.restoring) - now:.0f}s for its "
                                "daemon to write it again before counting it lost", job)
    leaving = [m for m in plan.members if snap.members[m][0].draining]
    if leaving:
        return Decision("abort", f"{', '.join(leaving)} is leaving (a stop or a preemption notice): checkpointing, "
                                 "then re-planning on the VMs left", job, checkpoint=True)
    if records and all(r is not None and not r.alive for _, r in records.values()):
        return Decision("start", f"every worker of epoch {epoch} has stopped", job)
    seen = memory.epoch_seen.get(epoch, now)
    started = any(r is not None and r.step >= 0 for _, r in records.values())
    # workers that hold the epoch's fence while the checkpoint store refuses it are not stuck
    paused = store_failing(snap)
    if not started and not paused and now - seen > start_timeout:
        return Decision("abort", f"the workers of epoch {epoch} did not reach a first step within "
                                 f"{start_timeout:.0f}s", job, failure=True)
    if paused:
        memory.steps.hold(now)
    stuck = memory.steps.stuck(epoch, stall_timeout)
    if stuck is not None:
        return Decision("abort", stuck, job, failure=True)
    # by registration, not name: a VM lost and back under the same name (a new lease) is
    # considered again, though the one that vanished was considered while its lease still stood
    usable = frozenset((m.name, lease) for m, lease in snap.usable())
    newcomers = sorted({name for name, _ in usable} - set(plan.members))
    if newcomers and memory.considered != (epoch, usable):
        return Decision("consider", f"{', '.join(newcomers)} could join {job}", job)
    return Decision("nothing", f"{job} runs epoch {epoch} as {plan.shape}", job)


def _epoch_past_plan(snap: FleetSnapshot) -> tuple[str, WorkerReport] | None:
    """The member whose workers ran the newest epoch newer than the plan's, and its report; None
    when none did. An epoch is the revision of its plan; `read_fleet` reads the plan before the
    reports, and only the leader writes plans, in the same cycle as its read (a newer leader's plan
    between the two reads leaves this one's writes refused), so a newer epoch means etcd's history
    went back (restored from an older copy). Only a live member's report on its own lease counts: a
    hand's value is no epoch the fleet ran. Without a plan (etcd lost all its data, a plan key
    deleted) there is nothing to be newer than: the leader plans as usual, and a daemon that
    applied a newer epoch moves etcd's revision past it when it sees that plan."""
    if snap.plan is None:
        return None
    found = None
    for name, report in snap.reports.items():
        held = snap.members.get(name)
        if held is None or not held[1] or snap.report_leases.get(name) != held[1]:
            continue
        if report.epoch > snap.plan_epoch and (found is None or report.epoch > found[1].epoch):
            found = (name, report)
    return found


def _history_went_back(snap: FleetSnapshot, cur: JobEntry | None, member: str, report: WorkerReport) -> Decision:
    """Workers ran an epoch etcd no longer holds. Its daemons move etcd's revision past it
    (varunad.cluster.revision_floor); once past, the workers of the lost epochs are stopped by
    a plan newer than theirs: where etcd's plan runs their job, with a checkpoint, as a morph, then
    planned again; otherwise (etcd restored mid-morph or mid-calibration) at once, and the job goes
    on from its newest checkpoint."""
    theirs = report.epoch
    what = (f"etcd's history went back ({member} ran epoch {theirs}, newer than the plan's "
            f"{snap.plan_epoch}: etcd was restored from an older copy or lost its data)")
    if snap.revision <= theirs:   # the words do not change with the revision: said once, not every cycle
        return Decision("wait", f"{what}: waiting for the daemons to move etcd's revision past {theirs}",
                        cur.job if cur else None)
    plan = snap.plan
    if (cur is not None and plan is not None and plan.kind == "run" and plan.job == cur.job == report.job):
        return Decision("abort", f"{what}: stopping the workers of the epochs etcd lost, with a checkpoint, then "
                                 "planning again", cur.job, checkpoint=True, stop_epoch=theirs)
    return Decision("idle", f"{what}: stopping the workers of the epochs etcd lost")


def store_failing(snap: FleetSnapshot) -> bool:
    """Whether a worker of the run plan reports that the checkpoint store refuses its writes: it
    trains on, or holds its state and waits for the store; either way it is not stuck."""
    plan = snap.plan
    if plan is None or plan.kind != "run" or not plan.job:
        return False
    return any(report is not None and report.store_failing(plan.job, snap.plan_epoch) is not None
               for report in (snap.reports.get(m) for m in plan.members))


def was_lost(names: list[str]) -> str:
    return f"{', '.join(names)} {'was' if len(names) == 1 else 'were'} lost"


def lease_ended(names: list[str]) -> str:
    return "its lease ended" if len(names) == 1 else "their leases ended"


def replanning_on(members: Mapping[str, object], lost: Collection[str]) -> str:
    """What the job does next, in the fleet as it is: a whole fleet lost at once (spot VMs
    preempted together) leaves no VM to re-plan on, and the VMs that register later under the
    lost ones' names are new registrations, not survivors."""
    if any(m not in lost for m in members):
        return "re-planning on the VMs left"
    if members:
        return "re-planning on the VMs registered again since"
    return "no VM is left: the job resumes from its newest checkpoint once VMs register"


def _root_failure(records: dict[int, tuple[str, WorkerRecord | None]], steps: int | None = None) -> str | None:
    """The summary of the failure that most likely caused the others among an epoch's records
    (rank -> (member, record)): when one worker raises, its peers fail next with broken
    connections, and a cause compared between attempts must be the raise, not whichever
    neighbour's report came first. With the job's ``steps``, a worker whose script ended (exit
    code 0) before the last step is a cause too: its peers then fail waiting for it. None when
    no worker failed."""
    failed = []
    for rank in sorted(records):
        m, r = records[rank]
        # a worker that trained no step of its own (an epoch resumed at its last step) ended nothing early
        if r is not None and r.outcome == "done" and steps is not None and 0 <= r.step < steps - 1:
            failed.append(f"rank {r.rank} on {m} exited with code 0: {ended_early(r.step + 1, steps)}, while "
                          "the other workers trained on")
            continue
        if r is None or r.outcome != "failed":
            continue
        why = error_summary(r.error)
        if not why.startswith(f"rank {r.rank} on {m} "):   # the supervisor's own errors name the worker
            why = f"rank {r.rank} on {m} failed: {why}"
        failed.append(why)
    return min(failed, key=is_transient) if failed else None


def epoch_failure(snap: FleetSnapshot, plan: PlanDoc, job: str, epoch: int) -> str | None:
    """The root failure (``_root_failure``) among the records of ``job``'s ``epoch``, run by
    ``plan``, in ``snap``'s reports: read again once every worker has stopped (the snapshot's own
    plan is the stop plan by then), when each has said why it ended, its last step included (a
    worker's exit can be seen before its last progress while it still runs)."""
    entry = snap.entry(job)
    return _root_failure(_records(snap, job, epoch, plan), entry.spec.steps if entry and entry.spec else None)


def _records(snap: FleetSnapshot, job: str, epoch: int,
             plan: PlanDoc | None = None) -> dict[int, tuple[str, WorkerRecord | None]]:
    """rank -> (member, its worker's record of ``job``'s ``epoch``, None before it reports) for
    each slot of ``plan`` (default: the snapshot's)."""
    plan = plan or snap.plan
    assert plan is not None
    records = {}
    for s in plan.slots:
        report = snap.reports.get(s.member)
        records[s.rank] = (s.member, report.of(job, epoch).get(s.rank) if report else None)
    return records


def who_and_cause(summary: str) -> tuple[str, str]:
    """("rank 0 on vm1 exited with code 3", "failing on purpose") from error_summary's line."""
    m = re.match(r"(rank \d+ on \S+ [^:]*?)(?:: | failed: )(.*)", summary)
    if m is None:
        return "a worker", summary
    return m.group(1), failure_cause(summary)


def cause_of(reason: str) -> str:
    """The few words of a morph's reason that say what happened ("vm4 was lost")."""
    for sep in (" (", ": "):
        if sep in reason:
            return reason.split(sep, 1)[0]
    return reason


def _profile_progress(snap: FleetSnapshot, entry: JobEntry, plan: PlanDoc, epoch: int, memory: LeaderMemory,
                      now: float, stall_timeout: float) -> Decision:
    member = plan.profile_member or ""
    report = snap.reports.get(member)
    records = report.of(entry.job, epoch) if report else {}
    rec = records.get(0)
    if member not in snap.members:
        return Decision("start", f"{member}, which was calibrating the model, left", entry.job)
    if rec is not None and not rec.alive:
        return Decision("start", f"the calibration run on {member} ended ({rec.outcome})", entry.job)
    # bounded as a running epoch's steps are (`--stall-timeout`): a script that hangs before its
    # first step held the whole queue behind its calibration for good
    running = now - memory.epoch_seen.get(epoch, now)
    if stall_timeout and running > stall_timeout:
        return Decision("fail", f"the calibration run on {member} did not finish within {stall_timeout:.0f}s "
                                f"(--stall-timeout): the script hangs before its first step, or waits for "
                                f"something that never comes (its output: varunactl logs {entry.job})", entry.job)
    return Decision("wait", f"{member} is calibrating the model of {entry.job}", entry.job)
