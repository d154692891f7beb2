"""The plan document at ``plan``, how the leader makes one, and what a daemon makes of it.

The ``plan`` key holds what the fleet should be doing now; its mod revision is the *epoch*.
Kinds:

* ``idle``  — no job runs; a daemon stops whatever workers it still has;
* ``run``   — job J runs the ``plan`` (a `trainer.planning.parallel.ParallelPlan`: P x D,
  micro-batch, schedule, cuts, recompute, the rank of each (stage, replica)) with each rank on the
  listed (member, slot). Every daemon in it hands the plan as it is to its workers, which start
  with VARUNA_RESUME=latest (the newest complete checkpoint of the job, or the survivors' rescue);
* ``stop``  — phase one of a morph: the workers of ``stop_epoch`` stop, after a checkpoint when
  ``checkpoint`` is true; daemons SIGKILL those that have not stopped after their grace period,
  or at once when ``kill`` is true (the epoch is broken: a member was lost or a worker failed,
  so no worker can reach another step boundary and waiting would only delay the morph);
* ``profile`` — the job's script runs once on one slot with VARUNA_PROFILE to calibrate.

The value is JSON (readable with etcdctl). A ``run`` plan is also written, and read, in the
form of the release before `ParallelPlan` (its fields flat: ``pipeline_depth``, ``data_depth``,
...), so that a fleet can be upgraded one VM at a time. The leader also pushes
``PlanChanged(epoch)`` over ZeroMQ to the members of a ``run`` plan, which only makes them read
the plan now; a daemon that missed the push reads it at the next watch event.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer.planning import planner
from trainer.planning.calibration import (
    Calibration,
    LinkCost,
    SegmentCost,
    SegmentProfile,
    left_out_of_memory,
)
from trainer.planning.parallel import MAX_WORKERS, ParallelPlan
from trainer.planning.planner import Plan, PlanError, Slot
from trainer.planning.schedule import DEFAULT_SCHEDULE
from varunad.cluster.facts import DaemonMember
from varunad.control.jobs import JobSpec
from varunad.control.speeds import base_kind, slowed_calibrations, slowed_kind
from varunad.store import schemas
from varunad.store.keys import check_component

__all__ = ["PlanDoc", "PlanSlot", "KINDS", "make_plan", "uniform_calibration", "calibrations_for", "describe",
           "described_shape", "shape"]

log = logging.getLogger(__name__)

KINDS = ("idle", "run", "stop", "profile")

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S{1,1000}")


def _index(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r:.60}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSlot:
    """Where one rank of the plan runs."""

    rank: int
    member: str
    slot: int
    endpoint: str

    def __post_init__(self) -> None:
        _index("a plan slot's rank", self.rank)
        _index(f"the slot of rank {self.rank}", self.slot)
        check_component(f"the member of rank {self.rank}", self.member)
        if not isinstance(self.endpoint, str) or not _URL.fullmatch(self.endpoint):
            raise ValueError(f"the endpoint of rank {self.rank} must be a URL like tcp://host:port, "
                             f"got {self.endpoint!r:.80}")

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> PlanSlot:
        """From the stored form; fields another release adds (or the previous one's stage and
        replica) are left out."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"a plan slot is a JSON object, got {doc!r:.60}")
        return cls(**{k: v for k, v in doc.items() if k in _SLOT_FIELDS})


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDoc:
    kind: str
    reason: str
    job: str | None = None
    # run
    plan: ParallelPlan | None = None  # what every worker runs, passed to them whole
    slots: tuple[PlanSlot, ...] = ()  # where each rank runs
    dist_url: str = ""
    estimated_s: float = 0.0
    calibrated: bool = False  # from a measured calibration (else synthetic: data-parallel only)
    incarnations: Mapping[str, int] = field(default_factory=dict)  # member -> lease id when planned
    # stop
    stop_epoch: int = 0
    checkpoint: bool = False
    kill: bool = False
    # profile
    profile_member: str | None = None
    profile_path: str | None = None
    profile_slots: int = 0  # CPU slots of its machine the calibration run times busy at once (0 = none)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"plan kind {self.kind!r} is not one of {KINDS}")
        if self.plan is not None and not isinstance(self.plan, ParallelPlan):
            object.__setattr__(self, "plan", ParallelPlan.from_dict(self.plan))  # read from etcd
        object.__setattr__(self, "slots", tuple(s if isinstance(s, PlanSlot) else PlanSlot.read(s) for s in self.slots))
        object.__setattr__(self, "incarnations", dict(self.incarnations))
        if self.kind != "idle" and not self.job:
            raise ValueError(f"a {self.kind} plan needs a job")
        if self.kind == "run":
            self._check_placement()

    def _check_placement(self) -> None:
        """One slot per rank of the plan, no device twice."""
        if self.plan is None:
            raise ValueError("a run plan needs its parallel plan")
        world = self.plan.world_size
        ranks = sorted(s.rank for s in self.slots)
        if ranks != list(range(world)):
            raise ValueError(f"a {self.plan.shape} plan places ranks 0..{world - 1} once each, got {ranks}")
        devices = [(s.member, s.slot) for s in self.slots]
        if len(set(devices)) != len(devices):
            raise ValueError(f"a plan puts two workers on one slot: {sorted(devices)[:20]}")
        if not isinstance(self.dist_url, str) or not _URL.fullmatch(self.dist_url):
            raise ValueError(f"a run plan needs its rendezvous URL (dist_url), got {self.dist_url!r:.80}")

    @property
    def shape(self) -> str:
        return self.plan.shape if self.kind == "run" and self.plan is not None else "-"

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(sorted({s.member for s in self.slots}))

    def slots_on(self, member: str) -> tuple[PlanSlot, ...]:
        return tuple(sorted((s for s in self.slots if s.member == member), key=lambda s: s.rank))

    def members_by_stage(self) -> dict[int, set[str]]:
        """stage -> the members that run a replica of it."""
        where = self.plan.positions()
        out: dict[int, set[str]] = {}
        for s in self.slots:
            out.setdefault(where[s.rank][0], set()).add(s.member)
        return out

    def endpoints(self) -> list[str]:
        return [s.endpoint for s in sorted(self.slots, key=lambda s: s.rank)]

    def encode(self) -> bytes:
        doc = asdict(self)
        # uneven shares have no flat form: a daemon of that release must refuse the plan, not
        # run it as an even split (its replicas would cover the wrong examples)
        if self.kind == "run" and self.plan is not None and self.plan.shares is None:
            doc.update(_flat(self))
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> PlanDoc:
        return schemas.decode(cls, data, "plan", upgrade=_from_flat)

    @classmethod
    def idle(cls, reason: str) -> PlanDoc:
        return cls(kind="idle", reason=reason)

    @classmethod
    def stop(cls, job: str, epoch: int, *, checkpoint: bool, reason: str, kill: bool = False) -> PlanDoc:
        return cls(kind="stop", job=job, stop_epoch=epoch, checkpoint=checkpoint, reason=reason, kill=kill)


_SLOT_FIELDS = frozenset(f.name for f in fields(PlanSlot))
_FLAT = ("pipeline_depth", "data_depth", "micro_batch_size", "schedule", "cuts", "recompute")


def _flat(doc: PlanDoc) -> dict[str, Any]:
    """The run plan as the release before `ParallelPlan` reads it (P, D, ... flat in the
    document, stage and replica in each slot), written beside the plan so that a fleet can be
    upgraded one VM at a time: a daemon of that release ignores ``plan``, this one the rest.
    To be dropped in the release after this one."""
    plan, where = doc.plan, doc.plan.positions()
    return {"pipeline_depth": plan.P, "data_depth": plan.D, "micro_batch_size": plan.micro_batch_size or 1,
            "schedule": plan.schedule or DEFAULT_SCHEDULE, "cuts": list(plan.cuts or ()), "recompute": list(plan.recompute or ()),
            "slots": [{**asdict(s), "stage": where[s.rank][0], "replica": where[s.rank][1]} for s in doc.slots]}


def _from_flat(raw: Any) -> Any:
    """A run plan of the release before `ParallelPlan` (P, D, ... flat in the document, each slot
    with its stage and replica), in this release's form; any other document as it is."""
    if not (isinstance(raw, dict) and raw.get("kind") == "run" and "plan" not in raw and "pipeline_depth" in raw):
        return raw
    doc = {k: v for k, v in raw.items() if k not in _FLAT}
    P, D = raw.get("pipeline_depth"), raw.get("data_depth")
    slots = raw.get("slots") if isinstance(raw.get("slots"), list) else []
    sized = isinstance(P, int) and isinstance(D, int) and 0 < P and 0 < D and P * D <= MAX_WORKERS
    ranks = [[None] * D for _ in range(P)] if sized else []
    try:
        for s in slots:
            ranks[_index("stage", s["stage"])][_index("replica", s["replica"])] = s["rank"]
    except (TypeError, KeyError, IndexError, ValueError):
        ranks = []   # the plan's own check refuses what this leaves
    doc["plan"] = {"P": P, "D": D, "micro_batch_size": raw.get("micro_batch_size"), "schedule": raw.get("schedule"),
                   "cuts": raw.get("cuts"), "recompute": raw.get("recompute") or None, "ranks": ranks}
    doc["slots"] = slots   # PlanSlot.read leaves stage and replica out
    return doc


def shape(doc: PlanDoc | None) -> str:
    return "-" if doc is None else doc.shape


# --- calibration ---------------------------------------------------------------------------------------

_LOOPBACK = {"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e9)}


def uniform_calibration(spec: JobSpec, device_kind: str) -> Calibration:
    """A stand-in until a measured calibration exists: one segment, so the planner uses data
    parallelism only (it cannot know where the model may be cut); each micro-batch costs a fixed
    overhead plus a per-sample part, so fewer, larger micro-batches win ties."""
    sizes = spec.micro_batch_sizes()
    costs = tuple(SegmentCost(1e-3 + 1e-3 * b, 2e-3 + 2e-3 * b, 1e-3 + 1e-3 * b, b, b) for b in sizes)
    return Calibration(
        model=f"uniform-{spec.job}", device_kind=device_kind, micro_batch_sizes=tuple(sizes),
        input_bytes=tuple(sizes), segments=(SegmentProfile(1, 1, 0.0, costs),), links=_LOOPBACK,
        allreduce=_LOOPBACK,
    )


# --- machines that daemons share -----------------------------------------------------------------------

def machine_slots(members: Sequence[DaemonMember]) -> dict[str, int]:
    """CPU slots per machine (`DaemonMember.machine_key`): what a plan that uses them all runs there."""
    out: dict[str, int] = {}
    for m in members:
        if m.threads:
            out[m.machine_key] = out.get(m.machine_key, 0) + m.slots
    return out


def profile_slots(member: DaemonMember, on_machine: int) -> int:
    """How many CPU slots of its machine a calibration run on ``member`` times busy at once, after
    measuring alone (`Calibration.busy_slowdown`): where other daemons share the machine
    (``on_machine`` slots in all), as many as it has cores for; 0 where none do, on a GPU, or
    with several threads a worker (the probe forks one-thread processes)."""
    if member.threads != 1 or on_machine <= member.slots:
        return 0
    return min(on_machine, member.cores or on_machine)


def calibrated_load(member: DaemonMember) -> float:
    """Threads per core a calibration run on ``member`` measured its numbers under: its own slots
    all busy on a CPU host whose one-thread slots share the cores (`Supervisor.start_profile`)."""
    if not member.threads or not member.cores:
        return 1.0
    busy = member.slots if member.threads == 1 else 1
    return busy * member.threads / member.cores


# --- planning ------------------------------------------------------------------------------------------

_PLANNED: OrderedDict[bytes, tuple[PlanDoc, Plan]] = OrderedDict()
_PLANNED_MAX = 4
_planned_lock = threading.Lock()


def make_plan(
    spec: JobSpec,
    members: Sequence[tuple[DaemonMember, int]],
    calibrations: Mapping[str, Calibration],
    *,
    calibrated: bool,
    reason: str,
    memory_scale: Mapping[str, float] | None = None,
    slowdowns: Mapping[str, float] | None = None,
) -> tuple[PlanDoc, Plan]:
    """Plan ``spec`` on the usable slots of ``members`` ((member, lease id) pairs). Raises
    PlanError when nothing fits (the caller keeps the job waiting with that reason).
    ``memory_scale``: device kind -> the share of its slots' memory to plan with (the job's,
    lowered after a stage of that kind ran out). ``slowdowns``: slot id ("member/index") -> how
    many times slower than its kind that slot computes (`varunad.control.speeds`, stragglers).

    The same inputs give the same plan, so the last few are kept: the leader plans a morph
    ahead while the old workers stop, and a scale-up plans before its checkpoint, each then
    planning again with what etcd says afterwards (at 300 VMs a plan is 0.15 s of the leader's)."""
    try:
        key = pickle.dumps((spec, list(members), sorted((k, c.to_bytes()) for k, c in calibrations.items()), calibrated,
                            sorted((memory_scale or {}).items()), sorted((slowdowns or {}).items())))
    except (pickle.PicklingError, TypeError, AttributeError, ValueError):   # not kept; planned all the same
        key = None
    with _planned_lock:
        hit = _PLANNED.get(key) if key is not None else None
        if hit is not None:
            _PLANNED.move_to_end(key)
    if hit is not None:
        return dataclasses.replace(hit[0], reason=reason), hit[1]
    doc, result = _make_plan(spec, members, calibrations, calibrated=calibrated, reason=reason,
                             memory_scale=memory_scale, slowdowns=slowdowns)
    if key is not None:
        with _planned_lock:
            _PLANNED[key] = (doc, result)
            while len(_PLANNED) > _PLANNED_MAX:
                _PLANNED.popitem(last=False)
    return doc, result


def _make_plan(spec: JobSpec, members: Sequence[tuple[DaemonMember, int]], calibrations: Mapping[str, Calibration],
               *, calibrated: bool, reason: str, memory_scale: Mapping[str, float] | None,
               slowdowns: Mapping[str, float] | None) -> tuple[PlanDoc, Plan]:
    slots: list[Slot] = []
    by_id: dict[str, tuple[DaemonMember, int]] = {}
    incarnations = {}
    slowed: set[tuple[str, float]] = set()
    for member, lease in members:
        for i in range(member.usable_slots):
            slot_id = f"{member.name}/{i}"
            share = (memory_scale or {}).get(member.device_kind, 1.0)
            factor = (slowdowns or {}).get(slot_id, 1.0)
            if factor > 1.0 and member.device_kind in calibrations:
                slowed.add((member.device_kind, factor))
            else:
                factor = 1.0
            slots.append(Slot(slot_id, member.host, slowed_kind(member.device_kind, factor),
                              max(1, int(member.memory_bytes * share)), machine=member.machine_key,
                              threads=member.threads))
            by_id[slot_id] = (member, i)
        if member.usable_slots:
            incarnations[member.name] = lease
    if not slots:
        raise PlanError("no member offers a usable slot", hint="start varunad on more VMs")
    sizes = spec.micro_batch_sizes()
    cores, loads = _machines([m for m, _ in members], calibrations, calibrated=calibrated,
                             kinds={sl.device_kind for sl in slots})
    result = planner.plan(slots, spec.batch_size, slowed_calibrations(calibrations, slowed), schedule=spec.schedule,
                          micro_batch_sizes=sizes, machine_cores=cores, calibrated_load=loads,
                          slowed_kinds={slowed_kind(kind, f): (kind, f) for kind, f in slowed})
    plan_slots = []
    for slot_id, (stage, replica) in sorted(result.assignment.items()):
        member, i = by_id[slot_id]
        plan_slots.append(PlanSlot(rank=result.parallel.rank_of(stage, replica), member=member.name,
                                   slot=i, endpoint=member.stream_endpoint(i)))
    plan_slots.sort(key=lambda s: s.rank)
    host0 = next(by_id[f"{s.member}/{s.slot}"][0] for s in plan_slots if s.rank == 0)
    used = {s.member for s in plan_slots}
    doc = PlanDoc(
        kind="run", reason=reason, job=spec.job, plan=result.parallel, slots=tuple(plan_slots),
        dist_url=host0.rendezvous_url(),
        estimated_s=float(result.estimated_s),
        calibrated=calibrated, incarnations={m: lease for m, lease in incarnations.items() if m in used},
    )
    return doc, result


def _machines(members: Sequence[DaemonMember], calibrations: Mapping[str, Calibration], *,
              calibrated: bool, kinds: set[str]) -> tuple[dict[str, int], dict[str, float]]:
    """(cores per machine, the load each planned kind was calibrated under) for the planner.
    Nothing without measured calibrations: a synthetic one times no real compute, and the jobs
    planned from it (the suite's sleeping scripts among them) would be crowded for nothing."""
    if not calibrated:
        return {}, {}
    cores = {m.machine_key: m.cores for m in members if m.threads and m.cores}
    loads: dict[str, float] = {}
    for kind in sorted(kinds):
        base, _ = base_kind(kind)
        # the member the leader would have calibrated the kind on (`LeaderPlanning._profile`: the first)
        first = next((m for m in members if m.device_kind == base), None)
        if first is not None and base in calibrations:
            loads[kind] = calibrated_load(first)
    return cores, loads


_SAID: set[tuple[str, str, bytes]] = set()


def calibrations_for(
    spec: JobSpec, kinds: Sequence[str], stored: Mapping[str, bytes]
) -> tuple[dict[str, Calibration], list[str]]:
    """Measured calibrations of ``kinds`` from their stored bytes; the kinds without one (or with
    one that no longer parses) are returned second."""
    found: dict[str, Calibration] = {}
    missing = []
    for kind in sorted(set(kinds)):
        data = stored.get(kind)
        if data is None:
            missing.append(kind)
            continue
        # a CPU kind as facts.detect_device_kind names it ("cpu", "cpu-<n>slots")
        left_out = left_out_of_memory(data, kind)
        if left_out is not None:
            if (spec.job, kind, data) not in _SAID:
                _SAID.add((spec.job, kind, data))
                log.warning("calibrating %s for %s again: its stored calibration is of a version that left "
                            "%s out of a slot's memory", spec.job, kind, left_out)
            missing.append(kind)
            continue
        try:
            found[kind] = Calibration.from_bytes(data)
        except (ValueError, TypeError) as exc:
            if (spec.job, kind, data) not in _SAID:   # read every leader cycle: said once per value
                _SAID.add((spec.job, kind, data))
                log.warning("ignoring the stored calibration of %s for %s: %s", spec.job, kind, exc)
            missing.append(kind)
    return found, missing


def describe(doc: PlanDoc, epoch: int) -> dict[str, Any]:
    """The plan as job state and ``status`` show it."""
    return {
        "epoch": epoch, **(doc.plan.to_dict() if doc.plan is not None else {}),
        "members": list(doc.members),
        "estimated_s": doc.estimated_s, "calibrated": doc.calibrated,
    }


def described_shape(desc: Mapping[str, Any]) -> str:
    """"PxD" of a plan as `describe` recorded it (a job state's ``plan``), "-" where it records none."""
    return f"{desc['P']}x{desc['D']}" if all(type(desc.get(k)) is int for k in "PD") else "-"


