"""Trace recording and the PNG timeline (decoded here with zlib, independently of the writer)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from trainer.errors import ConfigError
from trainer.timeline import CATEGORY_COLORS, main, render_timeline, write_png
from trainer.trace import NullRecorder, TraceRecorder, recorder_for, trace_path


def _decode_png(path: Path) -> np.ndarray:
    """A minimal PNG reader: 8-bit RGB, no interlace, filter type 0 on every row, CRCs checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + width * 3)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


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


# --- PNG -------------------------------------------------------------------------------

def test_png_round_trips_through_an_independent_decoder(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    write_png(tmp_path / "x.png", img)
    assert np.array_equal(_decode_png(tmp_path / "x.png"), img)
    with pytest.raises(ValueError):
        write_png(tmp_path / "y.png", img.astype(np.float32))


def test_timeline_draws_each_bar_in_its_category_colour(traces, tmp_path):
    out = tmp_path / "t.png"
    tl = render_timeline([traces], out, step=0, width=1000)
    img = _decode_png(out)
    assert img.shape == (tl.height, tl.width, 3) and tl.width == 1000
    assert set(tl.rows) == {(0, 0), (1, 0), (1, 1)} and tl.num_events == 7

    def pixel(stage, replica, cat, ts_us):
        y0, y1 = tl.lane(stage, replica, cat)
        return tuple(img[(y0 + y1) // 2 + 1, tl.x_of(ts_us)])  # +1: below a centred micro-batch digit

    assert pixel(0, 0, "forward", 200) == CATEGORY_COLORS["forward"]
    assert pixel(0, 0, "backward", 3200) == CATEGORY_COLORS["backward"]
    assert pixel(1, 0, "send", 3250) == CATEGORY_COLORS["send"]
    assert pixel(1, 1, "allreduce", 4750) == CATEGORY_COLORS["allreduce"]
    assert pixel(1, 1, "optimizer", 5700) == CATEGORY_COLORS["optimizer"]
    # Idle time is not painted: stage 0 does nothing between its forward and its backward.
    assert pixel(0, 0, "forward", 2000) not in CATEGORY_COLORS.values()
    # Rows are stage-major: stage 0 above stage 1, and replicas in order within a stage.
    assert tl.rows[(0, 0)] < tl.rows[(1, 0)] < tl.rows[(1, 1)]


def test_timeline_selects_a_step(traces, tmp_path):
    assert render_timeline([traces], tmp_path / "all.png").num_events == 9
    last = render_timeline(sorted(traces.glob("*.json")), tmp_path / "last.png", step="last")
    assert last.num_events == 2 and last.t0_us == 10_000
    with pytest.raises(ConfigError, match="step 5"):
        render_timeline([traces], tmp_path / "none.png", step=5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no trace files"):
        render_timeline([tmp_path / "empty"], tmp_path / "none.png")
    with pytest.raises(ConfigError, match="cannot read"):
        render_timeline([tmp_path / "missing.json"], tmp_path / "none.png")


def test_timeline_command_line(traces, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert main([str(traces), "-o", str(out), "--step", "0"]) == 0
    assert "7 events, 3 workers" in capsys.readouterr().out
    assert _decode_png(out).shape[1] == 1400
