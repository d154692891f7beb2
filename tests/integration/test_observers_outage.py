"""`varunactl watch` and `varunactl logs --follow` through an etcd pause: the fleet rides
through one, and so must whoever watches it. Both gave up after one request timeout (watch with
exit code 1, a failed job's), and `logs` blamed TLS for a killed etcd (an outside probe)."""

from __future__ import annotations

import asyncio
import io

from varunad.control.jobs import JobSpec, JobState
from varunad.ctl import commands as ctl
from varunad.ctl import progress
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

SPEC = JobSpec(job="w", script="t.py", batch_size=8, steps=4, checkpoint_every=2, bundle_digest="0" * 64,
               bundle_bytes=1)


async def test_watch_and_logs_follow_wait_out_an_etcd_pause(etcd_fault, etcd_root, capsys):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd_fault.endpoint, timeout=1.0) as store:
        await store.put(keys.job("w"), SPEC.encode())
        await store.put(keys.state("w"), JobState(job="w", state="running", epoch=3, epochs=(3,)).encode())
        await store.put(keys.log_chunk("w", "vm1", 1), b"[vm1 e3 r0] step 0\n")
        watched, logged = io.StringIO(), io.StringIO()
        watching = asyncio.create_task(progress.watch(store, keys, "w", watched, interval=0.2, tty=False))
        following = asyncio.create_task(ctl.logs(store, keys, "w", follow=True, out=logged))
        await asyncio.sleep(0.5)
        etcd_fault.pause()
        try:
            await asyncio.sleep(3.0)   # three request timeouts
            assert not watching.done() and not following.done()
        finally:
            etcd_fault.resume()
        await asyncio.sleep(1.0)
        await store.put(keys.log_chunk("w", "vm1", 2), b"[vm1 e3 r0] step 3\n")
        await store.put(keys.state("w"), JobState(job="w", state="done", epoch=3, epochs=(3,)).encode())
        assert await asyncio.wait_for(watching, 30) == 0
        assert await asyncio.wait_for(following, 30) == 0
    err = capsys.readouterr().err
    assert "etcd does not answer" in err and "still watching" in err and "still following" in err, err
    assert "etcd answers again" in err, err
    assert logged.getvalue() == "[vm1 e3 r0] step 0\n[vm1 e3 r0] step 3\n", logged.getvalue()
