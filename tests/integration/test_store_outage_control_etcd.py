"""A checkpoint store outage as the control plane sees it: how a worker's failure is classified,
what the worker report, `varunactl status`/`watch` and the metrics say, and the leader's start timeout.

The worker's side is in test_store_outage.py; a whole job through a full store in test_store_outage_job.py.

The tests of tests/unit/test_store_outage_control.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

from varunad.control.records import WorkerRecord, WorkerReport

FULL = "No space left on device (/store/j/varuna_ckpt_24/layer.0.pt)"


async def test_status_says_checkpoints_are_failing_from_the_worker_reports_in_etcd(etcd, etcd_root):
    import io

    from varunad.control.jobs import JobSpec, JobState
    from varunad.ctl import commands as ctl
    from varunad.store.etcd import EtcdStore
    from varunad.store.keys import Keys

    keys = Keys(etcd_root)
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=100, checkpoint_every=10, bundle_digest="0" * 64,
                   bundle_bytes=1)
    healthy = WorkerRecord(rank=0, slot=0, outcome="running", step=30)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("j"), spec.encode())
        await store.put(keys.state("j"), JobState(job="j", state="running", epoch=9, epochs=(9,)).encode())
        await store.put(keys.workers_of("vm1"), WorkerReport(member="vm1", job="j", epoch=9,
                                                             workers=(healthy,)).encode())
        assert (await ctl.job_status(store, keys, "j"))["store_failing"] is None
        failing = WorkerRecord(rank=1, slot=0, outcome="running", step=30, store_failing_since=20, store_error=FULL)
        stale = WorkerRecord(rank=1, slot=0, outcome="stopped", store_failing_since=3, store_error="Input/output error")
        await store.put(keys.workers_of("vm2"), WorkerReport(member="vm2", job="j", epoch=9,
                                                             workers=(failing,)).encode())
        await store.put(keys.workers_of("vm3"), WorkerReport(member="vm3", job="j", epoch=8,   # an older epoch's
                                                             workers=(stale,)).encode())
        await store.put(keys.workers_of("junk"), b"not json")
        doc = await ctl.job_status(store, keys, "j")
        assert doc["store_failing"] == f"checkpoints failing since step 20: {FULL}"
        out = io.StringIO()
        ctl.print_job(doc, out)
        assert f"store     checkpoints failing since step 20: {FULL}: free space" in out.getvalue()
        await store.put(keys.state("j"), JobState(job="j", state="done", epoch=9, epochs=(9,)).encode())
        assert (await ctl.job_status(store, keys, "j"))["store_failing"] is None   # over with the job
