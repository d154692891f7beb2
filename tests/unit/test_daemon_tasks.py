"""A daemon task that fails is restarted with back-off, logged and counted (issue 17, item 1):
one failing task no longer ends the daemon and with it the fleet's job."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from varunad.node.config import load_config
from varunad.node.daemon import Daemon


async def test_a_failing_task_is_restarted_and_counted(tmp_path, caplog):
    config = load_config(["--etcd", "127.0.0.1:1", "--store", str(tmp_path / "store"), "--plaintext",
                          "--state-dir", str(tmp_path / "state"), "--name", "vm1"], environ={})
    daemon = Daemon(config)
    runs = []
    settled = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise TypeError("'int' object is not subscriptable")   # the bug that used to end every daemon
        settled.set()
        await asyncio.sleep(3600)

    try:
        with caplog.at_level(logging.ERROR, logger="varunad"):
            task = asyncio.create_task(daemon._keep_running("plan-follower", flaky))
            await asyncio.wait_for(settled.wait(), 10)
        assert len(runs) == 3 and not task.done()
        assert daemon.failures == {"plan-follower": 2}
        assert daemon.metrics.task_restarts.labels(task="plan-follower")._value.get() == 2
        assert sum("task plan-follower failed" in r.getMessage() for r in caplog.records) == 2
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        daemon.security.close()
        daemon.ctx.term()
