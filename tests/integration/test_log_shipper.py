"""varunad.node.log_shipper against a real etcd: worker output shipped in prefixed chunks, refusals noted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from varunad.node import log_shipper
from varunad.node.log_shipper import LogShipper
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys


@dataclass
class _Log:
    job: str
    epoch: int
    rank: int
    log_path: Path
    log_offset: int = 0
    alive: bool = False


async def _chunks(store, keys, job, member) -> list[bytes]:
    return [kv.value for kv in await store.get_prefix(keys.logs_of_member(job, member))]


async def test_new_output_goes_to_etcd_once_with_a_prefix_and_refusals_become_notes(etcd, etcd_root, tmp_path):
    keys = Keys(etcd_root)
    path = tmp_path / "e3-r1.log"
    path.write_bytes(b"before this worker\n")
    w = _Log(job="j", epoch=3, rank=1, log_path=path, log_offset=path.stat().st_size)
    async with EtcdStore(etcd.endpoint) as store:
        shipper = LogShipper(name="vm1", store=store, keys=keys)
        with open(path, "ab") as f:
            f.write(b"step 1\nskipping checkpoint 20: digest mismatch in shard 0\n")
        await shipper.ship([w], timeout=5.0)
        assert await _chunks(store, keys, "j", "vm1") == [
            b"[vm1 e3 r1] step 1\n[vm1 e3 r1] skipping checkpoint 20: digest mismatch in shard 0\n"]
        assert w.log_offset == path.stat().st_size
        note = await store.get(keys.note_entry("j", "vm1"))
        assert json.loads(note.value) == ["epoch 3 rank 1 on vm1: skipping checkpoint 20: digest mismatch in shard 0"]

        await shipper.ship([w], timeout=5.0)  # nothing new: nothing written
        assert len(await _chunks(store, keys, "j", "vm1")) == 1

        # only the newest chunks stay, in order
        for i in range(log_shipper._CHUNKS_KEPT + 2):
            with open(path, "ab") as f:
                f.write(f"line {i}\n".encode())
            await shipper.ship([w], timeout=5.0)
        kept = await _chunks(store, keys, "j", "vm1")
        assert len(kept) == log_shipper._CHUNKS_KEPT
        assert kept[0] == b"[vm1 e3 r1] line 2\n" and kept[-1] == f"[vm1 e3 r1] line {log_shipper._CHUNKS_KEPT + 1}\n".encode()


async def test_a_full_chunk_ends_at_a_line_boundary(etcd, etcd_root, tmp_path, monkeypatch):
    monkeypatch.setattr(log_shipper, "_CHUNK", 16)
    keys = Keys(etcd_root)
    path = tmp_path / "e0-r0.log"
    path.write_bytes(b"abcdef\nghijklmnopqrstuvwxyz\n")
    w = _Log(job="j", epoch=0, rank=0, log_path=path)
    async with EtcdStore(etcd.endpoint) as store:
        shipper = LogShipper(name="vm2", store=store, keys=keys)
        await shipper.ship([w], timeout=5.0)
        assert await _chunks(store, keys, "j", "vm2") == [b"[vm2 e0 r0] abcdef\n"]
        assert w.log_offset == 7


async def test_a_line_still_being_written_is_shipped_whole_with_one_prefix(etcd, etcd_root, tmp_path):
    """`varunactl logs` once showed "step 0 loss 4.5788260 P1xD1 mb8[vm1 e34 r0] ": the shipper
    read a line the worker had not finished and prefixed its rest again."""
    keys = Keys(etcd_root)
    path = tmp_path / "e34-r0.log"
    path.write_bytes(b"step 0 loss 4.5788260 P1xD1 mb8")
    w = _Log(job="j", epoch=34, rank=0, log_path=path, alive=True)
    async with EtcdStore(etcd.endpoint) as store:
        shipper = LogShipper(name="vm1", store=store, keys=keys)
        await shipper.ship([w], timeout=5.0)
        assert await _chunks(store, keys, "j", "vm1") == [] and w.log_offset == 0
        with open(path, "ab") as f:
            f.write(b"\nstep 1 lo")
        await shipper.ship([w], timeout=5.0)
        assert await _chunks(store, keys, "j", "vm1") == [b"[vm1 e34 r0] step 0 loss 4.5788260 P1xD1 mb8\n"]
        w.alive = False   # it exited mid-line: what it wrote goes out
        await shipper.ship([w], timeout=5.0)
        assert (await _chunks(store, keys, "j", "vm1"))[-1] == b"[vm1 e34 r0] step 1 lo"
        assert w.log_offset == path.stat().st_size

