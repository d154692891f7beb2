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
    log_end: int | None = None


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
        # a resumed run whose learning-rate schedule started over trains another model: status shows it
        with open(path, "ab") as f:
            f.write(b"12:00:01 ERROR varuna: learning-rate schedule started over: LambdaLR, a scheduler not given "
                    b"to set_optimizer, is at its start in this run, resumed at step 5\n")
        await shipper.ship([w], timeout=5.0)
        note = await store.get(keys.note_entry("j", "vm1"))
        assert json.loads(note.value)[-1] == ("epoch 3 rank 1 on vm1: learning-rate schedule started over: LambdaLR, a "
                                              "scheduler not given to set_optimizer, is at its start in this run, "
                                              "resumed at step 5")



async def test_the_newest_output_stays_and_a_marker_says_what_went_and_where_it_all_is(etcd, etcd_root, tmp_path,
                                                                                      monkeypatch):
    """A count of chunks kept a busy job's last 30 s, one chunk a tick, and `varunactl logs` then
    began mid-run without a word (a probe): now bytes are counted, and a marker listed first says
    how much went and where the whole logs are."""
    from io import StringIO

    from varunad.ctl import commands

    line = len(b"[vm1 e3 r1] line 10\n")
    monkeypatch.setattr(log_shipper, "_KEPT_BYTES", 3 * line)
    keys = Keys(etcd_root)
    path = tmp_path / "logs" / "j" / "e3-r1.log"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    w = _Log(job="j", epoch=3, rank=1, log_path=path)
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("j"), b"{}")
        shipper = LogShipper(name="vm1", store=store, keys=keys)
        for i in range(10, 16):
            with open(path, "ab") as f:
                f.write(f"line {i}\n".encode())
            await shipper.ship([w], timeout=5.0)
        kept = await _chunks(store, keys, "j", "vm1")
        assert kept[1:] == [f"[vm1 e3 r1] line {i}\n".encode() for i in (13, 14, 15)], kept
        assert kept[0] == (f"[vm1] ({3 * line} bytes of earlier output dropped here: etcd keeps the last 0 MiB of "
                           f"each daemon's; the whole logs are in {path.parent} on vm1)\n").encode(), kept[0]
        out = StringIO()
        await commands.logs(store, keys, "j", follow=False, out=out)
        assert out.getvalue().splitlines()[0].startswith("[vm1] (60 bytes of earlier output dropped"), out.getvalue()
        assert out.getvalue().splitlines()[1:] == [f"[vm1 e3 r1] line {i}" for i in (13, 14, 15)]


async def test_a_full_chunk_ends_at_a_line_boundary(etcd, etcd_root, tmp_path, monkeypatch):
    monkeypatch.setattr(log_shipper, "_CHUNK", 16)
    keys = Keys(etcd_root)
    path = tmp_path / "e0-r0.log"
    path.write_bytes(b"abcdef\nghijklmnopqrstuvwxyz\n")
    w = _Log(job="j", epoch=0, rank=0, log_path=path)
    async with EtcdStore(etcd.endpoint) as store:
        shipper = LogShipper(name="vm2", store=store, keys=keys)
        await shipper.ship([w], timeout=5.0)   # a burst goes out in one call, chunk by chunk
        assert await _chunks(store, keys, "j", "vm2") == [
            b"[vm2 e0 r0] abcdef\n", b"[vm2 e0 r0] ghijklmnopqrstuv", b"[vm2 e0 r0] wxyz\n"]   # a line longer than a chunk
        assert w.log_offset == path.stat().st_size


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



async def test_an_earlier_workers_log_is_shipped_up_to_where_it_ended(etcd, etcd_root, tmp_path):
    """A later worker may append to the same file: the earlier one's record ships only its own lines."""
    keys = Keys(etcd_root)
    path = tmp_path / "e3-r0.log"
    path.write_bytes(b"mine\nTraceback: mine too\n")
    ended = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"the next worker's\n")
    w = _Log(job="j", epoch=3, rank=0, log_path=path, log_end=ended)
    async with EtcdStore(etcd.endpoint) as store:
        shipper = LogShipper(name="vm1", store=store, keys=keys)
        await shipper.ship([w], timeout=5.0)
        assert await _chunks(store, keys, "j", "vm1") == [b"[vm1 e3 r0] mine\n[vm1 e3 r0] Traceback: mine too\n"]
        assert w.log_offset == ended
