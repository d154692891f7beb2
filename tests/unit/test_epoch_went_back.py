"""A plan whose epoch is older than the one a daemon applied (etcd's data lost, or restored from an
older copy) was ignored without a word; the daemon now says so, once per such epoch."""

from __future__ import annotations

import asyncio
import logging

from support.decisions import run_plan

from varunad.node.follower import PlanFollowing


class _Daemon(PlanFollowing):
    def __init__(self) -> None:
        self.name = "vm1"
        self.applied_epoch = 991
        self._apply_lock = asyncio.Lock()


def test_an_older_plan_epoch_is_said_once_and_not_applied(caplog):
    d = _Daemon()
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            asyncio.run(d._apply(run_plan(), 524))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the plan's epoch 524 is older than epoch 991, which this daemon applied" in said[0]
    assert d.applied_epoch == 991
