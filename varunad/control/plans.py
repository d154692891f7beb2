"""The plan document at ``plan``, how the leader makes one, and what a daemon makes of it.

The ``plan`` key holds what the fleet should be doing now; its mod revision is the *epoch*.
Kinds:

* ``idle``  — no job runs; a daemon stops whatever workers it still has;
* ``run``   — job J runs as P x D workers on the listed (member, slot)s. Every daemon in it
  starts its workers with VARUNA_RESUME=latest (the newest complete checkpoint of the job);
* ``stop``  — phase one of a morph: the workers of ``stop_epoch`` stop, after a checkpoint when
  ``checkpoint`` is true; daemons SIGKILL those that have not stopped after their grace period,
  or at once when ``kill`` is true (the epoch is broken: a member was lost or a worker failed,
  so no worker can reach another step boundary and waiting would only delay the morph);
* ``profile`` — the job's script runs once on one slot with VARUNA_PROFILE to calibrate.

The value is JSON (readable with etcdctl). The leader also pushes ``PlanChanged(epoch)`` over
ZeroMQ to the members of a ``run`` plan, which only makes them read the plan now; a daemon that
missed the push reads it at the next watch event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from protocol.messages import Assignment, SlotAssignment
from trainer.planning.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile
from trainer.planning.planner import Plan, PlanError, Slot, plan as run_planner

from varunad.store import schemas
from varunad.cluster.facts import DaemonMember
from varunad.control.jobs import JobSpec

__all__ = ["PlanDoc", "PlanSlot", "KINDS", "make_plan", "uniform_calibration", "calibrations_for", "describe", "shape"]

log = logging.getLogger(__name__)

KINDS = ("idle", "run", "stop", "profile")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSlot:
    rank: int
    stage: int
    replica: int
    member: str
    slot: int
    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDoc:
    kind: str
    reason: str
    job: str | None = None
    # run
    pipeline_depth: int = 0
    data_depth: int = 0
    micro_batch_size: int = 0
    schedule: str = "varuna"
    cuts: tuple[int, ...] = ()
    recompute: tuple[bool, ...] = ()  # per stage, as the planner decided by memory; () = the script's choice
    slots: tuple[PlanSlot, ...] = ()
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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"plan kind {self.kind!r} is not one of {KINDS}")
        object.__setattr__(self, "cuts", tuple(self.cuts))
        object.__setattr__(self, "recompute", tuple(bool(r) for r in self.recompute))
        if self.recompute and len(self.recompute) != self.pipeline_depth:
            raise ValueError(f"plan has {len(self.recompute)} recompute flags for {self.pipeline_depth} stages")
        object.__setattr__(self, "slots", tuple(s if isinstance(s, PlanSlot) else PlanSlot(**s) for s in self.slots))
        object.__setattr__(self, "incarnations", dict(self.incarnations))
        if self.kind != "idle" and not self.job:
            raise ValueError(f"a {self.kind} plan needs a job")
        if self.kind == "run":
            self.assignment(0)  # the protocol's checks: one slot per rank, P-1 increasing cuts, ...

    @property
    def shape(self) -> str:
        return f"{self.pipeline_depth}x{self.data_depth}" if self.kind == "run" else "-"

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(sorted({s.member for s in self.slots}))

    def slots_on(self, member: str) -> tuple[PlanSlot, ...]:
        return tuple(sorted((s for s in self.slots if s.member == member), key=lambda s: s.rank))

    def endpoints(self) -> list[str]:
        return [s.endpoint for s in sorted(self.slots, key=lambda s: s.rank)]

    def stage_to_rank(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {s: [0] * self.data_depth for s in range(self.pipeline_depth)}
        for s in self.slots:
            out[s.stage][s.replica] = s.rank
        return out

    def assignment(self, epoch: int) -> Assignment:
        """The ZeroMQ form of a run plan (raises protocol.MessageValueError if inconsistent)."""
        return Assignment(
            job=self.job or "", epoch=epoch, pipeline_depth=self.pipeline_depth, data_depth=self.data_depth,
            micro_batch_size=self.micro_batch_size, schedule=self.schedule, cuts=self.cuts,
            slots=tuple(SlotAssignment(**asdict(s)) for s in self.slots), dist_url=self.dist_url,
            resume_step=None,
        )

    def encode(self) -> bytes:
        doc = asdict(self)
        doc["cuts"] = list(self.cuts)
        doc["recompute"] = list(self.recompute)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> PlanDoc:
        return schemas.decode(cls, data, "plan")

    @classmethod
    def idle(cls, reason: str) -> PlanDoc:
        return cls(kind="idle", reason=reason)

    @classmethod
    def stop(cls, job: str, epoch: int, *, checkpoint: bool, reason: str, kill: bool = False) -> PlanDoc:
        return cls(kind="stop", job=job, stop_epoch=epoch, checkpoint=checkpoint, reason=reason, kill=kill)


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


# --- planning ------------------------------------------------------------------------------------------

def make_plan(
    spec: JobSpec,
    members: Sequence[tuple[DaemonMember, int]],
    calibrations: Mapping[str, Calibration],
    *,
    calibrated: bool,
    reason: str,
) -> tuple[PlanDoc, Plan]:
    """Plan ``spec`` on the usable slots of ``members`` ((member, lease id) pairs). Raises
    PlanError when nothing fits (the caller keeps the job waiting with that reason)."""
    slots: list[Slot] = []
    by_id: dict[str, tuple[DaemonMember, int]] = {}
    incarnations = {}
    for member, lease in members:
        for i in range(member.usable_slots):
            slot_id = f"{member.name}/{i}"
            slots.append(Slot(slot_id, member.host, member.device_kind, max(1, member.memory_bytes)))
            by_id[slot_id] = (member, i)
        if member.usable_slots:
            incarnations[member.name] = lease
    if not slots:
        raise PlanError("no member offers a usable slot", hint="start varunad on more VMs")
    sizes = spec.micro_batch_sizes()
    result = run_planner(slots, spec.batch_size, dict(calibrations), schedule=spec.schedule,
                         micro_batch_sizes=sizes)
    P, D = result.P, result.D
    plan_slots = []
    for slot_id, (stage, replica) in sorted(result.assignment.items()):
        member, i = by_id[slot_id]
        plan_slots.append(PlanSlot(rank=replica * P + stage, stage=stage, replica=replica, member=member.name,
                                   slot=i, endpoint=member.stream_endpoint(i)))
    plan_slots.sort(key=lambda s: s.rank)
    host0 = next(by_id[f"{s.member}/{s.slot}"][0] for s in plan_slots if s.rank == 0)
    used = {s.member for s in plan_slots}
    doc = PlanDoc(
        kind="run", reason=reason, job=spec.job, pipeline_depth=P, data_depth=D,
        micro_batch_size=result.micro_batch_size, schedule=result.schedule, cuts=tuple(result.cuts),
        recompute=tuple(result.recompute), slots=tuple(plan_slots), dist_url=host0.rendezvous_url(),
        estimated_s=float(result.estimated_s),
        calibrated=calibrated, incarnations={m: lease for m, lease in incarnations.items() if m in used},
    )
    return doc, result


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
        try:
            found[kind] = Calibration.from_bytes(data)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the stored calibration of %s for %s: %s", spec.job, kind, exc)
            missing.append(kind)
    return found, missing


def describe(doc: PlanDoc, epoch: int) -> dict[str, Any]:
    """The plan as job state and ``status`` show it."""
    return {
        "epoch": epoch, "P": doc.pipeline_depth, "D": doc.data_depth, "micro_batch_size": doc.micro_batch_size,
        "schedule": doc.schedule, "cuts": list(doc.cuts), "recompute": list(doc.recompute),
        "members": list(doc.members),
        "estimated_s": doc.estimated_s, "calibrated": doc.calibrated,
    }
