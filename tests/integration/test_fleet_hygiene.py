"""What the leader leaves in etcd and in its log (issue 17, item 6): stale progress of ranks a
smaller plan no longer has is deleted; a junk key is logged once, not once per leader cycle."""

from __future__ import annotations

import logging

from varunad.control.fleet import forget_progress, read_fleet
from varunad.control.records import Progress
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


async def test_progress_of_ranks_a_shrunk_plan_dropped_is_forgotten(etcd, etcd_root):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        for rank in range(4):
            p = Progress(job="j", epoch=5, rank=rank, step=9, loss=1.0, samples_per_s=1.0, busy_fraction=0.5)
            await store.put(keys.progress_entry("j", rank), p.encode())
        await store.put(keys.progress_entry("other", 3), b"{}")
        assert await forget_progress(store, keys, "j", 2, timeout=3.0) == 2
        left = [kv.key for kv in await store.get_prefix(keys.progress)]
        assert left == [keys.progress_entry("j", 0), keys.progress_entry("j", 1), keys.progress_entry("other", 3)]


async def test_a_junk_member_key_is_logged_once_however_often_the_leader_reads(etcd, etcd_root, caplog):
    keys = Keys(etcd_root)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.members + "junk", b"not json")
        await store.put(keys.workers + "junk", b'{"member": 7}')
        with caplog.at_level(logging.WARNING):
            for _ in range(30):   # 30 leader cycles
                snap = await read_fleet(store, keys, timeout=3.0)
                assert snap.members == {} and snap.reports == {}
        lines = [r.getMessage() for r in caplog.records if "junk" in r.getMessage()]
        assert len(lines) == 2, lines   # one for each key, not 60
