"""Records in etcd that a hand or a broken tool changed: what the leader, the daemons and status
make of them (a real etcd; the fault probe that found them wrote these very values)."""

from __future__ import annotations

import dataclasses
import io
import json

from varunad.control.fleet import read_fleet
from varunad.control.jobs import JobSpec, JobState
from varunad.control.records import Progress
from varunad.ctl import commands as ctl
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

SPEC = JobSpec(job="f1", script="t.py", batch_size=8, steps=100, checkpoint_every=10, bundle_digest="0" * 64,
               bundle_bytes=1)


async def test_a_spec_overwritten_with_a_bad_value_after_submit_is_read_as_submitted(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        assert await store.create_if_absent(keys.job("f1"), SPEC.encode())
        bad = {**json.loads(SPEC.encode()), "steps": "100"}   # a string where an integer belongs
        await store.put(keys.job("f1"), json.dumps(bad))
        entry = (await read_fleet(store, keys, timeout=5)).entry("f1")
        assert entry.spec == SPEC and entry.error is None   # the leader plans on, and fails nothing
        # a valid but different spec written over it (a batch doubled mid-job) does not change the job
        await store.put(keys.job("f1"), dataclasses.replace(SPEC, batch_size=16).encode())
        entry = (await read_fleet(store, keys, timeout=5)).entry("f1")
        assert entry.spec == SPEC and entry.error is None
        assert (await ctl.job_status(store, keys, "f1"))["steps"] == SPEC.steps
        # a spec that was never valid is still refused, with the reason
        await store.put(keys.job("g1"), json.dumps({**bad, "job": "g1"}))
        entry = (await read_fleet(store, keys, timeout=5)).entry("g1")
        assert entry.spec is None and "expected an integer" in entry.error


async def test_watch_and_the_report_read_a_spec_overwritten_after_submit_as_submitted(etcd, etcd_root):
    """A storage probe wrote `12345` over a running job's spec: the fleet trained on as submitted
    and status showed the job, but `watch` and `report` failed with "job spec is not a JSON
    object", and the leader's end-of-job report was lost."""
    from varunad.ctl.progress import watch
    from varunad.report.record import collect

    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        assert await store.create_if_absent(keys.job("f1"), SPEC.encode())
        await store.put(keys.state("f1"), JobState(job="f1", state="done", epoch=9, epochs=(9,)).encode())
        await store.put(keys.job("f1"), b"12345")
        assert (await collect(store, keys, "f1")).spec == SPEC
        out = io.StringIO()
        assert await watch(store, keys, "f1", out, interval=0.05, tty=False) == 0
        assert "f1" in out.getvalue()


async def test_status_counts_only_the_ranks_of_the_epochs_plan(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("f1"), SPEC.encode())
        await store.put(keys.state("f1"), JobState(job="f1", state="running", epoch=9, epochs=(9,),
                                                   plan={"P": 1, "D": 2}).encode())
        for rank, step in ((0, 41), (1, 41), (7, 10**6)):   # rank 7: no worker of a 1x2 plan
            await store.put(keys.progress_of("f1") + str(rank),
                            Progress(job="f1", epoch=9, rank=rank, step=step, loss=1.0, samples_per_s=1.0,
                                     busy_fraction=0.5).encode())
        doc = await ctl.job_status(store, keys, "f1")
        assert doc["step"] == 42
        # no member key: no daemon is up, so nothing trains whatever the job's state says
        out = io.StringIO()
        ctl.print_job(doc, out)
        assert doc["daemons"] == 0 and "fleet     no daemon is up" in out.getvalue()
        await store.put(keys.members + "vm1", b"{}")   # any live key: the line goes
        out = io.StringIO()
        ctl.print_job(await ctl.job_status(store, keys, "f1"), out)
        assert "no daemon is up" not in out.getvalue()


async def test_a_note_about_checkpoints_is_a_warning_while_the_job_runs_and_history_after(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("f1"), SPEC.encode())
        await store.put(keys.note_entry("f1", "vm1"), json.dumps(["skipping checkpoint 5: it is incomplete"]))
        for state, word in (("running", "warning"), ("done", "noted")):
            await store.put(keys.state("f1"), JobState(job="f1", state=state, epoch=9, epochs=(9,)).encode())
            out = io.StringIO()
            ctl.print_job(await ctl.job_status(store, keys, "f1"), out)
            assert f"{word:9s} skipping checkpoint 5" in out.getvalue(), out.getvalue()


async def test_a_submit_with_no_daemon_up_is_taken_and_says_that_it_waits(etcd, etcd_root, capsys):
    """A probe's ring whose daemons had all died took a job without a word: it sat "queued
    (submitted)" with nothing to say that nothing could run it."""
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        out = io.StringIO()
        assert await ctl.submit(store, keys, SPEC, b"bundle", out) == 0
        assert "submitted f1" in out.getvalue() and await store.get(keys.job("f1")) is not None
        assert "note: no daemon is up" in capsys.readouterr().err
        await store.put(keys.members + "vm1", b"{}")
        assert await ctl.submit(store, keys, dataclasses.replace(SPEC, job="f2"), b"bundle", io.StringIO()) == 0
        assert "no daemon is up" not in capsys.readouterr().err


async def test_a_state_changed_after_the_leaders_own_write_is_not_the_jobs(etcd, etcd_root):
    """A hand-written "done" ended a running job (the probe's); now the leader's own value stands."""
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("f1"), SPEC.encode())
        mine = JobState(job="f1", state="running", epoch=7, epochs=(7,))
        revision = await store.put(keys.state("f1"), mine.encode())
        snap = await read_fleet(store, keys, timeout=5, own_states={"f1": (revision, mine)})
        assert snap.states["f1"] == mine and not snap.overwritten
        await store.put(keys.state("f1"), JobState(job="f1", state="done").encode())
        snap = await read_fleet(store, keys, timeout=5, own_states={"f1": (revision, mine)})
        assert snap.states["f1"] == mine and snap.overwritten == {"f1"}
        assert (await read_fleet(store, keys, timeout=5)).states["f1"].state == "done"   # a reader with no writes
        await store.delete(keys.state("f1"))
        snap = await read_fleet(store, keys, timeout=5, own_states={"f1": (revision, mine)})
        assert snap.states["f1"] == mine and snap.overwritten == {"f1"}


async def test_progress_and_links_kept_at_another_key_are_skipped(etcd, etcd_root):
    from varunad.control.fleet import read_progress
    from varunad.control.links import LinkMeasurement, read_links

    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        record = Progress(job="f1", epoch=9, rank=0, step=3, loss=1.0, samples_per_s=1.0, busy_fraction=0.5)
        await store.put(keys.progress_of("f1") + "0", record.encode())
        await store.put(keys.progress_of("f1") + "zz", dataclasses.replace(record, step=10**9).encode())
        assert await read_progress(store, keys, "f1") == [record]
        # the plan's ranks and the job's steps only: what the leader's stall check and status read
        await store.put(keys.progress_of("f1") + "1", dataclasses.replace(record, rank=1).encode())
        assert await read_progress(store, keys, "f1", world=1) == [record]
        assert await read_progress(store, keys, "f1", world=2, steps=3) == []
        link = LinkMeasurement(members=("vm1", "vm2"), hosts=("a", "b"), latency_s=1e-4, bandwidth_Bps=1e9,
                               allreduce_latency_s=1e-3, allreduce_Bps=1e9)
        await store.put(keys.link_pair("vm1", "vm2"), link.encode())
        await store.put(keys.link_pairs + "x/y", dataclasses.replace(link, bandwidth_Bps=1.0).encode())
        assert list((await read_links(store, keys, timeout=5)).values()) == [link]


async def test_status_names_trained_steps_whose_losses_no_daemon_wrote(etcd, etcd_root):
    """A probe killed the daemon holding rank 0 right after checkpoint 20: the next epoch resumed
    there, and the losses of steps 17-19 were in no history, with nothing said (the report said
    0 redone steps)."""
    from varunad.control.records import encode_history

    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("f1"), SPEC.encode())
        await store.put(keys.state("f1"), JobState(job="f1", state="running", epoch=12, epochs=(9, 12),
                                                   plan={"P": 1, "D": 1}).encode())
        await store.put(keys.history_entry("f1", 9, "vm1", 0), encode_history((s, 1.0) for s in range(17)))
        await store.put(keys.history_entry("f1", 12, "vm2", 0), encode_history((s, 1.0) for s in range(20, 24)))
        doc = await ctl.job_status(store, keys, "f1")
        assert doc["unrecorded"] == [[17, 19]]
        out = io.StringIO()
        ctl.print_job(doc, out)
        assert "not recorded for steps 17-19" in out.getvalue()
        # a job whose first epoch resumed at step 5 from another job's store never trained 0-4
        await store.delete(keys.history_entry("f1", 9, "vm1", 0))
        await store.put(keys.history_entry("f1", 9, "vm1", 0), encode_history((s, 1.0) for s in range(5, 20)))
        assert (await ctl.job_status(store, keys, "f1"))["unrecorded"] == []
