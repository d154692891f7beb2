"""An etcd outage is not a VM loss: which members of a running plan are really gone.

When etcd stalls or restarts for longer than the TTL, every lease lapses at once: each daemon
registers again under a new lease, so to etcd the whole fleet looks replaced. Its VMs and their
workers never stopped, though, and re-planning would throw away every step since the last
checkpoint. So losing a member is decided by evidence from the member, not by etcd's pause:

* a member registered again under a new lease (a new incarnation) whose report shows live
  workers of the running epoch kept them through the outage: it is still in the plan (while
  its report has not been written again yet, it is awaited like an absent one);
* a member whose key is absent while *this* daemon has just seen etcd fail (its own renewal
  failed or it registered again) is given ``grace`` seconds to come back before it is counted
  lost: its daemon is most likely reconnecting, as this one did;
* a member whose key is absent or does not parse (a stray ``etcdctl del`` or ``put``) while the
  lease it was planned under still lives is given until ``restoring_until[m]`` to write it back:
  its daemon is renewing that lease, and watches its key, so it writes it again at once;
* otherwise (no key, and etcd has been healthy here; or a new incarnation without live workers:
  a restarted daemon) the member is gone, and the epoch is broken.

The same rule covers a single VM cut off from etcd while the others still reach it: the leader
has seen no failure, so the VM counts as lost when its lease ends, the job re-plans without it,
and when the VM reconnects it finds a newer plan and stops its workers (the daemon applies every
newer plan: a ``stop`` of its epoch, or a ``run`` without it). A daemon keeps its workers while
it cannot reach etcd; a newer plan, not the outage, decides their fate.
"""

from __future__ import annotations

from collections.abc import Mapping

from varunad.control.plans import PlanDoc
from varunad.control.records import WorkerReport

__all__ = ["Verdict", "judge_members"]


class Verdict:
    """The members of a plan that are gone, and those still awaited after an etcd outage."""

    __slots__ = ("gone", "awaited", "restoring")

    def __init__(self, gone: list[str], awaited: list[str], restoring: list[str] | None = None) -> None:
        self.gone, self.awaited, self.restoring = gone, awaited, restoring or []


def judge_members(plan: PlanDoc, epoch: int, members: Mapping[str, tuple[object, int]],
                  reports: Mapping[str, WorkerReport], *, now: float, outage_until: float,
                  restoring_until: Mapping[str, float] | None = None) -> Verdict:
    """``members``: name -> (facts, lease id) as registered now; ``outage_until``: until when (on
    ``now``'s clock) absent members are awaited because this daemon saw etcd fail (0: it did not);
    ``restoring_until``: for a member whose key is missing while its lease lives, until when its key
    is awaited back."""
    gone, awaited, restoring = [], [], []
    for m in plan.members:
        if m not in members:
            if now < (restoring_until or {}).get(m, 0.0):
                restoring.append(m)
            else:
                (awaited if now < outage_until else gone).append(m)
            continue
        planned = plan.incarnations.get(m)
        if planned is None or members[m][1] == planned:
            continue
        report = reports.get(m)
        if report is None and now < outage_until:
            awaited.append(m)  # registered again; its report (on the new lease) follows in a moment
            continue
        # A report of this very epoch under the new lease: the daemon kept its workers through the
        # outage (a restarted daemon has none of this epoch). They may have finished meanwhile.
        kept = report is not None and report.job == plan.job and report.epoch == epoch and bool(report.workers)
        if not kept:
            gone.append(m)
    return Verdict(gone, awaited, restoring)
