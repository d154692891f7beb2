"""A checkpoint store that is full, read-only or failing: the error it raises and the retries.

Units here; a job through a store that fills up mid-run is in test_store_outage_job.py.

The tests of tests/unit/test_store_outage.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import fences
from trainer.checkpoint import store as ckpt_store
from trainer.errors import CheckpointError, StoreOutage


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount ({' '.join(args)}): {proc.stderr.strip()}; these tests need root in a "
                    "mount namespace that allows tmpfs and bind mounts")


@contextlib.contextmanager
def tmpfs(path, size: str):
    os.makedirs(path, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(path):
    """`path` (a directory) seen read-only through a bind mount over itself; root ignores chmod."""
    _mount(["--bind", str(path), str(path)])
    try:
        _mount(["-o", "remount,ro,bind", str(path)])
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- what the code paths see on a real full or read-only store ---------------------------------------

def test_torch_save_into_a_full_store_raises_the_outage_and_leaves_no_file(tmp_path):
    with tmpfs(tmp_path / "full", "256k") as store:
        ckpt = os.path.join(store, "varuna_ckpt_3")
        with pytest.raises(StoreOutage) as info:
            ckpt_store.write_tensors(ckpt, "layer.0.pt", {"w": torch.randn(256, 1024)})
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(ckpt) == []   # the temporary went with the failed write
        # a small file still fits: the store works, it is only full for this one
        ckpt_store.write_tensors(ckpt, "small.pt", {"w": torch.zeros(4)})


def test_a_fence_on_a_read_only_store_is_an_outage_naming_the_step_it_resumes_from(tmp_path):
    (tmp_path / "store").mkdir()
    with read_only(tmp_path / "store") as store:
        with pytest.raises(StoreOutage) as info:
            fences.write_epoch_fence(store, 7, 20)
    assert info.value.errno == errno.EROFS and info.value.step == 20
    fences.write_epoch_fence(str(tmp_path / "store"), 7, 20)   # writable again: it goes through
    assert fences.read_epoch_fences(str(tmp_path / "store")) == {7: 20}


# --- a staged checkpoint whose store takes one worker's share and refuses another's -------------------

def test_rank_0_stops_waiting_for_a_share_the_store_refused(tmp_path):
    from trainer.checkpoint import reading
    from trainer.checkpoint.contents import COMMIT_TIMEOUT_S, Upload

    store = tmp_path / "store"
    final = reading.checkpoint_dir(str(store), 7)
    staged = []
    for rank in (0, 1):
        stage = reading.checkpoint_dir(str(tmp_path / "staging" / f"rank{rank}"), 7)
        staged.append((stage, [ckpt_store.write_tensors(stage, f"layer_{rank}.pt", {"w": torch.full((4,), 1.0)})]))
    up0 = Upload(staged[0][0], final, staged[0][1], iteration=7, token="ab" * 8, rank=0, world=2, meta={})
    assert up0.shared.wait(30) and up0.share_error is None   # rank 0's share is in, it waits for rank 1's
    assert COMMIT_TIMEOUT_S > 60 and not up0.wait(0.3)
    with read_only(store):   # then the store refuses rank 1's
        up1 = Upload(staged[1][0], final, staged[1][1], iteration=7, token="ab" * 8, rank=1, world=2, meta=None)
        assert up1.wait(30)
    assert isinstance(up1.share_error, StoreOutage) and up1.share_error.errno == errno.EROFS
    assert up1.shared.is_set()
    up0.abandon()   # what the workers agree at the next checkpoint (Varuna._compare_shares)
    assert up0.wait(30)
    assert isinstance(up0.error, CheckpointError) and "another worker could not write" in str(up0.error)
    assert ckpt_store.latest_complete(str(store)) is None   # never committed
    # and neither keeps its files in the store: it needs the space, and they will never be committed
    assert [p.name for p in Path(final).glob("*.pt")] == []
