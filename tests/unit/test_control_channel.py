"""The daemon-worker control socket is private: forged, stale and hijacked reports are dropped,
and stop requests that could not be sent are sent again (issue 17, items 2 and 7).

Real ZeroMQ sockets on the supervisor's real ipc:// endpoint; the worker side is the trainer's
own ControlClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from pathlib import Path

import zmq
import zmq.asyncio
from support.fleet import make_member
from support.waiting import until_async

from protocol.messages import WorkerProgress, encode
from trainer.engine.control import TOKEN_ENV, ControlClient
from varunad.cluster.facts import DaemonMember, PortReservation
from varunad.cluster.membership import Membership
from varunad.node.config import load_config
from varunad.node.supervisor import Supervisor, _SupervisedWorker
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


def _member(name: str) -> DaemonMember:
    # what a daemon announces, with no worker ports: no usable slot, so the supervisor starts no spare
    return DaemonMember(**{f: getattr(make_member(name), f) for f in make_member(name).__dataclass_fields__})


def _supervisor(tmp_path: Path, ctx: zmq.asyncio.Context) -> Supervisor:
    config = load_config(["--etcd", "127.0.0.1:1", "--store", str(tmp_path / "store"), "--plaintext",
                          "--state-dir", str(tmp_path / "state"), "--name", "vm1"], environ={})
    store = EtcdStore("127.0.0.1:1")   # never called: nothing here reports to etcd
    keys = Keys("/t/")
    return Supervisor(config=config, store=store, keys=keys, membership=Membership(store, keys, _member("vm1")),
                      ports=PortReservation("127.0.0.1"), ctx=ctx, security_env={}, peer_keys=lambda doc: {})


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path):
    """A supervisor serving its control socket, and its context; both ended on the way out."""
    ctx = zmq.asyncio.Context()
    sup = _supervisor(tmp_path, ctx)
    serving = asyncio.create_task(sup.serve())
    try:
        yield sup, ctx
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        sup.close()
        ctx.term()


def _running(sup: Supervisor, rank: int, token: str) -> _SupervisedWorker:
    w = _SupervisedWorker(job="j", epoch=5, rank=rank, slot=0, log_path=Path(os.devnull), token=token, outcome="running")
    sup.workers[rank] = w
    sup.job, sup.epoch = "j", 5
    return w


def _progress(step: int, loss: float, *, epoch: int = 5, rank: int = 0) -> bytes:
    return encode(WorkerProgress(job="j", epoch=epoch, rank=rank, step=step, loss=loss, samples_per_s=1.0,
                                 busy_fraction=0.5))


async def test_the_socket_is_a_unix_socket_in_a_private_directory(tmp_path):
    ctx = zmq.asyncio.Context()
    sup = _supervisor(tmp_path, ctx)
    try:
        assert sup.control_endpoint.startswith("ipc://")
        directory = Path(sup.channel.directory)
        st = directory.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert Path(sup.channel.path).is_socket()
    finally:
        sup.close()
        ctx.term()
    assert not directory.exists()


async def test_only_the_current_workers_identity_is_heard(tmp_path, monkeypatch):
    async with _serving(tmp_path) as (sup, ctx):
        forger = ctx.socket(zmq.DEALER)
        hijacker = ctx.socket(zmq.DEALER)
        try:
            w = _running(sup, 0, "s3cret")
            # a forger that knows job, epoch and rank but not the secret: the old 'rank-0' identity
            forger.setsockopt(zmq.IDENTITY, b"rank-0")
            forger.setsockopt(zmq.LINGER, 0)
            forger.connect(sup.control_endpoint)
            await forger.send(_progress(10000, 123.456))
            # the real worker, through the trainer's own client
            monkeypatch.setenv(TOKEN_ENV, "s3cret")
            client = ControlClient(sup.control_endpoint, job="j", epoch=5, rank=0)
            try:
                client.progress(3, 1.5, 10.0, 0.5)
                await until_async(lambda: w.step == 3, "the worker's own progress", timeout=5.0, interval=0.01)
                # a second connection claiming the worker's identity is refused (no ROUTER_HANDOVER)
                hijacker.setsockopt(zmq.IDENTITY, w.identity)
                hijacker.setsockopt(zmq.LINGER, 0)
                hijacker.connect(sup.control_endpoint)
                await hijacker.send(_progress(9999, 99.0))
                # a stale epoch with the right identity is no report of this epoch either
                await forger.send(_progress(5000, 7.0, epoch=4))
                client.progress(4, 1.25, 10.0, 0.5)
                await until_async(lambda: w.step == 4, "the worker's next progress", timeout=5.0, interval=0.01)
                await until_async(lambda: sup.line.dropped >= 2, "the forgeries dropped", timeout=5.0, interval=0.01)
                assert sup.reporter.progress[0].step == 4 and sup.reporter.progress[0].loss == 1.25
                assert sup.reporter.history("j", 5) == {3: 1.5, 4: 1.25}
                assert sup.metrics.dropped_messages._value.get() >= 2
            finally:
                client.close()
        finally:
            forger.close(0)
            hijacker.close(0)


async def test_a_diverged_steps_progress_reaches_the_daemon_and_its_record(tmp_path, monkeypatch):
    """A step whose loss is NaN (the workers agreed to skip it) was dropped by the worker's client:
    a job whose every step diverged reported none, and its leader restarted it as stuck."""
    import math

    from varunad.control.records import Progress

    async with _serving(tmp_path) as (sup, _ctx):
        w = _running(sup, 0, "tok")
        monkeypatch.setenv(TOKEN_ENV, "tok")
        client = ControlClient(sup.control_endpoint, job="j", epoch=5, rank=0)
        try:
            client.progress(3, 2.0, 10.0, 0.5)
            client.progress(4, math.nan, math.inf, math.nan, compute_s=math.nan)   # and a timing of zero length
            await until_async(lambda: w.step == 4, "the diverged step's progress", timeout=5.0, interval=0.01)
            kept = sup.reporter.progress[0]
            assert kept.step == 4 and math.isnan(kept.loss)
            assert kept.samples_per_s == 0.0 and kept.busy_fraction == 0.0 and kept.compute_s == 0.0
            again = Progress.decode(kept.encode())   # as etcd keeps it and the leader reads it
            assert again.step == 4 and math.isnan(again.loss)
            history = sup.reporter.history("j", 5)
            assert history[3] == 2.0 and math.isnan(history[4])
        finally:
            client.close()


async def test_a_stop_is_delivered_even_after_a_failed_send(tmp_path, monkeypatch):
    """A send to a worker that is not connected fails inside the asyncio future; the stop must
    still reach the worker when it next speaks, and is repeated until it exits."""
    ctx = zmq.asyncio.Context()
    sup = _supervisor(tmp_path, ctx)
    serving = asyncio.create_task(sup.serve())
    try:
        w = _running(sup, 0, "tok")
        w.connected = True   # believed connected, but no worker is: the send fails (EHOSTUNREACH)
        sup.stop("j", 5, checkpoint=True, reason="preemption notice", grace=60)
        await until_async(lambda: w.pending, "the failed stop kept for later", timeout=5.0, interval=0.01)
        monkeypatch.setenv(TOKEN_ENV, "tok")
        client = ControlClient(sup.control_endpoint, job="j", epoch=5, rank=0)
        try:
            client.progress(1, 2.0, 1.0, 0.5)

            def got_stop():
                client.poll()
                return client.stop_requested and client.checkpoint_requested

            await until_async(got_stop, "the stop at the worker", timeout=5.0, interval=0.01)
        finally:
            client.close()
    finally:
        for task in [serving] + [w.kill_task for w in sup.workers.values() if w.kill_task]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sup.close()
        ctx.term()


async def test_a_stop_kills_a_calibration_run_at_once_and_asks_a_training_worker(tmp_path):
    """A calibration run has nothing to save and never reads a stop: a daemon shutting down (a
    preemption notice) waited the whole stop grace for it, and `varunactl down` had to SIGKILL
    the daemon (a probe)."""
    from varunad.node.supervisor import WorkerProcess

    ctx = zmq.asyncio.Context()
    sup = _supervisor(tmp_path, ctx)
    procs = []
    try:
        for rank, profile in ((0, str(tmp_path / "cal.json")), (1, None)):
            proc = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
            procs.append(proc)
            w = _running(sup, rank, f"t{rank}")
            w.profile_path, w.proc = profile, WorkerProcess(proc)
        assert sup.stop(None, None, checkpoint=True, reason="vm1 is shutting down") == 2
        assert await asyncio.wait_for(procs[0].wait(), 5) == -9   # the calibration run: killed now
        assert sup.workers[0].killed_by_daemon and procs[1].returncode is None
        assert sup.workers[1].kill_task is not None   # the training worker: asked, killed after the grace
    finally:
        for w in sup.workers.values():
            if w.kill_task is not None:
                w.kill_task.cancel()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        sup.close()
        ctx.term()


async def test_an_earlier_epochs_unshipped_log_lines_are_still_shipped_after_a_new_epoch_begins(tmp_path):
    """A probe's job printed thousands of lines and raised: its retry began at once, and the first
    attempt's last lines, the traceback among them, never reached `varunactl logs`."""
    ctx = zmq.asyncio.Context()
    sup = _supervisor(tmp_path, ctx)
    try:
        done = tmp_path / "e5-r0.log"
        done.write_bytes(b"shipped\n")
        old = _running(sup, 0, "t0")
        old.log_path, old.log_offset = done, done.stat().st_size
        with open(done, "ab") as f:
            f.write(b"Traceback (most recent call last):\nValueError: at step 3\n")
        sup._begin("j", 6)
        new = _running(sup, 0, "t1")
        shipping = sup.reporter._workers()
        assert shipping == [old, new] and old.log_end == done.stat().st_size
        with open(done, "ab") as f:
            f.write(b"a later worker's line in the same file\n")   # not the earlier worker's to ship
        old.log_offset = old.log_end   # what the shipper does once it wrote the chunk
        assert sup.reporter._workers() == [new]
    finally:
        sup.close()
        ctx.term()
