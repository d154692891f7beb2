"""A daemon task that fails is restarted with back-off, logged and counted (issue 17, item 1):
one failing task no longer ends the daemon and with it the fleet's job."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from varunad.node.config import load_config
from varunad.node.daemon import Daemon


@pytest.fixture
def daemon(tmp_path):
    """A daemon that is built but not started: its tasks run only where a test starts them."""
    config = load_config(["--etcd", "127.0.0.1:1", "--store", str(tmp_path / "store"), "--plaintext",
                          "--state-dir", str(tmp_path / "state"), "--name", "vm1"], environ={})
    built = Daemon(config)
    yield built
    built.security.close()
    built.ctx.term()


async def test_a_failing_task_is_restarted_and_counted(daemon, caplog):
    runs = []
    settled = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise TypeError("'int' object is not subscriptable")   # the bug that used to end every daemon
        settled.set()
        await asyncio.sleep(3600)

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


async def test_a_cancellation_nobody_asked_for_restarts_the_task_and_a_real_one_ends_it(daemon, caplog):
    """gRPC cancels the calls in flight on a channel another task closes: that CancelledError once
    ended the daemon's registration task as if the daemon had cancelled it, and the daemon, seeing
    a task done, shut down (the chaos scenario etcd-lose-quorum, 'daemons exited that the fault did
    not touch')."""
    runs = []
    settled = asyncio.Event()

    async def cut_off() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise asyncio.CancelledError()   # raised from inside, as grpc.aio does
        settled.set()
        await asyncio.sleep(3600)

    with caplog.at_level(logging.ERROR, logger="varunad"):
        task = asyncio.create_task(daemon._keep_running("registration", cut_off))
        await asyncio.wait_for(settled.wait(), 10)
    assert len(runs) == 2 and not task.done()
    assert daemon.failures == {"registration": 1}
    assert any("unrequested cancellation" in r.getMessage() for r in caplog.records)
    task.cancel()   # the daemon's own cancellation still ends it
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_new_epoch_waits_out_an_etcd_read_that_failed_but_not_a_bad_bundle(daemon, monkeypatch):
    """At 300 hollow VMs some reads of the job's files timed out as every VM read them at once;
    each was reported as a failed epoch until three restarts failed the job."""
    from varunad.control.jobs import BundleError
    from varunad.store.contract import StoreUnavailable

    monkeypatch.setattr("varunad.node.follower.FILES_PATIENCE", 5.0)
    calls = []

    async def files(job):
        calls.append(job)
        if len(calls) <= 2:
            raise StoreUnavailable("etcd did not answer get '/varunad/jobs/j' within 2.5s")
        return "spec", "script"

    daemon._job_files = files
    assert await daemon._job_files_patiently("j") == ("spec", "script") and len(calls) == 3

    async def bad(job):
        calls.append(job)
        raise BundleError("the bundle of j holds no train.py")

    calls.clear()
    daemon._job_files = bad
    with pytest.raises(BundleError):
        await daemon._job_files_patiently("j")
    assert len(calls) == 1   # a wrong bundle is not read again

    async def down(job):
        raise StoreUnavailable("etcd is down")

    monkeypatch.setattr("varunad.node.follower.FILES_PATIENCE", 0.5)
    daemon._job_files = down
    with pytest.raises(StoreUnavailable):   # bounded: the epoch then fails as before
        await daemon._job_files_patiently("j")


async def test_a_task_that_loses_a_cancellation_is_cancelled_again_while_the_daemon_stops(daemon):
    """Python 3.11's wait_for can drop a cancellation that lands as its inner call completes: a
    leader loop around it then ran on, and `varunactl down` had to kill the daemon."""
    swallowed = []

    async def loses_one() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)

    task = asyncio.create_task(loses_one(), name="leader")
    await asyncio.sleep(0)
    await asyncio.wait_for(daemon._end(task, 5.0), 10)
    assert task.cancelled() and swallowed == [1]


async def test_a_task_that_never_stops_is_left_behind_with_where_it_was(daemon, caplog):
    released = asyncio.Event()

    async def stubborn() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn(), name="election")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="varunad"):
        await asyncio.wait_for(daemon._end(task, 1.0), 10)
    assert not task.done()
    assert any("task election did not stop within 1.0s" in r.getMessage() and "stubborn" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    released.set()   # so that the test's loop can end
    task.cancel()
    await asyncio.wait_for(task, 5)
