"""A checkpoint store that is full, read-only or failing: the error it raises and the retries.

Units here; a job through a store that fills up mid-run is in test_store_outage_job.py."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import fences
from trainer.checkpoint import store as ckpt_store
from trainer.checkpoint.storage import write_error
from trainer.engine.store_outage import Backoff, StoreHealth
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


# --- what counts as an outage ------------------------------------------------------------------------

@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO])
def test_a_full_read_only_or_failing_store_is_an_outage(err):
    exc = write_error("/store/varuna_ckpt_4/meta.pt", OSError(err, os.strerror(err)))
    assert isinstance(exc, StoreOutage) and isinstance(exc, CheckpointError)
    assert (exc.errno, exc.path, exc.detail) == (err, "/store/varuna_ckpt_4/meta.pt", os.strerror(err))
    assert "free space or remount" in str(exc)


@pytest.mark.parametrize("err", [errno.EACCES, errno.ENOENT, errno.ENAMETOOLONG])
def test_other_write_errors_are_not_an_outage(err):
    exc = write_error("/store/x", OSError(err, os.strerror(err)))
    assert type(exc) is CheckpointError


def test_an_outage_crosses_a_pickle_whole_with_its_step():
    # torch.distributed's object collectives pickle it: every rank must see the same outage
    exc = StoreOutage("/store/epochs/9.json", errno.ENOSPC, "No space left on device").at_step(12)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is StoreOutage
    assert (back.path, back.errno, back.detail, back.step, str(back)) == (exc.path, exc.errno, exc.detail, 12,
                                                                         str(exc))


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


# --- back-off and the worker's view of the store -------------------------------------------------------

def test_backoff_doubles_up_to_its_cap():
    delays = Backoff(first=0.5, cap=4.0).delays()
    assert [next(delays) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="first <= cap"):
        Backoff(first=5.0, cap=1.0)
    with pytest.raises(ValueError):
        Backoff(first=0.0)


class _Daemon:
    def __init__(self) -> None:
        self.said: list[tuple] = []

    def report(self, since: int, error: str) -> None:
        self.said.append(("failing", since, error))

    def recovered(self, since: int) -> None:
        self.said.append(("recovered", since))


def _full(step: int | None = None) -> StoreOutage:
    return StoreOutage("/store/varuna_ckpt_8/meta.pt", errno.ENOSPC, "No space left on device", step=step)


def test_a_needed_write_is_retried_with_back_off_until_the_store_takes_it():
    daemon, slept = _Daemon(), []
    health = StoreHealth(rank=0, report=daemon.report, recovered=daemon.recovered)
    outcomes = [_full(), _full(), _full(), "written"]

    def write():
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert health.until_written(write, 8, "checkpoint 8", sleep=slept.append, backoff=Backoff(0.5, 1.0)) == "written"
    assert slept == [0.5, 1.0, 1.0]
    # said once when it began (not at every try) and once when it ended
    assert daemon.said == [("failing", 8, "No space left on device (/store/varuna_ckpt_8/meta.pt)"),
                           ("recovered", 8)]
    assert not health.failing


def test_any_other_error_ends_the_wait_at_once():
    health = StoreHealth(rank=0, report=lambda *a: None, recovered=lambda s: None)

    def write():
        raise CheckpointError("checkpoint 8 has no layer.3.pt")

    with pytest.raises(CheckpointError, match="no layer.3.pt"):
        health.until_written(write, 8, "checkpoint 8", sleep=lambda s: pytest.fail("slept on a real error"))


def test_a_stop_ends_the_wait_with_the_outage():
    asked = iter([False, True])
    health = StoreHealth(rank=0, report=lambda *a: None, recovered=lambda s: None)

    def write():
        raise _full()

    slept: list[float] = []
    with pytest.raises(StoreOutage):
        health.until_written(write, 8, "the new epoch's fence", sleep=slept.append, give_up=lambda: next(asked))
    assert len(slept) == 1 and health.failing_since == 8


def test_the_outage_begins_at_the_step_it_names_and_is_logged_once_a_minute(caplog):
    now = [100.0]
    daemon = _Daemon()
    health = StoreHealth(rank=3, report=daemon.report, recovered=daemon.recovered, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="varuna.checkpoint"):
        health.failed(_full(step=20), 24, "the new epoch's fence")
        now[0] += 30
        health.failed(_full(), 28, "checkpoint 28")
        now[0] += 31
        health.failed(_full(), 32, "checkpoint 32")
    refusals = [r for r in caplog.records if "refuses writes" in r.getMessage()]
    assert len(refusals) == 2
    assert "since step 20" in refusals[1].getMessage() and "3 failed write(s)" in refusals[1].getMessage()
    assert daemon.said == [("failing", 20, "No space left on device (/store/varuna_ckpt_8/meta.pt)")]
    health.wrote()
    health.wrote()   # nothing was failing any more: nothing more to say
    assert daemon.said[1:] == [("recovered", 20)]


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
