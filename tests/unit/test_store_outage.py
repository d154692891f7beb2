"""A checkpoint store that is full, read-only or failing: the error it raises and the retries.

Units here; a job through a store that fills up mid-run is in test_store_outage_job.py."""

from __future__ import annotations

import errno
import logging
import os
import pickle

import pytest

from trainer.checkpoint.storage import write_error
from trainer.engine.store_outage import Backoff, StoreHealth
from trainer.errors import CheckpointError, StoreOutage

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
