"""The leader's inputs as plain data, for tests of its decisions without etcd or processes: a job
``spec``, a daemon ``member``, a fleet ``snapshot``, a ``run_plan`` and its workers'
``reports_for`` an epoch, a ``running`` job state, ``d`` (one call of ``decide``), and
``BAD_PLANS`` (plan documents a reader must refuse)."""

from __future__ import annotations

from varunad.cluster.facts import DaemonMember
from varunad.control.decide import LeaderMemory, decide
from varunad.control.fleet import FleetSnapshot, JobEntry
from varunad.control.jobs import JobSpec, JobState
from varunad.control.plans import PlanDoc, make_plan, uniform_calibration
from varunad.control.records import WorkerRecord, WorkerReport


def spec(**kw) -> JobSpec:
    doc = dict(job="j", script="train.py", batch_size=12, steps=10, checkpoint_every=3, bundle_digest="a" * 64,
               bundle_bytes=10)
    doc.update(kw)
    return JobSpec(**doc)


def member(name: str, *, lease_ports: int = 0, draining: bool = False, slots: int = 1) -> DaemonMember:
    base = 20000 + 10 * int(name[-1])
    return DaemonMember(name=name, host=f"10.0.0.{name[-1]}", endpoint=f"tcp://10.0.0.{name[-1]}:{base}", slots=slots,
                        device_kind="cpu", memory_bytes=2**30, version="0.1.0", started_at=0.0,
                        worker_ports=tuple(range(base + 1, base + 1 + slots)), rendezvous_port=base + 9,
                        probe_ports=(base + 7, base + 8), draining=draining)


def snapshot(*, plan=None, epoch=0, jobs=None, states=None, reports=None, members=None, cancels=()):
    members = members if members is not None else {f"d{i}": (member(f"d{i}"), 100 + i) for i in (1, 2, 3)}
    return FleetSnapshot(revision=1000, members=members, plan=plan, plan_epoch=epoch,
                         jobs=tuple(jobs or [JobEntry("j", spec(), None, 5)]), states=states or {},
                         cancels=frozenset(cancels), reports=reports or {})


def run_plan(members=("d1", "d2", "d3")) -> PlanDoc:
    s = spec()
    ms = [(member(m), 100 + int(m[-1])) for m in members]
    return make_plan(s, ms, {"cpu": uniform_calibration(s, "cpu")}, calibrated=False, reason="t")[0]


def reports_for(plan: PlanDoc, epoch: int, outcome="running", step=3, overrides=None):
    out = {}
    for m in plan.members:
        records = []
        for s in plan.slots_on(m):
            o = (overrides or {}).get(s.rank, outcome)
            records.append(WorkerRecord(rank=s.rank, slot=s.slot, outcome=o, step=step,
                                        error="Traceback\nboom" if o == "failed" else ""))
        out[m] = WorkerReport(member=m, job="j", epoch=epoch, workers=tuple(records))
    return out


def running(epoch=50):
    return {"j": JobState(job="j", state="running", epoch=epoch, epochs=(epoch,))}


def d(snap, memory=None, now=100.0):
    return decide(snap, memory or LeaderMemory(), now=now, start_timeout=60.0)


# Plan documents a reader must refuse (the schema tests decode them, and write some into etcd).
BAD_PLANS = [
    b'{"kind":"idle","reason":12345}',
    b'{"kind":"stop","reason":"x","job":"j","stop_epoch":"abc","checkpoint":true}',
    b'{"kind":"stop","reason":"x","job":"j","stop_epoch":3,"checkpoint":"yes"}',
    b'{"kind":"run","reason":"x","job":"j","slots":[{"rank":"0"}]}',
    b'{"kind":"run","reason":"x","job":"j","incarnations":{"vm1":"lease"}}',
    b'{"kind":"idle"}',
    b'{"kind":7,"reason":"x"}',
    b'[1,2]', b'null', b'\xff\xfe', b'',
]
