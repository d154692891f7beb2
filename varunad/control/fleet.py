"""One immutable snapshot of the fleet per leader cycle (Patroni's habit): members, plan, jobs,
job states, cancel requests and worker reports, each parsed from etcd into value objects.

Values that do not parse are kept as errors next to their key, never raised: a hand-written job
spec that is wrong fails that job; a garbled member or report is logged and left out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from varunad.cluster.election import PlanWriter
from varunad.cluster.facts import DaemonMember, parse_member
from varunad.control.jobs import JobSpec, JobSpecError, JobState
from varunad.control.plans import PlanDoc
from varunad.control.records import Progress, WorkerReport
from varunad.store import schemas
from varunad.store.contract import HistoryCompacted, KeyValue, Store, StoreError
from varunad.store.keys import Keys

__all__ = ["JobEntry", "FleetSnapshot", "read_fleet", "read_plan", "read_newest", "read_progress", "forget_progress",
           "usable_spec"]

T = TypeVar("T")

# How many older values of the plan key a reader walks back past malformed ones.
_PLAN_LOOKBACK = 32

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
    # jobs whose state key someone other than the reader changed after the reader's own newest
    # write of it (read_fleet's `own_states`): `states` holds the reader's value, to write back
    overwritten: frozenset[str] = field(default=frozenset())
    # member -> the lease its report was written under (a daemon writes it on its own: 0, a hand's)
    report_leases: dict[str, int] = field(default_factory=dict)

    def entry(self, job: str) -> JobEntry | None:
        return next((e for e in self.jobs if e.job == job), None)

    def usable(self) -> list[tuple[DaemonMember, int]]:
        """Members the leader may plan on, by name."""
        return [self.members[n] for n in sorted(self.members) if self.members[n][0].usable_slots > 0]


async def usable_spec(store: Store, kv: KeyValue, job: str, *, timeout: float | None) -> tuple[JobSpec, bytes]:
    """The spec at `kv` (a jobs/<job> key) and its bytes. A spec is never rewritten: where the key
    was written again after submit (a hand's, a broken tool's), the spec as `varunactl submit`
    wrote it, read at the key's creation, is the job's. An invalid value must not fail a job that
    was accepted, and a valid but different one must not change it half-way (a probe's batch
    doubled at step 7 trained the rest of the job on another batch, and said nothing). Only where
    etcd compacted the first away is a later valid value used. JobSpecError where none is."""
    try:
        now, error = JobSpec.decode(kv.value, job=job), None
    except JobSpecError as exc:
        now, error = None, exc
    if kv.mod_revision == kv.create_revision:
        if error is not None:
            raise error
        return now, kv.value
    try:
        first = await store.get(kv.key, revision=kv.create_revision, timeout=timeout)
        spec = JobSpec.decode(first.value, job=job) if first is not None else None
    except (StoreError, JobSpecError):
        spec = None
    if spec is None:
        if error is not None:
            raise error from None
        return now, kv.value
    if error is not None or first.value != kv.value:
        schemas.reject("job spec", f"{kv.key}@{kv.mod_revision}",
                       f"{error or 'a different spec'} (written after submit; the spec as submitted is used)")
    return spec, first.value


async def read_fleet(store: Store, keys: Keys, *, timeout: float,
                     own_states: Mapping[str, tuple[int, JobState]] | None = None) -> FleetSnapshot:
    """Everything the leader decides from, read at once.

    ``own_states``: job -> (revision, state) of the reader's own newest write of that job's state
    in its term (the leader's). Only the leader writes states, so a key changed or deleted since
    was a hand's or a tool's (a hand-written "done" ended a running job): it is reported, and the
    leader's own value is the job's state, as a forged plan is not the plan (read_plan)."""
    notes: list[str] = []
    members = await _read_members(store, keys, timeout=timeout)
    plan, epoch = await read_plan(store, keys, timeout=timeout)

    jobs = []
    for kv in await store.get_prefix(keys.jobs, timeout=timeout):
        try:
            job = keys.job_id(kv.key)
        except ValueError:
            continue
        try:
            jobs.append(JobEntry(job, (await usable_spec(store, kv, job, timeout=timeout))[0], None,
                                 kv.create_revision))
        except JobSpecError as exc:
            jobs.append(JobEntry(job, None, str(exc), kv.create_revision))
    jobs.sort(key=lambda e: e.revision)

    states, overwritten = {}, set()
    own_states = own_states or {}
    for kv in await store.get_prefix(keys.states, timeout=timeout):
        try:
            job = keys.state_job(kv.key)
        except ValueError as exc:
            schemas.reject("state", kv.key, exc)
            continue
        if job in own_states and kv.mod_revision != own_states[job][0]:
            schemas.reject("state", f"{kv.key}@{kv.mod_revision}",
                           f"the leader last wrote it at revision {own_states[job][0]}: this value is not a leader's")
            continue
        state, _ = await read_newest(store, kv.key, JobState.decode, "state", timeout=timeout, kv=kv)
        if state is not None:
            states[job] = state
    for job, (_, mine) in own_states.items():
        if job not in states:   # changed by a hand (above), or deleted
            states[job] = mine
            overwritten.add(job)

    cancels = set()
    for kv in await store.get_prefix(keys.cancels, timeout=timeout):
        try:
            cancels.add(keys.cancel_job(kv.key))
        except ValueError:
            continue

    revision, reports, leases = await _read_reports(store, keys, timeout=timeout)
    return FleetSnapshot(revision, members, plan, epoch, tuple(jobs), states, frozenset(cancels), reports,
                         tuple(notes), frozenset(overwritten), leases)


async def read_members_and_reports(store: Store, keys: Keys, *, timeout: float) -> FleetSnapshot:
    """A snapshot of the members and their worker reports only (no plan, jobs or states): what
    the leader's wait for a stop reads, many times a second, where the whole fleet is 7 reads."""
    members = await _read_members(store, keys, timeout=timeout)
    revision, reports, leases = await _read_reports(store, keys, timeout=timeout)
    return FleetSnapshot(revision, members, None, 0, (), {}, frozenset(), reports, (), report_leases=leases)


async def _read_members(store: Store, keys: Keys, *, timeout: float) -> dict[str, tuple[DaemonMember, int]]:
    members = {}
    for kv in await store.get_prefix(keys.members, timeout=timeout):
        try:
            name = keys.member_name(kv.key)
            member = schemas.decoded(kv.key, kv.value, parse_member)
            if member.name != name:
                raise ValueError(f"it describes {member.name!r}")
        except ValueError as exc:
            schemas.reject("member", kv.key, exc)
            continue
        members[name] = (member, kv.lease)
    return members


async def _read_reports(store: Store, keys: Keys, *,
                        timeout: float) -> tuple[int, dict[str, WorkerReport], dict[str, int]]:
    reports, leases = {}, {}
    last = await store.get_prefix(keys.workers, timeout=timeout)
    for kv in last:
        try:
            name = keys.workers_member(kv.key)
            reports[name] = schemas.decoded(kv.key, kv.value, WorkerReport.decode)
            leases[name] = kv.lease or 0
        except ValueError as exc:
            schemas.reject("report", kv.key, exc)
    return last.revision, reports, leases


async def read_plan(store: Store, keys: Keys, *, timeout: float | None) -> tuple[PlanDoc | None, int]:
    """The newest plan a leader wrote and its epoch; (None, 0) when there is none.

    A value that does not parse, or that no leader wrote (no :class:`PlanWriter` record of its
    revision, or one naming someone who did not hold the leader key then), is reported, counted
    and skipped: the plan in force stays the one before it, read from etcd's history. So garbage
    or a forged plan at ``plan`` neither stops the job nor makes the leader re-plan it (which
    would kill its workers without a checkpoint). Once etcd has compacted the history, the walk
    back ends there (no older plan is in force) and the writer check decides from the keys as
    they are now (:func:`_not_a_leaders`).
    """
    listing = await store.get_prefix(keys.plan, timeout=timeout)  # the plan and its writer, at one revision
    leader = await store.get(keys.leader, timeout=timeout)
    written = listing.get(keys.plan_writer)

    async def forged(kv: KeyValue) -> str | None:
        return await _not_a_leaders(store, keys, kv.mod_revision, written, leader, timeout=timeout)

    return await read_newest(store, keys.plan, PlanDoc.decode, "plan", timeout=timeout,
                             kv=listing.get(keys.plan), check=forged)


async def _not_a_leaders(store: Store, keys: Keys, revision: int, written: KeyValue | None,
                         leader: KeyValue | None, *, timeout: float | None) -> str | None:
    """Why the plan written at ``revision`` is no leader's; None when a leader wrote it.

    ``written`` and ``leader``: the plan-writer record and the leader key as read now. A leader
    writes its record in the plan's transaction, so the record of a plan's revision was modified
    at that very revision. The leader named there must have held the leader key (name, term and
    lease) at that revision: now, if the key has not changed since, else in etcd's history (a
    plan of an earlier leader stays in force until the next leader writes one)."""
    try:
        if written is None:   # deleted since (a hand): the record written with the plan is in etcd's history
            written = await store.get(keys.plan_writer, timeout=timeout, revision=revision)
        if written is None or written.mod_revision < revision:
            return "no plan-writer record was written with it, so no leader wrote it"
        if written.mod_revision > revision:
            written = await store.get(keys.plan_writer, timeout=timeout, revision=revision)
            if written is None or written.mod_revision != revision:
                return "no plan-writer record was written with it, so no leader wrote it"
        writer = PlanWriter.decode(written.value)
        if writer.held(leader) and leader is not None and leader.mod_revision <= revision:
            return None
        if writer.held(await store.get(keys.leader, timeout=timeout, revision=revision)):
            return None
    except HistoryCompacted:
        # etcd compacted the history this check would read (routine: auto-compaction). Decide from
        # what is read now: the writer's record was modified at the plan's own revision, so one
        # transaction wrote both, which only the leader's guarded write does.
        return None if written is not None else "no plan-writer record is left to say who wrote it"
    except ValueError as exc:
        return str(exc)
    return (f"its writer {writer.name} (term {writer.term}, lease {writer.lease:x}) did not hold the leader key "
            f"at revision {revision}")


async def read_newest(store: Store, key: str, decode: Callable[[bytes], T], kind: str, *, timeout: float | None,
                      kv: KeyValue | None | bool = True,
                      check: Callable[[KeyValue], Awaitable[str | None]] | None = None) -> tuple[T | None, int]:
    """The newest value of ``key`` that ``decode`` accepts and its mod revision; (None, 0) if none.

    For documents only the leader writes (the plan, job states): one that does not parse is no
    leader's, so it is reported and the one before it, from etcd's history, stays in force.
    ``kv``: the key as already read (None: absent), to save a read. ``check``: why a value that
    parses is still not to be trusted (None: it is), for the same walk back.
    """
    if kv is True:
        kv = await store.get(key, timeout=timeout)
    for _ in range(_PLAN_LOOKBACK):
        if kv is None or kv is False:
            return None, 0
        try:
            # the same plan read at every leader cycle and by each daemon on one host: decoded once
            value = schemas.decoded(key, kv.value, decode)
            why = None if check is None else await check(kv)
            if why is None:
                return value, kv.mod_revision
            schemas.reject(kind, f"{key}@{kv.mod_revision}", why)
        except ValueError as exc:
            schemas.reject(kind, f"{key}@{kv.mod_revision}", exc)
        if kv.mod_revision <= 1:
            return None, 0
        try:
            kv = await store.get(key, timeout=timeout, revision=kv.mod_revision - 1)
        except HistoryCompacted as exc:  # the older values are gone: none is in force
            log.debug("cannot read %s before revision %d: %s", key, kv.mod_revision, exc)
            return None, 0
        if kv is not None and kv.version == 0:
            return None, 0
    return None, 0


async def read_progress(store: Store, keys: Keys, job: str, *, timeout: float | None = None,
                        world: int | None = None, steps: int | None = None) -> list[Progress]:
    """Every rank's newest progress record of ``job``; one that does not parse is left out (its
    writer, a daemon of another release or a hand, is no reason to stop reading the others), and
    so is one of a rank >= ``world`` or a step >= ``steps`` (the plan's ranks, the job's steps):
    a hand's record of rank 7 or step 1e9 is no worker's (one made a healthy epoch look stuck to
    the leader, and restarted it; status showed it as the step)."""
    out = []
    for kv in await store.get_prefix(keys.progress_of(job), timeout=timeout):
        try:
            p = schemas.decoded(kv.key, kv.value, Progress.decode)
            if kv.key != keys.progress_of(job) + str(p.rank):   # each rank's record at its own key
                raise ValueError(f"rank {p.rank}'s progress is not kept here")
        except ValueError as exc:
            schemas.reject("progress", kv.key, exc)
            continue
        if (world is None or p.rank < world) and (steps is None or p.step < steps):
            out.append(p)
    return out


async def forget_progress(store: Store, keys: Keys, job: str, ranks: int, *, timeout: float) -> int:
    """Delete ``progress/<job>/<rank>`` of every rank >= ``ranks`` (a plan that shrank no longer has
    them, and status would show their last step forever); returns how many went. Best effort."""
    gone = 0
    try:
        for kv in await store.get_prefix(keys.progress_of(job), timeout=timeout):
            rank = kv.key[len(keys.progress_of(job)):]
            if not rank.isdigit() or int(rank) >= ranks:
                gone += bool(await store.delete(kv.key, timeout=timeout))
    except StoreError as exc:
        log.debug("could not forget stale progress of %s: %s", job, exc)
    return gone
