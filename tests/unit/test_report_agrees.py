"""Reports that agree with themselves, read back from the report.txt and report.json they produce
(built from records, as the leader leaves them, without a ring): a failed job that restarted once,
a job with no morph, and a job with two morphs; the step compared with the prediction is a
steady-state one and the report says which; a saving is claimed only when there is one; the
co-located note counts the daemons that ran; no label under a legend; the calibration a labelled
span of throughput.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.calibrations import report_calibration
from support.traces import trace_step

from varunad.control.jobs import JobSpec, JobState, MorphEvent
from varunad.report import ReportInputs, build_report, cost_report
from varunad.report.cost import Interval, cost_lines
from varunad.report.prices import DEFAULT_PRICES, DevicePrice

SPEC = JobSpec(job="llama", script="t.py", batch_size=16, steps=30, checkpoint_every=10, bundle_digest="0" * 64,
               bundle_bytes=1)


def _plan(P: int, D: int, members: list[str], **kw) -> dict:
    return {"P": P, "D": D, "micro_batch_size": 2, "cuts": [2] if P == 2 else [], "calibrated": True,
            "schedule": "varuna", "members": members, "stage_kinds": ["cpu"] * P, "recompute": [False] * P,
            "link_kinds": ["inter"] * (P - 1), "allreduce_kinds": ["inter"] * P,
            "micro_batches": 16 // (2 * D), "device_kinds": {"cpu": P * D}, **kw}


def _event(reason: str, frm: str, to: str, e0: int, e1: int, t: float, *, restart: bool = False,
           cause: str = "") -> MorphEvent:
    return MorphEvent(reason=reason, from_shape=frm, to_shape=to, from_epoch=e0, to_epoch=e1, noticed_at=t,
                      stopped_at=t + 1, planned_at=t + 2, checkpoint=False, restart=restart, cause=cause)


def _traces(store: Path, epoch: int, P: int, D: int, durations_ms: list[float]) -> None:
    """Every worker of `epoch` traced steps 0.. with these step times (one event per category)."""
    for stage in range(P):
        for replica in range(D):
            rank = replica * P + stage
            rec = trace_step(store / "traces" / f"epoch{epoch}", stage, replica, rank, 0, 0.0)
            rec.events = []
            t = 0.0
            for step, ms in enumerate(durations_ms):
                one = trace_step(store / "traces" / f"epoch{epoch}", stage, replica, rank, step, t)
                for e in one.events:   # four events of 0.9 ms, 1 ms apart: stretch the last to the step time
                    if e.get("cat") == "allreduce":
                        e["dur"] = ms * 1000 - 3000
                rec.events += one.events
                t += ms * 1000 + 5000
            rec.save()


def _report(tmp_path: Path, state: JobState, status: dict) -> tuple[dict, str, Path]:
    inputs = ReportInputs(spec=SPEC, state=state, status=status, calibrations={"cpu": report_calibration().to_bytes()},
                          store_dir=str(tmp_path / "store"), now=state.finished_at + 10)
    out = tmp_path / "report"
    build_report(inputs, out, DEFAULT_PRICES)
    return json.loads((out / "report.json").read_text()), (out / "report.txt").read_text(), out


def _losses(steps: range) -> list[list[float]]:
    return [[s, 4.0 / (1 + s / 10)] for s in steps]


def test_a_failed_job_that_restarted_shows_no_morph_and_claims_no_saving(tmp_path):
    """1x2 on vm1 and vm2; a worker failed at step 12 and the same plan started again from step
    10; it failed the same way and the job was failed. Its report: one shape, no morph, one
    restart."""
    restart = _event("ValueError: boom (rank 1 on vm2): starting the same plan again", "1x2", "1x2", 4, 6, 1050.0,
                     restart=True, cause="a worker failed")
    state = JobState(job="llama", state="failed", reason="ValueError: boom (rank 1 on vm2 again on a fresh start)",
                     epoch=6, epochs=(4, 6), started_at=1000.0, finished_at=1080.0, morphs=(restart,), restarts=1,
                     plan=_plan(1, 2, ["vm1", "vm2"], daemons_per_host=2))
    status = {"step": 13, "epochs": {"4": [0, 12], "6": [10, 12]},
              "epoch_spans": {"4": [1005.0, 1045.0], "6": [1060.0, 1070.0]}, "loss_history": _losses(range(13))}
    doc, text, _ = _report(tmp_path, state, status)
    assert doc["shapes"] == ["1x2"] and doc["cost"]["morphs"]["count"] == 0
    assert "as 1x2\n" in text and "->" not in text.split("\n")[1], text
    assert "morphs   none, 1 restart after a worker failed" in text, text
    assert "1.0x" not in text


def test_a_job_with_no_morph_shows_none_and_compares_a_steady_step(tmp_path):
    """2x1 on vm1 and vm2 (a ring of three: vm3 idle), all 30 steps in one epoch. Traced steps
    0-4 took 90, 60, 31, 30 and 45 ms: the first two are warm-up; the step compared with the
    prediction is the median of steps 2-4 (step 2, 31 ms), and the report says so."""
    _traces(tmp_path / "store", 5, 2, 1, [90.0, 60.0, 31.0, 30.0, 45.0])
    state = JobState(job="llama", state="done", reason="trained all 30 steps", epoch=5, epochs=(5,),
                     started_at=1000.0, finished_at=1100.0, calibration_started=990.0, calibration_ended=999.0,
                     plan=_plan(2, 1, ["vm1", "vm2"], daemons_per_host=2))
    status = {"step": 30, "epochs": {"5": [0, 29]}, "epoch_spans": {"5": [1010.0, 1095.0]},
              "loss_history": _losses(range(30))}
    doc, text, _ = _report(tmp_path, state, status)
    assert doc["shapes"] == ["2x1"] and "as 2x1\n" in text and "morphs   none" in text, text
    meas = doc["measured"]
    assert (meas["epoch"], meas["step"], meas["median_of"]) == (5, 2, [2, 3, 4])
    assert meas["step_s"] == pytest.approx(0.031)
    assert "measured 0.0310 s (step 2 of epoch 5, the median of its steady-state steps 2, 3, 4, 2 workers)" in text
    assert any(n.startswith("all 2 daemons that ran epoch 5 shared one machine") for n in doc["notes"]), doc["notes"]
    assert doc["calibration"] == [990.0, 999.0]
    assert "saving   the same work" in text and "x cheaper" in text   # 1000 steps' worth at half the price


def test_a_job_with_two_morphs_names_both_and_the_note_counts_the_plans_daemons(tmp_path):
    """2x2 on four VMs, vm4 lost (-> 2x1 on two... of the three left), then vm3 joined back (-> 1x3):
    the report's shapes follow both morphs; only 2 of the last plan's 3 daemons shared a host."""
    _traces(tmp_path / "store", 9, 1, 3, [50.0, 40.0, 30.0, 30.0, 30.0])
    lost = _event("vm4 was lost: re-planning on the VMs left", "2x2", "2x1", 3, 7, 1040.0, cause="vm4 was lost")
    joined = _event("vm3 joined: 1x3 is estimated 30% faster", "2x1", "1x3", 7, 9, 1080.0, cause="vm3 joined")
    state = JobState(job="llama", state="done", reason="trained all 30 steps", epoch=9, epochs=(3, 7, 9),
                     started_at=1000.0, finished_at=1150.0, morphs=(lost, joined),
                     plan=_plan(1, 3, ["vm1", "vm2", "vm3"], daemons_per_host=2))
    status = {"step": 30, "epochs": {"3": [0, 12], "7": [10, 19], "9": [20, 29]},
              "epoch_spans": {"3": [1005.0, 1039.0], "7": [1050.0, 1079.0], "9": [1090.0, 1145.0]},
              "loss_history": _losses(range(30))}
    doc, text, out = _report(tmp_path, state, status)
    assert doc["shapes"] == ["2x2", "2x1", "1x3"] and "as 2x2 -> 2x1 -> 1x3\n" in text, text
    assert "morphs   2: " in text, text
    assert any(n.startswith("2 of the 3 daemons that ran epoch 9 shared one machine") for n in doc["notes"]), doc["notes"]
    assert doc["calibration"] is None
    loss = json.loads((out / "loss.json").read_text())
    assert [m["label"] for m in loss["morphs"]] == ["vm4 lost", "vm3 joined"]


def test_a_saving_is_claimed_only_when_there_is_one_to_compare():
    intervals = [Interval(1, "1x2", 2, 0.0, 3600.0)]
    def lines(spot: float, on_demand: float, steps: int = 10, downtime: float = 0.0) -> list[str]:
        prices = {"cpu": DevicePrice(spot, on_demand, "test")}
        return cost_lines(cost_report(intervals, {"cpu": 2}, prices, steps=steps, batch_size=8, downtime_s=downtime,
                                      redone_steps=0))
    assert not any(ln.startswith("saving") for ln in lines(0.30, 0.31))           # 1.0x: nothing to say
    assert any("spot is 2.0x cheaper" in ln for ln in lines(0.20, 0.40))
    assert not any(ln.startswith("saving") for ln in lines(0.20, 0.40, steps=0))  # nothing trained
    worse = [ln for ln in lines(0.20, 0.40, downtime=3000.0) if ln.startswith("saving")]
    assert worse and worse[0].startswith("saving   none: ") and "cheaper" not in worse[0], worse


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_no_label_sits_under_a_legend_and_the_calibration_is_a_labelled_span(tmp_path):
    """The restart's and the morphs' labels at the top of the axes, right where a legend inside
    would be: the legends are beside the axes. throughput.png shades the calibration and labels it."""
    pytest.importorskip("matplotlib")
    from varunad.report.draw import loss_figure, throughput_figure

    loss = {"job": "llama", "history": _losses(range(30)), "redone": [[10, 12]],
            "morphs": [{"step": 13, "resumed": 10, "restart": True, "shapes": ["1x2", "1x2"],
                        "label": "a worker failed"},
                       {"step": 28, "resumed": 28, "restart": False, "shapes": ["1x2", "2x1"], "label": "vm2 lost"},
                       {"step": 29, "resumed": 29, "restart": False, "shapes": ["2x1", "1x1"], "label": "vm3 lost"}]}
    report = {"job": "llama", "calibration": [990.0, 999.0],
              "runs": [{"epoch": 5, "shape": "2x1", "devices": 2, "start": 1000.0, "end": 1100.0, "first_step": 0,
                        "last_step": 29, "first_step_at": 1010.0, "last_step_at": 1095.0, "samples_per_s": 5.6,
                        "after": None}]}
    for fig in (loss_figure(loss), throughput_figure(report)):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        labels = [t.get_window_extent(renderer) for t in ax.texts]
        assert not any(_overlaps(legend, lab) for lab in labels)
        assert not _overlaps(legend, ax.get_window_extent(renderer))   # beside the axes, never on them
    top = throughput_figure(report).axes[0]
    assert "calibration (the script profiled once)" in [t.get_text() for t in top.get_legend().get_texts()]
    spans = [p for p in top.patches if p.get_label() == "calibration (the script profiled once)"]
    assert spans, [p.get_label() for p in top.patches]
    xs = spans[0].get_patch_transform().transform(spans[0].get_path().vertices)[:, 0]
    assert (min(xs), max(xs)) == (0.0, 9.0)   # the axis starts when the calibration did
