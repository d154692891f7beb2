"""Trace recording, reading trace files back, and their timeline picture (a matplotlib figure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.png import png_size

from trainer.engine.trace import NullRecorder, TraceRecorder, recorder_for, trace_path
from varunad.ctl.cli import main as varunactl
from varunad.report.traces import load_events, select_step


def _write_trace(path: Path, stage: int, replica: int, events: list[tuple[str, float, float, int | None, int]]):
    """events: (cat, ts_us, dur_us, micro_batch, step)."""
    rec = TraceRecorder(path, rank=replica * 2 + stage, stage=stage, replica=replica)
    for cat, ts, dur, mb, step in events:
        args = {"step": step} if mb is None else {"step": step, "micro_batch": mb}
        rec.events.append({"name": cat, "cat": cat, "ph": "X", "ts": ts, "dur": dur,
                           "pid": stage, "tid": replica, "args": args})
    rec.save()


@pytest.fixture
def traces(tmp_path):
    d = tmp_path / "traces"
    _write_trace(trace_path(d, 0), 0, 0, [("forward", 0, 1000, 0, 0), ("backward", 3000, 2000, 0, 0),
                                          ("forward", 10_000, 1000, 0, 1)])
    _write_trace(trace_path(d, 1), 1, 0, [("forward", 1000, 1000, 0, 0), ("backward", 2000, 1000, 0, 0),
                                          ("send", 3000, 500, 0, 0), ("forward", 11_000, 500, 0, 1)])
    _write_trace(trace_path(d, 3), 1, 1, [("allreduce", 4000, 1500, None, 0), ("optimizer", 5500, 400, None, 0)])
    return d


# --- trace recording -------------------------------------------------------------------

def test_spans_become_chrome_complete_events(tmp_path):
    rec = TraceRecorder(tmp_path / "t.json", rank=5, stage=2, replica=1)
    rec.set_step(7)
    with rec.span("2F3", "forward", micro_batch=3):
        with rec.span("send", "send", micro_batch=3):
            pass
    with pytest.raises(RuntimeError), rec.span("2B3", "backward", micro_batch=3):
        raise RuntimeError("recorded anyway")
    doc = json.loads(rec.save().read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["send", "2F3", "2B3"]  # closed inner-first
    outer, inner = spans[1], spans[0]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3
    assert all(e["pid"] == 2 and e["tid"] == 1 and e["args"] == {"micro_batch": 3, "step": 7} for e in spans)
    names = {e["name"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and "name" in e["args"]}
    assert names == {"process_name": "stage 2", "thread_name": "replica 1 (rank 5)"}


def test_tracing_off_records_nothing(tmp_path):
    rec = recorder_for(None, rank=0, stage=0, replica=0)
    assert isinstance(rec, NullRecorder) and not rec.enabled
    with rec.span("x", "forward"):
        pass
    assert rec.save() is None
    on = recorder_for(tmp_path, rank=3, stage=1, replica=1)
    assert on.path == trace_path(tmp_path, 3) and on.enabled


# --- reading traces back ----------------------------------------------------------------

def test_trace_files_are_read_back_and_a_step_selected(traces, tmp_path):
    events = load_events([traces])
    assert len(events) == 9 and all(e["ph"] == "X" for e in events)
    step0, chosen = select_step(events, 0)
    assert chosen == 0 and len(step0) == 7
    last, chosen = select_step(load_events(sorted(traces.glob("*.json"))), "last")
    assert chosen == 1 and sorted(e["ts"] for e in last) == [10_000, 11_000]
    assert select_step(events, None) == (events, None)
    with pytest.raises(ValueError, match=r"no events for step 5; steps in these traces: \[0, 1\]"):
        select_step(events, 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trace files"):
        load_events([tmp_path / "empty"])
    (tmp_path / "bad.json").write_text("{cut")
    with pytest.raises(ValueError, match="cannot read trace file .*bad.json"):
        load_events([tmp_path / "bad.json"])


# --- the timeline picture --------------------------------------------------------------------------------

def test_the_timeline_is_a_row_per_worker_with_a_bar_per_event_in_its_category_colour(traces):
    from matplotlib.colors import to_hex  # the report extra, in the test extra too

    from varunad.report.draw import CATEGORY_COLORS, timeline_figure

    events, _ = select_step(load_events([traces]), 0)
    fig = timeline_figure(events, "step 0")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0, replica 0", "stage 1, replica 0",
                                                              "stage 1, replica 1"]
    assert ax.get_xlabel() == "time since the step's first event (ms)"
    assert ax.get_title() == "step 0  (P=2, D=2, 5.9 ms)"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "optimizer", "send", "all-reduce"]   # those present, in a fixed order
    bars = {}   # colour -> [(x, width, row)] of every bar drawn
    for coll in ax.collections:
        colour = to_hex(coll.get_facecolor()[0])
        for path in coll.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            bars.setdefault(colour, []).append((round(x0, 3), round(x1 - x0, 3), round(y0 + 0.4)))
    # rows are stage-major: stage 0 replica 0 is row 0, stage 1 replica 1 row 2; ms from the first event
    assert sorted(bars[CATEGORY_COLORS["forward"]]) == [(0.0, 1.0, 0), (1.0, 1.0, 1)]
    assert bars[CATEGORY_COLORS["backward"]] == [(3.0, 2.0, 0), (2.0, 1.0, 1)]
    assert bars[CATEGORY_COLORS["allreduce"]][0][:2] == (4.0, 1.5)
    # communication goes in the thin lane under its row's compute
    send = next(c for c in ax.collections if to_hex(c.get_facecolor()[0]) == CATEGORY_COLORS["send"])
    assert send.get_paths()[0].vertices[:, 1].min() == pytest.approx(1.22)
    assert {t.get_text() for t in ax.texts} == {"0"}   # the micro-batch number on the bars wide enough
    with pytest.raises(ValueError, match="no events"):
        timeline_figure([], "x")


def test_varunactl_report_draws_trace_files(traces, tmp_path, capsys):
    out = tmp_path / "pics"
    out.mkdir()
    assert varunactl(["report", "--traces", str(traces), "--step", "0", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}/timeline.png: 7 events of 3 worker(s), step 0"
    width, height = png_size(out / "timeline.png")
    assert width == 1200 and 250 < height < 500
    assert varunactl(["report", "--traces", str(traces), "--step", "9", "--out", str(out)]) == 1
    assert "no events for step 9" in capsys.readouterr().err
    assert varunactl(["report", "j", "--traces", str(traces)]) == 2
    assert capsys.readouterr().err.strip() == ("varunactl report: give one of JOB, --from DIR or --traces PATH, "
                                               "not JOB and --traces")
