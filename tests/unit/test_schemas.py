"""Bad values in etcd are rejected by type, in one place, and never stop a reader (issue 17).

Against a real etcd where the reader needs one: the plan's history, the leader key, the member key.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
from support.decisions import BAD_PLANS
from support.fleet import make_member

from varunad.cluster.membership import Member
from varunad.control.jobs import JobSpecError, JobState
from varunad.control.links import LinkMeasurement
from varunad.control.plans import PlanDoc
from varunad.control.records import Progress, WorkerReport, decode_history
from varunad.store import schemas

# The values the chaos run wrote (issue 17, item 1), and more of the same kind.


@pytest.mark.parametrize("value", BAD_PLANS)
def test_a_plan_of_wrong_types_is_refused_by_name(value):
    with pytest.raises(ValueError, match="plan is malformed"):
        PlanDoc.decode(value)


def test_the_error_names_the_field_and_what_it_should_be():
    with pytest.raises(ValueError, match=r"'reason': expected a string, got 12345"):
        PlanDoc.decode(BAD_PLANS[0])
    with pytest.raises(ValueError, match=r"'stop_epoch': expected an integer, got 'abc'"):
        PlanDoc.decode(BAD_PLANS[1])


def test_every_document_kind_checks_types():
    with pytest.raises(ValueError, match="'epoch': expected an integer"):
        WorkerReport.decode(json.dumps({"member": "a", "epoch": "x"}).encode())
    with pytest.raises(ValueError, match="'outcome': expected a string"):
        WorkerReport.decode(json.dumps({"member": "a", "workers": [{"rank": 0, "slot": 0, "outcome": 1}]}).encode())
    with pytest.raises(ValueError, match="'loss': expected a number"):
        Progress.decode(json.dumps({"job": "j", "epoch": 1, "rank": 0, "step": 1, "loss": "x", "samples_per_s": 1,
                                    "busy_fraction": 1}).encode())
    with pytest.raises(JobSpecError, match="'restarts': expected an integer"):
        JobState.decode(json.dumps({"job": "j", "restarts": "many"}).encode())
    good = make_member("a")
    doc = json.loads(good.encode())
    doc["started_at"] = "yesterday"
    with pytest.raises(ValueError, match="'started_at': expected a number"):
        Member.decode(json.dumps(doc).encode())
    assert Member.decode(good.encode()) == good


def _progress(**changes) -> bytes:
    return json.dumps({"job": "j", "epoch": 1, "rank": 0, "step": 1, "loss": 1.0, "samples_per_s": 1.0,
                       "busy_fraction": 0.5, **changes}).encode()


@pytest.mark.parametrize("changes", [{"step": -1}, {"rank": -2}, {"busy_fraction": -5}, {"busy_fraction": 1.5},
                                     {"samples_per_s": float("inf")}, {"compute_s": float("nan")},
                                     {"peak_bytes": -1}])
def test_progress_a_worker_cannot_report_is_refused(changes):
    """A probe's hand-written record (busy -500%, infinite samples/s) was shown by status as it was."""
    with pytest.raises(ValueError, match="progress out of range"):
        Progress.decode(_progress(**changes))


def test_progress_of_a_diverged_run_is_kept():
    assert math.isnan(Progress.decode(_progress(loss=float("nan"))).loss)


@pytest.mark.parametrize("steps", ['[[1e999, 0.0]]', '[[1.5, 0.0]]', '[["7", 0.0]]', '[[-1, 0.0]]', '[[1, "x"]]',
                                   '[[1]]', '{"1": 0.0}'])
def test_a_history_chunk_of_steps_no_worker_writes_is_a_value_error(steps):
    """1e999 raised OverflowError, which crashed `varunactl status` and lost the job's report."""
    with pytest.raises(ValueError, match="history is malformed"):
        decode_history(f'{{"steps": {steps}}}'.encode())


@pytest.mark.parametrize("changes", [{"latency_s": -1.0}, {"allreduce_latency_s": float("nan")},
                                     {"bandwidth_Bps": float("inf")}, {"allreduce_Bps": 0.0},
                                     {"members": ["a", "a"]}])
def test_a_link_measurement_the_planner_cannot_use_is_refused(changes):
    """A latency of -1 failed every plan in LinkCost: the leader restarted its loop once a second."""
    good = {"members": ["a", "b"], "hosts": ["h1", "h2"], "latency_s": 1e-4, "bandwidth_Bps": 1e9,
            "allreduce_latency_s": 1e-3, "allreduce_Bps": 1e9}
    assert LinkMeasurement.decode(json.dumps(good).encode()).latency_s == 1e-4
    with pytest.raises(ValueError):
        LinkMeasurement.decode(json.dumps({**good, **changes}).encode())


@pytest.mark.parametrize("doc", [{"member": "a", "started_at": float("nan")},
                                 {"member": "a", "workers": [{"rank": -1, "slot": 0}]},
                                 {"member": "a", "workers": [{"rank": 0, "slot": 0, "started_at": float("inf")}]}])
def test_a_worker_report_no_daemon_writes_is_refused(doc):
    with pytest.raises(ValueError):
        WorkerReport.decode(json.dumps(doc).encode())


def test_good_documents_still_round_trip():
    for doc in (PlanDoc.idle("x"), PlanDoc.stop("j", 5, checkpoint=True, reason="r")):
        assert PlanDoc.decode(doc.encode()) == doc
    assert JobState.decode(JobState(job="j", epochs=(3, 4)).encode()).epochs == (3, 4)


def test_rejections_are_counted_and_logged_once(caplog):
    seen = []
    schemas.on_reject(seen.append)
    before = schemas.rejected().get("plan", 0)
    with caplog.at_level(logging.WARNING, logger="varunad.store.schemas"):
        for _ in range(50):
            schemas.reject("plan", "/t/plan@99", "plan is malformed: x")
    assert schemas.rejected()["plan"] == before + 50
    assert seen.count("plan") == 50
    assert sum("ignored plan key /t/plan@99" in r.getMessage() for r in caplog.records) == 1


def test_json_nested_past_the_parsers_depth_is_a_value_error_for_every_reader():
    # json.loads raises RecursionError on it, which no reader caught: one such value in etcd
    # would have ended whatever loop read it.
    from varunad.cluster.fencing import stored_epoch
    from varunad.control.jobs import JobSpec
    from varunad.control.records import decode_history
    from varunad.node.signing import Signature

    deep = b"[" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        schemas.load_json(deep)
    for decode in (PlanDoc.decode, Member.decode, JobSpec.decode, JobState.decode, decode_history,
                   Signature.decode, lambda d: schemas.decode(Progress, d, "progress")):
        with pytest.raises(ValueError):
            decode(deep)
    assert stored_epoch(deep) is None


def test_a_document_is_decoded_once_per_value_and_a_bad_one_every_time():
    calls = []

    def decode(data: bytes) -> tuple:
        calls.append(data)
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        return tuple(sorted(doc.items()))

    key = "/t/decoded/members/vm1"
    first = schemas.decoded(key, b'{"a": 1}', decode)
    assert schemas.decoded(key, b'{"a": 1}', decode) is first and len(calls) == 1
    assert schemas.decoded(key, b'{"a": 2}', decode) == (("a", 2),) and len(calls) == 2   # a new value
    assert schemas.decoded("/t/decoded/members/vm2", b'{"a": 2}', decode) and len(calls) == 3   # another key
    for _ in range(2):
        with pytest.raises(ValueError):
            schemas.decoded(key, b"[1]", decode)
    assert len(calls) == 5
