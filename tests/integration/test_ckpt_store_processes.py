"""trainer.checkpoint.store, reading, fences, storage: atomic files, manifests as commit records, finding, pruning, copying.

The tests of tests/unit/test_ckpt_store.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import multiprocessing
import queue
import time

import pytest
import torch

from trainer.checkpoint.reading import FileEntry, checkpoint_dir, read_tensors, verify
from trainer.checkpoint.store import latest_complete, write_manifest, write_tensors

# ---------------------------------------------------------------- manifest and verify


def _writer(ckpt_dir, rank, barrier, results):
    barrier.wait(timeout=60)  # start together so the writes (and makedirs) really overlap
    entries = [
        write_tensors(ckpt_dir, f"layer_{rank}_{i}.pt", {"w": torch.full((1000,), rank * 10.0 + i)})
        for i in range(5)
    ]
    results.put(entries)


def test_two_processes_write_one_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    d = checkpoint_dir(str(tmp_path), 100)  # not created yet: both writers race to create it
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(d, r, barrier, results)) for r in range(2)]
    for p in procs:
        p.start()
    entries: list[FileEntry] = []
    deadline = time.monotonic() + 90
    try:
        for _ in procs:
            while True:
                try:
                    entries += results.get(timeout=0.2)
                    break
                except queue.Empty:
                    # A writer that died (e.g. on import) must fail the test now, not at the deadline.
                    died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if died or time.monotonic() > deadline:
                        pytest.fail(f"a writer process died or hung (exit codes {died})")
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    write_manifest(d, entries, {"P": 2})
    assert len(verify(d)["files"]) == 10
    assert latest_complete(str(tmp_path)) == 100
    assert read_tensors(d, "layer_1_3.pt")["w"][0].item() == 13.0
