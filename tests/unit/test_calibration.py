"""Calibration documents: cost formulas, JSON round trip, strict validation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainer.planning.calibration import (
    SCHEMA_VERSION,
    Calibration,
    CalibrationError,
    LinkCost,
    SegmentCost,
    SegmentProfile,
    TiedWeights,
)

LINKS = {"intra": LinkCost(1e-5, 1e10), "inter": LinkCost(1e-4, 1.25e9)}


def _cal(**kw) -> Calibration:
    args = dict(
        model="gpt-tiny@abc", device_kind="v100-16g", segments=3, micro_batch_sizes=(1, 2, 4),
        forward_s=0.01, backward_s=0.02, activation_bytes=1000, peak_activation_bytes=8000,
        param_bytes=10_000, optimizer_bytes=40_000, step_s=0.001, input_bytes=16, links=LINKS,
    )
    args.update(kw)
    return Calibration.uniform(**args)


def test_link_cost_formulas():
    link = LinkCost(latency_s=0.001, bandwidth_Bps=1e9)
    assert link.send_s(2e9) == pytest.approx(2.001)
    # one way: the sender's and the receiver's CPU per message count too
    assert LinkCost(0.001, 1e9, send_overhead_s=0.01, recv_overhead_s=0.02).send_s(2e9) == pytest.approx(2.031)
    assert link.allreduce_s(1e9, 1) == 0.0
    # ring: 2 (D-1)/D * bytes / bw + 2 (D-1) * latency
    assert link.allreduce_s(1e9, 4) == pytest.approx(2 * 3 / 4 * 1.0 + 6 * 0.001)


def test_uniform_scales_with_micro_batch_size_and_looks_up_costs():
    cal = _cal()
    assert cal.key == ("gpt-tiny@abc", "v100-16g")
    assert cal.n_segments == 3
    c4 = cal.cost(2, 4)
    assert (c4.forward_s, c4.backward_s, c4.recompute_s) == pytest.approx((0.04, 0.08, 0.04))
    assert c4.activation_bytes == 4000 and c4.peak_activation_bytes == 32000
    assert cal.input_bytes == (16, 32, 64)
    assert cal.segments[0].static_bytes == 2 * 10_000 + 40_000


def test_unmeasured_micro_batch_size_says_what_to_do():
    with pytest.raises(CalibrationError, match="micro-batch size 3 was not calibrated") as err:
        _cal().cost(0, 3)
    assert "[1, 2, 4]" in str(err.value)


def test_round_trip_bytes_and_file(tmp_path):
    cal = _cal()
    again = Calibration.from_bytes(cal.to_bytes())
    assert again == cal and hash(again) == hash(cal)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    doc = json.loads(path.read_text())
    assert doc["schema"] == "varunad.calibration" and doc["version"] == SCHEMA_VERSION


def test_round_trip_keeps_overheads_and_tied_weights():
    links = {"intra": LinkCost(1e-5, 1e10, 2e-4, 3e-4), "inter": LinkCost(1e-4, 1.25e9, 1e-4, 1e-4)}
    cal = _cal(links=links, tied=[TiedWeights((0, 2), 4096)])
    again = Calibration.from_bytes(cal.to_bytes())
    assert again == cal and again.tied == (TiedWeights((0, 2), 4096),)
    assert again.links["intra"].recv_overhead_s == 3e-4


def _v7(doc: dict) -> dict:
    doc["version"] = 7
    for seg in doc["segments"]:
        for cost in seg["costs"]:
            del cost["working_bytes"]
    return doc


def _v5(doc: dict) -> dict:
    doc = _v7(doc)
    doc["version"] = 5
    for seg in doc["segments"]:
        for cost in seg["costs"]:
            del cost["input_grad_s"], cost["weight_grad_s"], cost["split_bytes"]
    return doc


def _v4(doc: dict) -> dict:
    doc = _v5(doc)
    doc["version"] = 4
    del doc["worker_bytes"]
    return doc


def _v3(doc: dict) -> dict:
    doc = _v4(doc)
    doc["version"] = 3
    del doc["busy_slowdown"], doc["busy_load"]
    return doc


def _v2(doc: dict) -> dict:
    doc = _v3(doc)
    doc["version"] = 2
    del doc["step_bytes_add"]
    for seg in doc["segments"]:
        del seg["step_bytes"]
    return doc


def test_version_1_documents_migrate_with_no_overheads_and_no_tied_weights():
    doc = _v2(_doc())
    doc["version"] = 1
    del doc["tied"]
    for table in ("links", "allreduce"):
        for v in doc[table].values():
            del v["send_overhead_s"], v["recv_overhead_s"]
    cal = Calibration.from_dict(doc)
    assert cal.version == SCHEMA_VERSION == 8 and cal.tied == ()
    assert cal.links == LINKS and cal.links["intra"].send_overhead_s == cal.links["intra"].recv_overhead_s == 0
    assert cal.segments == _cal().segments
    doc["links"]["intra"]["send_overhead_s"] = 0.1   # a version 1 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)


def test_version_2_documents_migrate_with_no_step_temporaries():
    cal = Calibration.from_dict(_v2(_doc()))
    assert cal.step_bytes_add and all(seg.step_bytes == 0 for seg in cal.segments)
    assert cal.step_bytes(0, 3) == 0
    doc = _v2(_doc())
    doc["segments"][0]["step_bytes"] = 5   # a version 2 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)


def test_a_stages_step_temporaries_add_up_or_are_its_largest_segments():
    """A foreach optimizer holds every tensor's temporaries at once; a for-loop one, one
    tensor's at a time (trainer.profiler.steps.step_bytes_add says which)."""
    segs = tuple(SegmentProfile(100, 200, 0.0, (SegmentCost(0.0, 0.0, 0.0, 1, 1),), step) for step in (30, 50, 20))
    cal = dataclasses.replace(_cal(micro_batch_sizes=(1,)), segments=segs)
    assert cal.step_bytes(0, 3) == 100 and cal.step_bytes(1, 3) == 70 and cal.step_bytes(2, 2) == 0
    one_at_a_time = Calibration.from_bytes(dataclasses.replace(cal, step_bytes_add=False).to_bytes())
    assert not one_at_a_time.step_bytes_add
    assert one_at_a_time.step_bytes(0, 3) == 50 and one_at_a_time.step_bytes(2, 3) == 20
    assert one_at_a_time.step_bytes(1, 1) == 0
    with pytest.raises(CalibrationError, match="step_bytes"):
        SegmentProfile(1, 1, 0.0, (SegmentCost(0.0, 0.0, 0.0, 1, 1),), -1)
    with pytest.raises(CalibrationError, match="step_bytes_add"):
        dataclasses.replace(cal, step_bytes_add=1)


def test_tied_weights_are_validated():
    with pytest.raises(CalibrationError, match="increasing"):
        TiedWeights((3,), 10)
    with pytest.raises(CalibrationError, match="increasing"):
        TiedWeights((2, 1), 10)
    with pytest.raises(CalibrationError, match="param_bytes"):
        TiedWeights((0, 1), -1)
    with pytest.raises(CalibrationError, match="name segment 5 of 3"):
        _cal(tied=[TiedWeights((0, 5), 10)])


def test_value_objects_are_immutable():
    cal = _cal()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cal.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cal.links["inter"] = LinkCost(0, 1)  # type: ignore[index]
    assert isinstance(cal.segments, tuple) and isinstance(cal.segments[0].costs, tuple)


def _doc():
    return _cal().to_dict()


def _edit(path, value):
    doc = _doc()
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(doc).encode()


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("schema",), "something.else", "not a calibration document"),
        (("version",), 99, "schema version 99 is not supported"),
        (("extra",), 1, "unexpected \\['extra'\\]"),
        (("model",), _DELETE, "missing \\['model'\\]"),
        (("model",), "", "non-empty string"),
        (("micro_batch_sizes",), [2, 1, 4], "increasing"),
        (("micro_batch_sizes",), [1, 2], "one value per micro-batch size"),
        (("micro_batch_sizes",), [0, 2, 4], "must be > 0"),
        (("input_bytes",), [1, 2], "one value per micro-batch size"),
        (("segments", 0, "param_bytes"), -1, "param_bytes must be >= 0"),
        (("segments", 0, "param_bytes"), 1.5, "must be an integer"),
        (("segments", 1, "costs", 0, "forward_s"), True, "finite number"),
        (("segments", 1, "costs", 0, "backward_s"), "fast", "finite number"),
        (("segments", 2, "costs"), [], "non-empty"),
        (("segments",), [], "non-empty"),
        (("segments",), {}, "must be a list"),
        (("links", "inter"), _DELETE, "missing \\['inter'\\]"),
        (("links", "inter", "bandwidth_Bps"), 0, "must be > 0"),
        (("allreduce", "intra", "latency_s"), -0.1, "must be >= 0"),
        (("links", "intra", "recv_overhead_s"), -1e-3, "must be >= 0"),
        (("links", "intra", "send_overhead_s"), _DELETE, "missing \\['send_overhead_s'\\]"),
        (("tied",), _DELETE, "missing \\['tied'\\]"),
        (("tied",), [{"segments": [0], "param_bytes": 4}], "increasing"),
        (("version",), 0, "schema version 0 is not supported"),
    ],
)
def test_from_bytes_refuses_malformed_documents(path, value, message):
    with pytest.raises(CalibrationError, match=message):
        Calibration.from_bytes(_edit(path, value))


def test_segment_cost_count_must_match_sizes():
    doc = _doc()
    doc["segments"][1]["costs"].pop()
    with pytest.raises(CalibrationError, match="segment 1 has 2 costs for 3"):
        Calibration.from_dict(doc)


@pytest.mark.parametrize("data", [b"{", b"\xff\xfe", b"[]", b"null"])
def test_from_bytes_refuses_non_documents(data):
    with pytest.raises(CalibrationError):
        Calibration.from_bytes(data)


def test_constructors_validate_directly():
    with pytest.raises(ValueError):
        SegmentCost(1.0, 1.0, 1.0, -5, 0)
    with pytest.raises(ValueError):
        SegmentProfile(1, 1, 0.0, ())
    with pytest.raises(ValueError):
        LinkCost(0.0, float("inf") * 0)
    with pytest.raises(CalibrationError, match="link kinds"):
        _cal(links={"intra": LinkCost(0, 1)})


@pytest.mark.parametrize("foreach", [False, True])
def test_the_profiler_measures_the_optimizer_steps_temporaries(foreach):
    """Adam's for-loop step holds one tensor's `sqrt(v)` and its quotient at a time; its foreach
    step, one `sqrt(v)` per tensor, all at once. Counted tensor by tensor, whatever the allocator
    keeps; plain SGD makes none worth counting."""
    import torch

    from trainer.profiler.steps import _optimizer_factory, measure_steps, step_bytes_add

    params = [torch.nn.Parameter(torch.randn(256, 256)), torch.nn.Parameter(torch.randn(256))]
    weight = 256 * 256 * 4
    adam = _optimizer_factory(torch.optim.Adam(params, lr=1e-4, foreach=foreach))
    (_, state, temporaries), = measure_steps([params], adam, repeats=1, warmup=0)
    assert state == 2 * (weight + 256 * 4)
    if foreach:
        assert weight <= temporaries < 1.5 * weight
    else:
        assert 2 * weight <= temporaries < 2.5 * weight
    assert step_bytes_add(adam) is foreach
    sgd = _optimizer_factory(torch.optim.SGD(params, lr=1e-4))
    (_, state, temporaries), = measure_steps([params], sgd, repeats=1, warmup=0)
    assert state == 0 and temporaries < 1024


def test_version_3_documents_migrate_with_no_busy_slowdown():
    cal = Calibration.from_dict(_v3(_doc()))
    assert cal.busy_slowdown == cal.busy_load == 0.0 and cal.segments == _cal().segments
    doc = _v3(_doc())
    doc["busy_slowdown"] = 1.5   # a version 3 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)
    busy = dataclasses.replace(_cal(), busy_slowdown=1.5, busy_load=1.0)
    again = Calibration.from_bytes(busy.to_bytes())
    assert (again.busy_slowdown, again.busy_load) == (1.5, 1.0)
    with pytest.raises(CalibrationError, match="busy_slowdown"):
        dataclasses.replace(_cal(), busy_slowdown=-1.0)


def test_version_4_documents_migrate_with_no_worker_bytes():
    cal = Calibration.from_dict(_v4(_doc()))
    assert cal.worker_bytes == 0 and cal.segments == _cal().segments
    doc = _v4(_doc())
    doc["worker_bytes"] = 1   # a version 4 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)
    held = dataclasses.replace(_cal(), worker_bytes=67_108_864)
    assert Calibration.from_bytes(held.to_bytes()).worker_bytes == 67_108_864
    with pytest.raises(CalibrationError, match="worker_bytes"):
        dataclasses.replace(_cal(), worker_bytes=-1)
    with pytest.raises(CalibrationError, match="worker_bytes"):
        dataclasses.replace(_cal(), worker_bytes=1.5)


def test_version_5_documents_migrate_with_no_split_backward_times():
    cal = Calibration.from_dict(_v5(_doc()))
    assert cal.segments == _cal().segments
    assert all(c.input_grad_s is None and c.weight_grad_s is None for seg in cal.segments for c in seg.costs)
    doc = _v5(_doc())
    doc["segments"][0]["costs"][0]["input_grad_s"] = 0.1   # a version 5 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)
    split = SegmentCost(1.0, 2.0, 1.0, 1, 1, input_grad_s=0.9, weight_grad_s=1.2, split_bytes=512)
    base = _cal()
    measured = dataclasses.replace(base, segments=tuple(dataclasses.replace(seg, costs=(split,) * len(seg.costs))
                                                        for seg in base.segments))
    assert Calibration.from_bytes(measured.to_bytes()) == measured
    with pytest.raises(CalibrationError, match="measured together"):
        SegmentCost(1.0, 2.0, 1.0, 1, 1, input_grad_s=0.9)
    with pytest.raises(CalibrationError, match="weight_grad_s"):
        SegmentCost(1.0, 2.0, 1.0, 1, 1, input_grad_s=0.9, weight_grad_s=-1.0)
    with pytest.raises(CalibrationError, match="split_bytes"):
        SegmentCost(1.0, 2.0, 1.0, 1, 1, split_bytes=1.5)


def test_version_7_documents_migrate_with_no_working_bytes():
    cal = Calibration.from_dict(_v7(_doc()))
    assert cal.segments == _cal().segments
    assert all(c.working_bytes is None for seg in cal.segments for c in seg.costs)
    doc = _v7(_doc())
    doc["segments"][0]["costs"][0]["working_bytes"] = 5   # a version 7 document has none
    with pytest.raises(CalibrationError, match="unexpected"):
        Calibration.from_dict(doc)
    base = _cal()
    working = SegmentCost(1.0, 2.0, 1.0, 1, 1, working_bytes=4096)
    measured = dataclasses.replace(base, segments=tuple(dataclasses.replace(seg, costs=(working,) * len(seg.costs))
                                                        for seg in base.segments))
    assert Calibration.from_bytes(measured.to_bytes()) == measured
    with pytest.raises(CalibrationError, match="working_bytes"):
        SegmentCost(1.0, 2.0, 1.0, 1, 1, working_bytes=-1)


def _stored(version: int, kinds) -> dict[str, bytes]:
    import json

    return {kind: json.dumps({**json.loads(dataclasses.replace(_cal(), device_kind=kind).to_bytes()),
                              "version": version}).encode() for kind in kinds}


_SPEC_KW = dict(job="j", script="t.py", batch_size=8, steps=2, checkpoint_every=2, bundle_digest="0" * 64,
                bundle_bytes=1)


def test_a_stored_calibration_older_than_its_memory_terms_is_measured_again(caplog):
    """Version 6 left a CPU worker's process (about 300 MB) out of its worker bytes, and every
    version before 8 a pass's working memory (twice a loss's logits): a daemon that planned from
    them would promise a slot what its worker cannot keep. The current version is kept."""
    from varunad.control.jobs import JobSpec
    from varunad.control.plans import calibrations_for

    spec = JobSpec(**_SPEC_KW)
    kinds = ("cpu", "cpu-2slots", "NVIDIA H100")
    with caplog.at_level("WARNING", logger="varunad.control.plans"):
        found, missing = calibrations_for(spec, sorted(kinds), _stored(6, kinds))
    assert sorted(missing) == sorted(kinds) and found == {}
    assert "the worker's process" in caplog.text and "working memory" in caplog.text
    found, missing = calibrations_for(JobSpec(**{**_SPEC_KW, "job": "k"}), sorted(kinds), _stored(7, kinds))
    assert sorted(missing) == sorted(kinds) and found == {}
    current = {k: dataclasses.replace(_cal(), device_kind=k).to_bytes() for k in kinds}
    found, missing = calibrations_for(spec, sorted(kinds), current)
    assert missing == [] and sorted(found) == sorted(kinds)
