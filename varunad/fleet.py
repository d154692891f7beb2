"""One immutable snapshot of the fleet per leader cycle (Patroni's habit): members, plan, jobs,
job states, cancel requests and worker reports, each parsed from etcd into value objects.

Values that do not parse are kept as errors next to their key, never raised: a hand-written job
spec that is wrong fails that job; a garbled member or report is logged and left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from varunad.facts import DaemonMember, parse_member
from varunad.fleetkeys import FleetKeys
from varunad.jobs import JobSpec, JobSpecError, JobState
from varunad.plans import PlanDoc
from varunad.records import WorkerReport
from varunad.store import Store

__all__ = ["JobEntry", "FleetSnapshot", "read_fleet"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobEntry:
    job: str
    spec: JobSpec | None
    error: str | None  # why the spec cannot be used
    revision: int  # create revision: the queue order


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    revision: int
    members: dict[str, tuple[DaemonMember, int]]  # name -> (facts, lease id)
    plan: PlanDoc | None
    plan_epoch: int
    jobs: tuple[JobEntry, ...]
    states: dict[str, JobState]
    cancels: frozenset[str]
    reports: dict[str, WorkerReport]
    notes: tuple[str, ...] = field(default=())

    def entry(self, job: str) -> JobEntry | None:
        return next((e for e in self.jobs if e.job == job), None)

    def usable(self) -> list[tuple[DaemonMember, int]]:
        """Members the leader may plan on, by name."""
        return [self.members[n] for n in sorted(self.members) if self.members[n][0].usable_slots > 0]


async def read_fleet(store: Store, keys: FleetKeys, *, timeout: float) -> FleetSnapshot:
    notes: list[str] = []
    listing = await store.get_prefix(keys.members, timeout=timeout)
    members = {}
    for kv in listing:
        try:
            name = keys.member_name(kv.key)
            member = parse_member(kv.value)
            if member.name != name:
                raise ValueError(f"it describes {member.name!r}")
        except ValueError as exc:
            notes.append(f"ignored member key {kv.key}: {exc}")
            continue
        members[name] = (member, kv.lease)

    plan_kv = await store.get(keys.plan, timeout=timeout)
    plan, epoch = None, 0
    if plan_kv is not None:
        epoch = plan_kv.mod_revision
        try:
            plan = PlanDoc.decode(plan_kv.value)
        except ValueError as exc:
            notes.append(f"ignored the plan at revision {epoch}: {exc}")

    jobs = []
    for kv in await store.get_prefix(keys.jobs, timeout=timeout):
        try:
            job = keys.job_id(kv.key)
        except ValueError:
            continue
        try:
            jobs.append(JobEntry(job, JobSpec.decode(kv.value, job=job), None, kv.create_revision))
        except JobSpecError as exc:
            jobs.append(JobEntry(job, None, str(exc), kv.create_revision))
    jobs.sort(key=lambda e: e.revision)

    states = {}
    for kv in await store.get_prefix(keys.states, timeout=timeout):
        try:
            states[keys.state_job(kv.key)] = JobState.decode(kv.value)
        except (ValueError, JobSpecError) as exc:
            notes.append(f"ignored job state {kv.key}: {exc}")

    cancels = set()
    for kv in await store.get_prefix(keys.cancels, timeout=timeout):
        try:
            cancels.add(keys.cancel_job(kv.key))
        except ValueError:
            continue

    reports = {}
    last = await store.get_prefix(keys.workers, timeout=timeout)
    for kv in last:
        try:
            reports[keys.workers_member(kv.key)] = WorkerReport.decode(kv.value)
        except ValueError as exc:
            notes.append(f"ignored worker report {kv.key}: {exc}")
    for note in notes:
        log.warning("%s", note)
    return FleetSnapshot(last.revision, members, plan, epoch, tuple(jobs), states, frozenset(cancels), reports,
                         tuple(notes))
