"""`varunactl status` of one job, read from a real etcd holding what the leader and daemons write."""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
import sys

from support import REPO

from varunad.control.jobs import JobSpec, JobState, MorphEvent
from varunad.control.records import encode_history
from varunad.ctl import commands as ctl
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


async def test_a_resumed_epoch_shows_the_step_it_is_at_not_the_highest_reached(etcd, etcd_root):
    keys = Keys(etcd_root)
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=100, checkpoint_every=10, bundle_digest="0" * 64,
                   bundle_bytes=1)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("j"), spec.encode())
        # epoch 5 reached step 76; its VM died, and epoch 9 resumed from the checkpoint at 60
        await store.put(keys.history_entry("j", 5, "vm1", 0), encode_history([(s, 3.0) for s in range(77)]))
        await store.put(keys.state("j"), JobState(job="j", state="morphing", epoch=9, epochs=(5, 9)).encode())
        before = await ctl.job_status(store, keys, "j")
        assert before["step"] == 77   # the new epoch has not reported yet: the newest known step
        await store.put(keys.history_entry("j", 9, "vm2", 0), encode_history([(60, 2.9), (61, 2.8)]))
        await store.put(keys.state("j"), JobState(job="j", state="running", epoch=9, epochs=(5, 9)).encode())
        now = await ctl.job_status(store, keys, "j")
        assert now["step"] == 62 and now["loss"] == 2.8
        assert now["redoing"] is None   # no morph recorded: nothing to explain
        lost = MorphEvent(reason="vm4 was lost (its lease ended): re-planning", from_shape="2x1", to_shape="1x1",
                          from_epoch=5, to_epoch=9, noticed_at=1.0, stopped_at=2.0, planned_at=3.0,
                          checkpoint=False, cause="vm4 was lost")
        await store.put(keys.state("j"), JobState(job="j", state="running", epoch=9, epochs=(5, 9),
                                                  morphs=(lost,)).encode())
        now = await ctl.job_status(store, keys, "j")
        assert now["redoing"] == {"first": 60, "last": 76, "cause": "vm4 was lost"}
        out = io.StringIO()
        ctl.print_job(now, out)
        assert "redoing steps 60-76 after vm4 was lost" in out.getvalue()
        assert "morphs    1\n  2x1 -> 1x1: vm4 was lost (its lease ended)" in out.getvalue()


async def test_a_fleet_lost_at_once_shows_no_rate_and_a_cancel_it_cannot_confirm_exits_1(etcd, etcd_root):
    """A probe SIGKILLed every daemon: status went on showing the dead workers' last samples/s and busy
    share as the job's, and `cancel --wait` returned 0 though nothing could confirm it."""
    from varunad.control.records import Progress

    keys = Keys(etcd_root)
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=40, checkpoint_every=5, bundle_digest="0" * 64,
                   bundle_bytes=1)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("j"), spec.encode())
        await store.put(keys.state("j"), JobState(job="j", state="running", epoch=9, epochs=(9,)).encode())
        await store.put(keys.history_entry("j", 9, "vm1", 0), encode_history([(s, 3.0) for s in range(20)]))
        await store.put(keys.progress_of("j") + "0", Progress(job="j", epoch=9, rank=0, step=19, loss=3.0,
                                                               samples_per_s=29.2, busy_fraction=0.88).encode())
        doc = await ctl.job_status(store, keys, "j")
        assert doc["daemons"] == 0 and doc["step"] == 20
        assert doc["samples_per_s"] is None and doc["busy_fraction"] is None, doc
        out = io.StringIO()
        ctl.print_job(doc, out)
        assert "samples/s" not in out.getvalue() and "no daemon is up" in out.getvalue(), out.getvalue()
        err = io.StringIO()
        assert await ctl.cancel(store, keys, "j", wait=0.5, out=io.StringIO(), err=err) == 1
        assert "not cancelled yet: no daemon is up" in err.getvalue(), err.getvalue()
        assert await store.get(keys.cancel("j")) is not None   # the request stands
        assert await ctl.cancel(store, keys, "j", wait=0, out=io.StringIO()) == 0   # asked, not waited for


def test_output_cut_short_by_a_pipe_is_not_an_error():
    """`varunactl status | head`: the reader closing the pipe early ends varunactl quietly."""
    code = ("import sys\n"
            "from varunad.ctl import cli\n"
            "def flood(args):\n"
            "    for i in range(200000):\n"
            "        print('line', i)\n"
            "    return 0\n"
            "cli._cmd_status = flood\n"
            "sys.exit(cli.main(['--etcd', '127.0.0.1:9', 'status']))\n")
    r = subprocess.run(f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} | head -2", shell=True,
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout == "line 0\nline 1\n" and r.stderr == "", r.stderr


async def test_a_queued_job_says_what_it_waits_for(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        for job in ("first", "second", "third"):
            spec = JobSpec(job=job, script="t.py", batch_size=8, steps=10, checkpoint_every=5,
                           bundle_digest="0" * 64, bundle_bytes=1)
            await store.put(keys.job(job), spec.encode())
        # nothing runs yet: the first job is the one the leader plans
        assert (await ctl.job_status(store, keys, "first"))["reason"] == "submitted"
        assert (await ctl.job_status(store, keys, "second"))["reason"] == "waiting behind first, queued first"
        # in the list, a job behind one the leader is planning (calibrating, waiting for a plan) says so
        listed = {j["job"]: j["reason"] for j in (await ctl.fleet_status(store, keys))["jobs"]}
        assert listed == {"first": "submitted", "second": "waiting behind first, queued first",
                          "third": "waiting behind first, queued first (1 more before it)"}, listed
        await store.put(keys.state("first"), JobState(job="first", state="running", epoch=3).encode())
        assert (await ctl.job_status(store, keys, "second"))["reason"] == "waiting for first"
        assert (await ctl.job_status(store, keys, "third"))["reason"] == \
            "waiting for first and 1 job(s) queued before it"
        listed = {j["job"]: j["reason"] for j in (await ctl.fleet_status(store, keys))["jobs"]}
        assert listed["second"] == "waiting for first"
        # `logs` of a job that printed nothing: an empty stdout and a note why, not silence
        out = io.StringIO()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert await ctl.logs(store, keys, "second", follow=False, out=out) == 0
        assert out.getvalue() == ""
        assert err.getvalue().startswith("second: no output from its workers or its calibration run (queued;")


def test_no_ring_here_is_one_line_naming_up_and_etcd(tmp_path):
    """No --etcd, no $VARUNAD_ETCD and no ring.json: one line that says what to do."""
    import os
    env = {k: v for k, v in os.environ.items() if k not in ("VARUNAD_ETCD",)} | {"VARUNAD_LOCAL_DIR": str(tmp_path)}
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--etcd", dead, "--timeout", "2", "status"],
                       capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"cannot reach etcd at {dead} (connection refused)" in r.stderr
    assert "`varunactl up N`" in r.stderr and "--etcd" in r.stderr and "gRPC" not in r.stderr
