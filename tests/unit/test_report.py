"""The job report: its data (loss, cost arithmetic, price table, simulated and measured timelines),
its matplotlib pictures, the message when matplotlib is missing, and one real daemon job whose
`varunactl report` is checked file by file."""

from __future__ import annotations

import json
import os

import pytest
from support.calibrations import report_calibration
from support.png import png_size
from support.reports import morphed_report
from support.traces import trace_step

from trainer.engine.trace import CATEGORIES
from trainer.planning.schedule import build_table
from trainer.planning.simulator import simulate, stage_costs
from varunad.control.jobs import JobSpec, JobState, MorphEvent
from varunad.ctl.cli import main as varunactl
from varunad.report import (
    DATA_FILES,
    PICTURES,
    Interval,
    ReportInputs,
    build_report,
    cost_report,
    format_report,
    morph_losses,
    pick_measured_step,
    predict,
    run_intervals,
)
from varunad.report.cost import cost_lines
from varunad.report.pictures import draw_report
from varunad.report.prices import DEFAULT_PRICES, DevicePrice, PriceError, load_prices, price_of

# --- device time and cost ------------------------------------------------------------------------------

def _morph(to_epoch: int, frm: str, to: str, noticed: float, planned: float, from_epoch: int) -> MorphEvent:
    return MorphEvent(reason="test", from_shape=frm, to_shape=to, from_epoch=from_epoch, to_epoch=to_epoch,
                      noticed_at=noticed, stopped_at=noticed, planned_at=planned, checkpoint=True)


def test_intervals_follow_the_morphs_and_end_with_the_job():
    state = JobState(job="j", state="done", epoch=30, epochs=(10, 20, 30), plan={"P": 2, "D": 1},
                     started_at=1000.0, finished_at=9000.0,
                     morphs=(_morph(20, "2x1", "1x1", 4000.0, 4060.0, 10),
                             _morph(30, "1x1", "2x1", 6000.0, 6100.0, 20)))
    assert run_intervals(state, now=99999.0) == [
        Interval(10, "2x1", 2, 1000.0, 4060.0), Interval(20, "1x1", 1, 4060.0, 6100.0),
        Interval(30, "2x1", 2, 6100.0, 9000.0)]
    running = JobState(job="j", state="running", epoch=10, epochs=(10,), plan={"P": 3, "D": 2}, started_at=50.0)
    assert run_intervals(running, now=150.0) == [Interval(10, "3x2", 6, 50.0, 150.0)]
    assert run_intervals(JobState(job="j"), now=1.0) == []


def test_morph_losses_count_downtime_and_redone_steps():
    state = JobState(job="j", morphs=(_morph(20, "2x1", "1x1", 100.0, 130.0, 10),
                                      _morph(30, "1x1", "2x1", 200.0, 210.0, 20)))
    # epoch 10 ran steps 0..9, epoch 20 resumed at 6 (4 redone) and ran to 15, epoch 30 resumed at 15 (1 redone)
    assert morph_losses(state, {"10": [0, 9], "20": [6, 15], "30": [15, 30]}) == (40.0, 5)


def test_morph_stall_runs_from_the_last_step_to_the_first_step_after():
    # The VM vanished after epoch 10's last step at t=95; its lease expired and the leader noticed
    # at 100, re-planned by 130; the new workers started and finished their first step at 160.
    state = JobState(job="j", morphs=(_morph(20, "2x1", "1x1", 100.0, 130.0, 10),))
    steps = {"10": [0, 9], "20": [6, 15]}
    spans = {"10": [5.0, 95.0], "20": [160.0, 250.0]}   # 10 s a step in both epochs
    # stall: 160 - 95 less the one step that would have run anyway; the leader's 30 s is inside it
    assert morph_losses(state, steps, spans) == (55.0, 4)
    assert morph_losses(state, steps, spans, step_s=5.0) == (60.0, 4)
    # a daemon that records no spans: the leader's stop-and-re-plan time stands in
    assert morph_losses(state, steps, {"10": [5.0, 95.0]}) == (30.0, 4)
    # clocks that disagree never make a stall shorter than what the leader saw
    assert morph_losses(state, steps, {"10": [5.0, 95.0], "20": [100.0, 190.0]}) == (30.0, 4)


def test_a_morph_into_an_epoch_that_never_ran_is_measured_with_the_next():
    state = JobState(job="j", morphs=(_morph(20, "2x1", "1x1", 100.0, 110.0, 10),
                                      _morph(30, "1x1", "2x1", 120.0, 125.0, 20)))
    steps, spans = {"10": [0, 9], "30": [10, 19]}, {"10": [0.0, 90.0], "30": [200.0, 290.0]}
    assert morph_losses(state, steps, spans) == (100.0, 0)   # 200 - 90 - one 10 s step
    assert morph_losses(state, steps) == (15.0, 0)
    # a morph still under way when the report is made: the leader's time so far
    assert morph_losses(JobState(job="j", morphs=state.morphs[:1]), {"10": [0, 9]}, spans) == (10.0, 0)


def test_cost_arithmetic_matches_a_hand_computation():
    intervals = [Interval(1, "2x1", 2, 0.0, 3600.0), Interval(2, "1x1", 1, 3600.0, 5400.0)]
    prices = {"cpu": DevicePrice(0.18, 0.34, "test")}
    c = cost_report(intervals, {"cpu": 2}, prices, steps=100, batch_size=10, downtime_s=60.0, redone_steps=5)
    assert c["wall_s"] == 5400.0
    assert c["device_hours"] == pytest.approx(2.5)  # 2 devices x 1 h + 1 device x 0.5 h
    assert c["spot_usd"] == pytest.approx(0.45) and c["on_demand_usd"] == pytest.approx(0.85)
    assert c["samples"] == 1000
    assert c["samples_per_usd_spot"] == pytest.approx(1000 / 0.45)
    assert c["samples_per_usd_on_demand"] == pytest.approx(1000 / 0.85)
    step_s = (5400 - 60) / 105  # the wall time not spent morphing, over the steps actually run
    assert c["mean_step_s"] == pytest.approx(step_s)
    lost = 60 + 5 * step_s
    assert c["morphs"]["count"] == 1
    assert c["morphs"]["lost_s"] == pytest.approx(lost)
    assert c["morphs"]["lost_fraction"] == pytest.approx(lost / 5400)
    assert c["morphs"]["lost_device_hours"] == pytest.approx(2.5 * lost / 5400)
    assert c["on_demand_without_morphs_usd"] == pytest.approx((2.5 - 2.5 * lost / 5400) * 0.34)
    assert c["spot_saving_factor"] == pytest.approx(c["on_demand_without_morphs_usd"] / 0.45)
    # A measured step prices the redone steps instead of the mean (which holds start-ups and checkpoints).
    measured = cost_report(intervals, {"cpu": 2}, prices, steps=100, batch_size=10, downtime_s=60.0, redone_steps=5,
                           step_s=2.0)
    assert measured["morphs"]["lost_s"] == pytest.approx(60 + 5 * 2.0)


def test_restarts_are_told_apart_from_morphs_and_a_run_that_trained_nothing_claims_no_saving():
    intervals = [Interval(e, "1x2", 2, 60.0 * i, 60.0 * (i + 1)) for i, e in enumerate((1, 2, 3))]
    prices = {"NVIDIA A100-SXM4-80GB": DevicePrice(1.0, 4.0, "test")}
    c = cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, prices, steps=0, batch_size=8, downtime_s=20.0,
                    redone_steps=0, restarts=2)
    assert c["morphs"]["count"] == 0 and c["morphs"]["restarts"] == 2 and c["spot_saving_factor"]
    lines = cost_lines(c)
    assert lines[1].startswith("NVIDIA A100-SXM4-80GB ")   # the kind column fits the model's name
    assert any(ln.startswith("morphs   none, 2 restarts after a worker failed: ") for ln in lines), lines
    assert not any(ln.startswith("saving") for ln in lines), lines
    trained = cost_lines(cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, prices, steps=10, batch_size=8,
                                      downtime_s=20.0, redone_steps=0))
    assert any(ln.startswith("morphs   2: ") for ln in trained) and any(ln.startswith("saving") for ln in trained)
    # a run whose restarts cost more than spot saved blames them, not morphs it never had (a probe's report
    # said "morphs none, 1 restart..." and then "the morphs lost more than spot's price saved")
    dear = {"NVIDIA A100-SXM4-80GB": DevicePrice(3.9, 4.0, "test")}
    restarted = cost_lines(cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, dear, steps=10, batch_size=8,
                                       downtime_s=20.0, redone_steps=0, restarts=2))
    saving = [ln for ln in restarted if ln.startswith("saving")]
    assert saving and saving[0].endswith("the restarts lost more than spot's price saved"), restarted


def test_a_job_state_written_by_a_newer_release_still_loads():
    event = dict(reason="r", from_shape="1x1", to_shape="2x1", from_epoch=1, to_epoch=2, noticed_at=0.0,
                 stopped_at=1.0, planned_at=2.0, checkpoint=True)
    state = JobState(job="j", morphs=[event | {"restart": True, "added_later": 7}])
    assert state.morphs[0].restart is True and state.morphs[0].duration_s == 2.0
    assert JobState(job="j", morphs=[event]).morphs[0].restart is False   # written before restarts were marked


def test_cost_of_a_mixed_fleet_splits_by_devices_and_an_unpriced_kind_gives_no_total():
    intervals = [Interval(1, "2x2", 4, 0.0, 1800.0)]  # 2 device-hours
    prices = {"a": DevicePrice(1.0, 2.0), "b": DevicePrice(3.0, 4.0)}
    c = cost_report(intervals, {"a": 3, "b": 1}, prices, steps=10, batch_size=4, downtime_s=0.0, redone_steps=0)
    assert [r["device_hours"] for r in c["by_kind"]] == pytest.approx([1.5, 0.5])
    assert c["spot_usd"] == pytest.approx(1.5 * 1.0 + 0.5 * 3.0)
    assert c["on_demand_usd"] == pytest.approx(1.5 * 2.0 + 0.5 * 4.0)
    c = cost_report(intervals, {"a": 1, "tpu": 1}, prices, steps=10, batch_size=4, downtime_s=0.0, redone_steps=0)
    assert c["missing_prices"] == ["tpu"] and c["spot_usd"] is None and c["samples_per_usd_spot"] is None


# --- prices ----------------------------------------------------------------------------------------------

def test_a_price_file_overrides_the_kinds_it_names(tmp_path):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps({"cpu": {"spot": 0.01, "on_demand": 0.05}, "tpu": {"spot": 1, "on_demand": 4.5,
                                                                              "source": "my contract"}}))
    table = load_prices(f)
    assert table["cpu"] == DevicePrice(0.01, 0.05, f"price file {f}")
    assert table["tpu"].source == "my contract"
    assert table["v100"] == DEFAULT_PRICES["v100"]  # untouched kinds keep the defaults
    assert all(p.source and p.spot < p.on_demand for p in DEFAULT_PRICES.values())


def test_a_gpu_model_is_priced_by_its_family_and_a_shared_cpu_slot_by_its_share():
    table = load_prices()
    assert price_of(table, "NVIDIA A100-SXM4-80GB") == table["a100"]
    assert price_of(table, "NVIDIA H100 80GB HBM3") == table["h100"]
    assert price_of(table, "Tesla V100-SXM2-16GB") == table["v100"]
    assert price_of(table, "NVIDIA H200") is None and price_of(table, "NVIDIA A1000") is None   # whole words only
    half = price_of(table, "cpu-2slots")
    assert (half.spot, half.on_demand) == pytest.approx((table["cpu"].spot / 2, table["cpu"].on_demand / 2))
    assert price_of(table, "tpu-2slots") is None
    # a kind of its own in the table wins over its family
    own = DevicePrice(9.0, 10.0, "mine")
    assert price_of({**table, "NVIDIA A100-SXM4-80GB": own}, "NVIDIA A100-SXM4-80GB") is own
    intervals = [Interval(1, "1x2", 2, 0.0, 3600.0)]
    c = cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, table, steps=1, batch_size=1, downtime_s=0.0,
                    redone_steps=0)
    assert c["missing_prices"] == [] and c["on_demand_usd"] == pytest.approx(2 * table["a100"].on_demand)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not JSON"),
    ("[]", "is not a non-empty JSON object"),
    ('{"cpu": {"spot": 0.1}}', "'cpu' needs both 'spot' and 'on_demand'"),
    ('{"cpu": {"spot": -1, "on_demand": 1}}', "spot must be a number of dollars per device-hour >= 0"),
    ('{"cpu": {"spot": 1, "on_demand": "cheap"}}', "on_demand must be a number"),
    ('{"cpu": {"spot": 1, "on_demand": 2, "currency": "EUR"}}', "unknown fields"),
])
def test_a_bad_price_file_is_refused_with_the_reason(tmp_path, content, message):
    f = tmp_path / "prices.json"
    f.write_text(content)
    with pytest.raises(PriceError, match=message):
        load_prices(f)


def test_varunactl_report_refuses_a_bad_price_file_in_one_line(tmp_path, capsys):
    f = tmp_path / "prices.json"
    f.write_text('{"cpu": {"spot": 0.1}}')
    # The price file is checked before etcd is contacted: no etcd is needed to get this error.
    assert varunactl(["--etcd", "127.0.0.1:9", "report", "j", "--prices", str(f)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("varunactl report: price file") and "on_demand" in err
    assert varunactl(["--etcd", "127.0.0.1:9", "report", "j", "--prices", str(tmp_path / "none.json")]) == 1
    assert "cannot read the price file" in capsys.readouterr().err


# --- simulated and measured timelines --------------------------------------------------------------------

def test_simulated_events_cover_every_action_of_every_stage():
    P, m = 3, 5
    table = build_table("varuna", P, m, True)
    costs = stage_costs([report_calibration()] * P, [0, 1, 2, 4], 2, 2, ["inter"] * (P - 1), ["inter"] * P)
    events: list[dict] = []
    result = simulate(table, costs, events=events)
    assert simulate(table, costs).minibatch_s == result.minibatch_s  # recording changes nothing
    assert {e["pid"] for e in events} == set(range(P))
    for s in range(P):
        mine = [e for e in events if e["pid"] == s]
        assert sorted(e["name"] for e in mine) == sorted(str(a) for a in table[s])
        compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] in ("forward", "recompute",
                                                                                    "backward", "optimizer"))
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(compute, compute[1:])), "a stage computes one thing at a time"
    assert {e["cat"] for e in events} <= set(CATEGORIES)
    assert {"forward", "recompute", "backward", "send", "recv", "allreduce", "optimizer"} <= {e["cat"] for e in events}
    end = max(e["ts"] + e["dur"] for e in events if e["cat"] != "send")
    assert end == pytest.approx(result.minibatch_s * 1e6, rel=1e-6)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)


def test_predict_replays_the_plan_for_every_stage_and_replica():
    plan = {"P": 2, "D": 2, "micro_batch_size": 2, "cuts": [1], "calibrated": True, "schedule": "varuna",
            "members": ["a", "b"], "stage_kinds": ["cpu", "cpu"], "recompute": [True, False],
            "link_kinds": ["intra"], "allreduce_kinds": ["inter", "inter"], "micro_batches": 3}
    seconds, events = predict(plan, {"cpu": report_calibration().to_bytes()}, batch_size=12)
    assert seconds > 0
    assert {(e["pid"], e["tid"]) for e in events} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert not any(e["cat"] == "recompute" and e["pid"] == 1 for e in events)  # the planner's flags
    with pytest.raises(Exception, match="synthetic calibration"):
        predict({**plan, "calibrated": False}, {}, batch_size=12)
    with pytest.raises(Exception, match="no stored calibration for device kind cpu"):
        predict(plan, {}, batch_size=12)


def test_the_measured_step_is_the_newest_epochs_last_complete_one_after_warm_up(tmp_path):
    old, new = tmp_path / "traces" / "epoch7", tmp_path / "traces" / "epoch12"
    for stage in range(2):
        rec = trace_step(old, stage, 0, stage, 0, 0.0)
        rec.save()
    recs = [trace_step(new, stage, 0, stage, 4, 0.0) for stage in range(2)]
    for rec in recs:  # steps 4 (warm-up) and 5 complete; 6 only on stage 0 (a worker stopped mid-step)
        rec.events += trace_step(new, rec.stage, 0, rec.rank, 5, 10_000.0).events[4:]
    recs[0].events += trace_step(new, 0, 0, 0, 6, 20_000.0).events[4:]
    for rec in recs:
        rec.save()
    got = pick_measured_step(str(tmp_path), {12: 2})
    assert (got.epoch, got.step, got.warm, got.workers) == (12, 5, True, 2)
    assert got.duration_s == pytest.approx(3.9e-3)
    assert got.recompute_stages() == [0, 1]
    only_warm_up = pick_measured_step(str(tmp_path), {12: 3})  # epoch 12 never had all 3: fall back to epoch 7
    assert (only_warm_up.epoch, only_warm_up.step, only_warm_up.warm) == (7, 0, False)


def test_the_measured_step_is_not_one_that_ran_beside_a_checkpoint_copy(tmp_path):
    d = tmp_path / "traces" / "epoch3"
    for stage in range(2):
        rec = trace_step(d, stage, 0, stage, 4, 0.0)   # warm-up
        for step in (5, 6):   # 6 follows the checkpoint at step 6 (every 3): its copy runs beside it
            rec.events += trace_step(d, stage, 0, stage, step, 10_000.0 * step).events
        rec.save()
    assert pick_measured_step(str(tmp_path), {3: 2}, checkpoint_every=3).step == 5
    assert pick_measured_step(str(tmp_path), {3: 2}).step == 6
    assert pick_measured_step(str(tmp_path), {3: 2}, checkpoint_every=5).step == 6


def test_a_report_from_state_alone_notes_what_it_could_not_make(tmp_path):
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=4, checkpoint_every=2, bundle_digest="0" * 64,
                   bundle_bytes=1)
    state = JobState(job="j", state="done", epoch=5, epochs=(5,), started_at=100.0, finished_at=460.0,
                     plan={"P": 1, "D": 2, "micro_batch_size": 4, "calibrated": False, "device_kinds": {"cpu": 2}})
    status = {"step": 4, "epochs": {"5": [0, 3]}, "loss_history": [[0, 2.0], [1, 1.5], [2, 1.2], [3, 1.1]]}
    inputs = ReportInputs(spec=spec, state=state, status=status, calibrations={}, store_dir=str(tmp_path / "store"),
                          now=1000.0)
    out = tmp_path / "out"
    out.mkdir()
    for stale in ("timeline.png", "trace.json"):   # from an earlier report: must go
        (out / stale).write_bytes(b"stale")
    doc = build_report(inputs, out, DEFAULT_PRICES)
    assert doc["files"] == ["loss.json", "cost.json", "report.json", "report.txt"]
    assert sorted(p.name for p in out.iterdir()) == sorted(doc["files"])   # data only: no picture, nothing stale
    assert doc["cost"]["device_hours"] == pytest.approx(2 * 360 / 3600)
    assert doc["cost"]["spot_usd"] == pytest.approx(0.2 * DEFAULT_PRICES["cpu"].spot)
    assert any("no traces" in n for n in doc["notes"]) and any("synthetic calibration" in n for n in doc["notes"])
    text = (out / "report.txt").read_text()
    assert "job      j: done" in text and "0.2000 device-hours" in text and "note     measured timeline" in text
    assert json.loads((out / "report.json").read_text())["cost"] == json.loads((out / "cost.json").read_text())
    # the pictures its data allows; a note for each of the others
    drawn, notes = draw_report(out)
    assert drawn == ["loss.png", "throughput.png"]
    assert notes == ["timeline.png: no trace.json (the report's notes say why)",
                     "timeline_predicted.png: no trace_predicted.json (the report's notes say why)",
                     "speed.png: no slot speeds in report.json (none were measured, or the report predates them)"]


# --- a run with a lost VM: its data and its pictures --------------------------------------------------------

@pytest.fixture(scope="module")
def morphed(tmp_path_factory):
    """The report of a 60-step job that ran 2x2 on steps 0-27, lost vm4 (lease, re-plan), and
    resumed as 2x1 from the checkpoint at step 20, traced in the new epoch (support.reports)."""
    return morphed_report(tmp_path_factory.mktemp("morphed"))


def test_the_loss_data_marks_where_the_vm_was_lost_and_the_steps_redone(morphed):
    report, doc = morphed
    assert doc["files"] == list(DATA_FILES) and doc["notes"] == []
    loss = json.loads((report / "loss.json").read_text())
    # epoch 1 reached step 27; vm4 was lost there (the mark is at 28, the step it did not finish);
    # epoch 3 resumed from the checkpoint at step 20: steps 20-27 were trained twice
    assert loss["morphs"] == [{"step": 28, "resumed": 20, "restart": False, "shapes": ["2x2", "2x1"],
                               "label": "vm4 lost"}]
    assert loss["redone"] == [[20, 27]] and len(loss["history"]) == 60
    assert doc["loss"]["morph_steps"] == [28] and doc["loss"]["redone_spans"] == [[20, 27]]
    first, second = doc["runs"]
    assert (first["shape"], first["devices"], first["after"]) == ("2x2", 4, None)
    assert first["samples_per_s"] == pytest.approx(27 * 16 / 95.0)
    assert second["after"] == {"cause": "vm4 was lost", "restart": False, "noticed_at": 1100.0}
    assert second["samples_per_s"] == pytest.approx(39 * 16 / 170.0)
    assert (second["start"], second["end"]) == (1106.0, 1300.0)
    assert "plans    2x2: steps 0-27, 4.55 samples/s; 2x1: steps 20-59, 3.67 samples/s\n" in (
        report / "report.txt").read_text()


def test_the_loss_figure_has_the_curve_the_morph_the_redone_span_and_a_legend(morphed):
    from varunad.report.draw import loss_figure

    report, _ = morphed
    (ax,) = loss_figure(json.loads((report / "loss.json").read_text())).axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step (model.iteration)", "loss")
    assert ax.get_title() == "gpt: loss per step (1 morph)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "loss", "morph (where the job stood)", "steps redone from the checkpoint"]
    curve = next(line for line in ax.lines if line.get_label() == "loss")
    assert list(curve.get_xdata()) == list(range(60)) and curve.get_ydata()[0] == pytest.approx(4.0)
    morph = next(line for line in ax.lines if line.get_label().startswith("morph"))
    assert list(morph.get_xdata()) == [28, 28] and morph.get_linestyle() == "--"
    (span,) = ax.patches
    xs = span.get_patch_transform().transform(span.get_path().vertices)[:, 0]   # x in data, whatever the patch
    assert (min(xs), max(xs)) == (19.5, 27.5)
    assert [t.get_text() for t in ax.texts] == ["vm4 lost"]


def test_the_throughput_figure_shows_samples_per_second_and_the_devices_over_time(morphed):
    from varunad.report.draw import throughput_figure

    _, doc = morphed
    top, bottom = throughput_figure(doc).axes
    assert top.get_ylabel() == "samples / s" and bottom.get_ylabel() == "devices (P × D)"
    assert bottom.get_xlabel() == "time since the job started (s)"
    assert top.get_title() == "gpt: throughput and P × D over time"
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "samples/s (mean over the plan's steps)", "start-up: workers start, build the model, load", "morph noticed",
        "no training: stop, re-plan, restart"]
    rates = [seg for coll in top.collections for seg in coll.get_segments()] if top.collections else []
    levels = sorted({round(float(seg[0][1]), 3) for seg in rates if seg[0][1] == seg[1][1] and seg[0][1] > 0})
    assert levels == [round(39 * 16 / 170.0, 3), round(27 * 16 / 95.0, 3)]
    assert [t.get_text() for t in bottom.texts] == ["2x2", "2x1"]
    assert bottom.get_ylim()[1] > 4


def test_every_picture_is_a_png_drawn_from_the_data_also_with_varunactl_report_from(morphed, tmp_path, capsys):
    report, _ = morphed
    drawn, notes = draw_report(report, tmp_path / "a")
    assert drawn == list(PICTURES) and notes == []
    sizes = {name: png_size(tmp_path / "a" / name) for name in PICTURES}
    assert sizes["loss.png"] == (900, 450) and sizes["throughput.png"] == (900, 550)
    assert sizes["speed.png"] == (900, 256)   # three slots: a/0, b/0 and c/0
    for name in ("timeline.png", "timeline_predicted.png"):   # two rows: stage 0 and stage 1
        assert sizes[name] == (1200, 270), name
    assert all(os.path.getsize(tmp_path / "a" / name) > 10_000 for name in PICTURES)   # drawn, not blank
    assert varunactl(["report", "--from", str(report), "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.strip() == f"drew     {', '.join(PICTURES)} into {tmp_path / 'b'}/"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(PICTURES)
    assert varunactl(["report", "--from", str(tmp_path / "b")]) == 1   # pictures, but no data
    assert capsys.readouterr().err.strip() == (f"varunactl report: no report.json in {tmp_path / 'b'}: "
                                               "`varunactl report JOB --out DIR` writes a report there")


# --- each slot's speed --------------------------------------------------------------------------------------

def test_the_report_prints_the_stragglers_and_draws_each_slots_speed(morphed, tmp_path):
    """b/0 computes 2.4x slower than a/0 and was planned around; c/0 (3.1x) is in no plan any more."""
    from varunad.report.draw import speed_figure

    report, doc = morphed
    assert doc["speeds"] == {"paces": {"a/0": 1.0, "b/0": 2.4}, "stragglers": {"b/0": 2.4, "c/0": 3.1}}
    assert json.loads((report / "report.json").read_text())["speeds"] == doc["speeds"]
    assert ("straggler c/0: computes 3.1x slower than the fastest slot of its kind; planned around, idle in this plan\n"
            "straggler b/0: computes 2.4x slower than the fastest slot of its kind; planned around\n"
            "speed     b/0 2.40x, a/0 1.00x (compute per micro-batch over its kind's fastest)\n"
            ) in (report / "report.txt").read_text()
    (ax,) = speed_figure(doc).axes
    assert ax.get_title() == "gpt: per-slot speed (2 stragglers)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["c/0", "b/0", "a/0"]   # the stragglers first
    bars = {t.get_text(): bar for t, bar in zip(ax.get_yticklabels(), ax.patches)}
    assert {slot: bar.get_width() for slot, bar in bars.items()} == {"c/0": 3.1, "b/0": 2.4, "a/0": 1.0}
    assert bars["b/0"].get_facecolor() != bars["a/0"].get_facecolor()   # a straggler stands out
    assert [t.get_text() for t in ax.texts] == ["3.10x straggler", "2.40x straggler", "1.00x"]
    (par,) = [line for line in ax.lines if line.get_label().startswith("1.0")]
    assert list(par.get_xdata()) == [1.0, 1.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "slot", "straggler: the plan works around it", "straggler left out of the last plan",
        "1.0: as fast as the fastest of its kind"]
    drawn, notes = draw_report(report, tmp_path)
    assert "speed.png" in drawn and notes == []
    assert png_size(tmp_path / "speed.png") == (900, 256) and os.path.getsize(tmp_path / "speed.png") > 10_000


def test_a_report_from_before_slot_speeds_draws_everything_else(morphed, tmp_path):
    report, doc = morphed
    old = tmp_path / "old"
    old.mkdir()
    for name in DATA_FILES:
        (old / name).write_bytes((report / name).read_bytes())
    before = {k: v for k, v in doc.items() if k != "speeds"}   # report.json as an older release wrote it
    (old / "report.json").write_text(json.dumps(before))
    (old / "speed.png").write_bytes(b"stale")   # drawn from other data: must not pass for this report's
    drawn, notes = draw_report(old)
    assert drawn == [name for name in PICTURES if name != "speed.png"]
    assert notes == ["speed.png: no slot speeds in report.json (none were measured, or the report predates them)"]
    assert not (old / "speed.png").exists()
    assert all(png_size(old / name) for name in drawn)
    text = format_report(before)
    assert "straggler" not in text and "speed " not in text and text.startswith("job      gpt: done")


def test_a_report_file_of_a_diverged_job_is_json_every_parser_reads(tmp_path):
    import json
    import math

    from varunad.report.record import _write_json

    _write_json(tmp_path / "loss.json", {"history": [[0, 4.5], [1, math.nan]], "last_loss": math.inf})
    text = (tmp_path / "loss.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}")) == {
        "history": [[0, 4.5], [1, None]], "last_loss": None}
