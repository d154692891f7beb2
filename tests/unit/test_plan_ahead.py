"""The leader plans a morph's next epoch while the old workers stop (LeaderPlanning._plan_ahead),
and plans ahead again while it waits when the members left change: a lease that ended, a member
found silent; not while a plan ahead is still being made, nor when nothing changed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from support.decisions import member

from varunad.node.leader_planning import LeaderPlanning
from varunad.node.peers import SilentMembers


class _Planning(LeaderPlanning):
    def __init__(self) -> None:
        self.silent = SilentMembers(clients=None, ttl=10.0)
        self._ahead = None
        self._ahead_for = None
        self.asked: list[tuple[str, frozenset[str]]] = []

    def _plan_ahead(self, job, silent=frozenset()):   # what the wait asks for, not a plan
        self.asked.append((job, frozenset(silent)))


def _snap_usable(names):
    """What the stop's wait reads: the members (by name, with their leases)."""
    members = {n: (member(n), 100 + i) for i, n in enumerate(names)}
    return SimpleNamespace(members=members, usable=lambda: [members[n] for n in sorted(members)])


def test_the_wait_plans_ahead_again_only_when_the_members_left_change():
    async def main():
        p = _Planning()
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        running = asyncio.get_running_loop().create_future()
        p._ahead, p._ahead_for = done, ("j", frozenset({"d1", "d2", "d3"}))
        p._replan_ahead(_snap_usable(["d1", "d2", "d3"]), set())
        assert p.asked == []                                   # the same members: nothing to do
        p._replan_ahead(_snap_usable(["d1", "d2"]), set())     # d3's lease ended
        assert p.asked == [("j", frozenset())]
        p._replan_ahead(_snap_usable(["d1", "d2", "d3"]), {"d2"})   # d2 found silent
        assert p.asked[-1] == ("j", frozenset({"d2"}))
        p._ahead = running                                     # one being made: not a second
        p._replan_ahead(_snap_usable(["d1"]), set())
        p._ahead, p._ahead_for = done, ("j", None)             # one that has not read the fleet yet
        p._replan_ahead(_snap_usable(["d1"]), set())
        p._ahead_for = None                                    # the job finished: nothing ahead
        p._replan_ahead(_snap_usable(["d1"]), set())
        assert len(p.asked) == 2
        running.cancel()

    asyncio.run(main())
