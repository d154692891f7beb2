"""The job report: loss chart, cost arithmetic, price table, simulated timeline events, and one real
daemon job whose `varunactl report` is checked file by file (PNGs decoded with zlib, no Pillow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ring import Ring
from test_timeline import _decode_png
from trainer.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile
from trainer.plot import LINE_COLOR, MARKER_COLOR, render_line_chart
from trainer.schedule import build_table
from trainer.simulator import simulate, stage_costs
from trainer.trace import CATEGORIES, TraceRecorder, trace_path
from varunad.cli import main as varunactl
from varunad.jobs import JobSpec, JobState, MorphEvent
from varunad.prices import DEFAULT_PRICES, DevicePrice, PriceError, load_prices, price_of
from varunad.report import (
    FILES,
    Interval,
    ReportInputs,
    build_report,
    cost_report,
    morph_losses,
    pick_measured_step,
    predict,
    run_intervals,
)

# --- loss chart --------------------------------------------------------------------------------------


def test_loss_chart_is_a_png_of_the_asked_size_with_the_curve_and_a_marker_per_morph(tmp_path):
    points = [(s, 3.0 * np.exp(-s / 20)) for s in range(60)]
    chart = render_line_chart(tmp_path / "loss.png", points, markers=[(12, "2X1>1X1"), (40, "1X1>2X1")],
                              width=800, height=360)
    img = _decode_png(tmp_path / "loss.png")
    assert img.shape == (360, 800, 3) and (chart.width, chart.height) == (800, 360)
    for x in chart.marker_xs:  # dashed: about half of the plot's height is marker-red at that column
        column = img[chart.plot_y0:chart.plot_y1, x]
        assert (column == MARKER_COLOR).all(axis=1).mean() > 0.3
    assert chart.marker_xs[0] < chart.marker_xs[1]
    assert abs(chart.marker_xs[0] - chart.x_of(12)) <= 1
    # No marker anywhere else: columns away from them hold no marker-red inside the plot.
    away = [x for x in range(chart.plot_x0, chart.plot_x1) if min(abs(x - m) for m in chart.marker_xs) > 3]
    assert not (img[chart.plot_y0:chart.plot_y1, away] == MARKER_COLOR).all(axis=2).any()
    # The curve passes through its points (first and last) in the line colour.
    for s in (0, 59):
        x, y = chart.x_of(s), chart.y_of(points[s][1])
        assert (img[y - 2:y + 3, x - 2:x + 3] == LINE_COLOR).all(axis=2).any()
    # Higher loss is drawn higher up.
    assert chart.y_of(points[0][1]) < chart.y_of(points[-1][1])


def test_loss_chart_needs_points(tmp_path):
    with pytest.raises(ValueError, match="no finite points"):
        render_line_chart(tmp_path / "x.png", [(0, float("nan"))])
    flat = render_line_chart(tmp_path / "flat.png", [(0, 1.0)])  # one point, no span: still drawn
    assert _decode_png(tmp_path / "flat.png").shape == (flat.height, flat.width, 3)


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
    from varunad.report import _cost_lines

    intervals = [Interval(e, "1x2", 2, 60.0 * i, 60.0 * (i + 1)) for i, e in enumerate((1, 2, 3))]
    prices = {"NVIDIA A100-SXM4-80GB": DevicePrice(1.0, 4.0, "test")}
    c = cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, prices, steps=0, batch_size=8, downtime_s=20.0,
                    redone_steps=0, restarts=2)
    assert c["morphs"]["count"] == 0 and c["morphs"]["restarts"] == 2 and c["spot_saving_factor"]
    lines = _cost_lines(c)
    assert lines[1].startswith("NVIDIA A100-SXM4-80GB ")   # the kind column fits the model's name
    assert any(ln.startswith("morphs   0, 2 restarts after a worker failed: ") for ln in lines), lines
    assert not any(ln.startswith("saving") for ln in lines), lines
    trained = _cost_lines(cost_report(intervals, {"NVIDIA A100-SXM4-80GB": 2}, prices, steps=10, batch_size=8,
                                      downtime_s=20.0, redone_steps=0))
    assert any(ln.startswith("morphs   2: ") for ln in trained) and any(ln.startswith("saving") for ln in trained)


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

def _calibration(n_segments: int = 4, kind: str = "cpu") -> Calibration:
    links = {"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e8)}
    sizes = (1, 2, 4)
    costs = tuple(SegmentCost(1e-3 * b, 2e-3 * b, 1e-3 * b, 10_000 * b, 10_000 * b) for b in sizes)
    return Calibration(model="m", device_kind=kind, micro_batch_sizes=sizes, input_bytes=tuple(100 * b for b in sizes),
                       segments=(SegmentProfile(1_000_000, 1_000_000, 1e-4, costs),) * n_segments, links=links,
                       allreduce=links)


def test_simulated_events_cover_every_action_of_every_stage():
    P, m = 3, 5
    table = build_table("varuna", P, m, True)
    costs = stage_costs([_calibration()] * P, [0, 1, 2, 4], 2, 2, ["inter"] * (P - 1), ["inter"] * P)
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
    seconds, events = predict(plan, {"cpu": _calibration().to_bytes()}, batch_size=12)
    assert seconds > 0
    assert {(e["pid"], e["tid"]) for e in events} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert not any(e["cat"] == "recompute" and e["pid"] == 1 for e in events)  # the planner's flags
    with pytest.raises(Exception, match="synthetic calibration"):
        predict({**plan, "calibrated": False}, {}, batch_size=12)
    with pytest.raises(Exception, match="no stored calibration for device kind cpu"):
        predict(plan, {}, batch_size=12)


def _trace_step(directory, stage: int, replica: int, rank: int, step: int, t0: float) -> TraceRecorder:
    rec = TraceRecorder(trace_path(directory, rank), rank=rank, stage=stage, replica=replica)
    for i, cat in enumerate(("forward", "recompute", "backward", "allreduce")):
        rec.events.append({"name": cat, "cat": cat, "ph": "X", "ts": t0 + 1000 * i, "dur": 900, "pid": stage,
                           "tid": replica, "args": {"step": step, "micro_batch": 0}})
    return rec


def test_the_measured_step_is_the_newest_epochs_last_complete_one_after_warm_up(tmp_path):
    old, new = tmp_path / "traces" / "epoch7", tmp_path / "traces" / "epoch12"
    for stage in range(2):
        rec = _trace_step(old, stage, 0, stage, 0, 0.0)
        rec.save()
    recs = [_trace_step(new, stage, 0, stage, 4, 0.0) for stage in range(2)]
    for rec in recs:  # steps 4 (warm-up) and 5 complete; 6 only on stage 0 (a worker stopped mid-step)
        rec.events += _trace_step(new, rec.stage, 0, rec.rank, 5, 10_000.0).events[4:]
    recs[0].events += _trace_step(new, 0, 0, 0, 6, 20_000.0).events[4:]
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
        rec = _trace_step(d, stage, 0, stage, 4, 0.0)   # warm-up
        for step in (5, 6):   # 6 follows the checkpoint at step 6 (every 3): its copy runs beside it
            rec.events += _trace_step(d, stage, 0, stage, step, 10_000.0 * step).events
        rec.save()
    assert pick_measured_step(str(tmp_path), {3: 2}, checkpoint_every=3).step == 5
    assert pick_measured_step(str(tmp_path), {3: 2}).step == 6
    assert pick_measured_step(str(tmp_path), {3: 2}, checkpoint_every=5).step == 6


def test_a_report_from_state_alone_notes_what_it_could_not_draw(tmp_path):
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=4, checkpoint_every=2, bundle_digest="0" * 64,
                   bundle_bytes=1)
    state = JobState(job="j", state="done", epoch=5, epochs=(5,), started_at=100.0, finished_at=460.0,
                     plan={"P": 1, "D": 2, "micro_batch_size": 4, "calibrated": False, "device_kinds": {"cpu": 2}})
    status = {"step": 4, "epochs": {"5": [0, 3]}, "loss_history": [[0, 2.0], [1, 1.5], [2, 1.2], [3, 1.1]]}
    inputs = ReportInputs(spec=spec, state=state, status=status, calibrations={}, store_dir=str(tmp_path / "store"),
                          now=1000.0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "timeline.png").write_bytes(b"stale")  # from an earlier report: must go
    doc = build_report(inputs, tmp_path / "out", DEFAULT_PRICES)
    assert doc["files"] == ["loss.png", "cost.json", "report.json", "report.txt"]
    assert not (tmp_path / "out" / "timeline.png").exists()
    assert doc["cost"]["device_hours"] == pytest.approx(2 * 360 / 3600)
    assert doc["cost"]["spot_usd"] == pytest.approx(0.2 * DEFAULT_PRICES["cpu"].spot)
    assert any("no traces" in n for n in doc["notes"]) and any("synthetic calibration" in n for n in doc["notes"])
    text = (tmp_path / "out" / "report.txt").read_text()
    assert "job      j: done" in text and "0.2000 device-hours" in text and "note     measured timeline" in text
    assert json.loads((tmp_path / "out" / "report.json").read_text())["cost"] == json.loads(
        (tmp_path / "out" / "cost.json").read_text())


# --- a real job ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_daemon_job_ends_with_a_report_and_varunactl_report_redraws_it(tmp_path, etcd, etcd_root):
    """Two daemons, one slot each and 1 GiB, with the test script's calibration (five 300 MB
    segments): the job runs as a 2-stage pipeline, the workers trace their first steps into the
    job's store, and the leader writes the report there when the job is done."""
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0,
                extra=["--calibrate", "profile", "--memory", str(2**30), "--progress-interval", "0.5",
                       "--debounce", "0.2"])
    try:
        for name in ("r1", "r2"):
            ring.start(name)
        ring.wait_members(["r1", "r2"])
        ring.submit("rep", steps=5, every=5)
        st = ring.wait_state("rep", ("done", "failed"), timeout=150)
        assert st["state"] == "done", st
        P, D = st["plan"]["P"], st["plan"]["D"]
        assert P * D == 2 and P == 2, st["plan"]

        leader_report = ring.store_dir / "rep" / "report"
        ring.poll(lambda: (leader_report / "report.txt").exists(), timeout=30, what="the leader's report")
        out = tmp_path / "out"
        r = ring.varunactl("report", "rep", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "job      rep: done" in r.stdout and f"written to {out}/" in r.stdout, r.stdout

        for name in FILES:
            assert (out / name).is_file(), (name, r.stdout)
            assert (leader_report / name).is_file(), name
        loss = _decode_png(out / "loss.png")
        assert loss.shape == (420, 900, 3)
        for name in ("timeline.png", "timeline_predicted.png"):
            img = _decode_png(out / name)
            assert img.shape[1] == 1400 and img.shape[0] > 100, name
        report = json.loads((out / "report.json").read_text())
        assert report["measured"]["workers"] == 2 and report["measured"]["warm"], report["measured"]
        for name in ("trace.json", "trace_predicted.json"):
            doc = json.loads((out / name).read_text())
            spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
            assert {(e["pid"], e["tid"]) for e in spans} == {(s, 0) for s in range(P)}, name
            assert {"forward", "backward"} <= {e["cat"] for e in spans}, name
        step = report["measured"]["step"]
        assert all(e["args"]["step"] == step for e in json.loads((out / "trace.json").read_text())["traceEvents"]
                   if e["ph"] == "X")
        cost = json.loads((out / "cost.json").read_text())
        assert cost["device_hours"] > 0 and cost["spot_usd"] > 0 and cost["by_kind"][0]["kind"] == "cpu"
        assert cost["samples"] == 5 * 12 and cost["intervals"][0]["devices"] == 2
        assert report["predicted"]["step_s"] > 0 and "error" in report["predicted"]
        assert any("2 daemons ran on one host" in n for n in report["notes"]), report["notes"]
        r = ring.varunactl("report", "nope", "--out", str(tmp_path / "nope"))
        assert r.returncode == 1 and r.stderr.strip() == "varunactl report: no job named nope (see `varunactl jobs`)"
    finally:
        ring.close()
