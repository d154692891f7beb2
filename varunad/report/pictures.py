"""Draw a report's pictures from its data files: what `varunactl report` does after writing them.

    loss.png                 from loss.json: loss per step, morphs and restarts marked, redone steps shaded
    timeline.png             from trace.json: the measured step, a row per worker
    timeline_predicted.png   from trace_predicted.json: the simulator's replay of the plan
    throughput.png           from report.json: samples/s and P x D over the job's time
    speed.png                from report.json: each slot's slowdown against its kind's fastest, stragglers marked

matplotlib is the optional `report` extra (pip install 'varunad[report]'): varunad.report.draw
is imported only here and only when a picture is asked for, and its absence is one clear
message (NoMatplotlib), not a traceback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from varunad.report.record import PICTURES
from varunad.report.traces import load_events, select_step

__all__ = ["EXTRA", "NoMatplotlib", "draw_report", "draw_traces"]

EXTRA = "pip install 'varunad[report]'"


class NoMatplotlib(RuntimeError):
    """Pictures were asked for where matplotlib is not installed."""

    def __init__(self) -> None:
        super().__init__(f"the pictures need matplotlib, which is not installed: {EXTRA}")


def _draw():
    try:
        from varunad.report import draw
    except ImportError as exc:
        if (exc.name or "").split(".")[0] == "matplotlib":
            raise NoMatplotlib() from None
        raise
    return draw


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def _title(job: str, what: str) -> str:
    return f"{job}: {what}" if job else what


def draw_report(report_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
                ) -> tuple[list[str], list[str]]:
    """Draw every picture that the data in `report_dir` allows into `out_dir` (default: the same
    directory). Returns (the PNGs written, a note for each one that could not be drawn). A
    directory without report.json is a ValueError; no matplotlib is NoMatplotlib."""
    src = Path(report_dir)
    out = Path(out_dir) if out_dir is not None else src
    if not (src / "report.json").is_file():
        raise ValueError(f"no report.json in {src}: `varunactl report JOB --out DIR` writes a report there")
    draw = _draw()
    doc = _read(src / "report.json")
    out.mkdir(parents=True, exist_ok=True)
    for name in PICTURES:   # a picture from older data must not pass for this data's
        (out / name).unlink(missing_ok=True)
    job, meas, pred = doc.get("job", ""), doc.get("measured"), doc.get("predicted")
    jobs = {
        "loss.png": ("loss.json", lambda d: draw.loss_figure(d)),
        "timeline.png": ("trace.json", lambda d: draw.timeline_figure(d["traceEvents"], _title(
            job, f"measured step {meas['step']} of epoch {meas['epoch']}" if meas else "measured step"))),
        "timeline_predicted.png": ("trace_predicted.json", lambda d: draw.timeline_figure(d["traceEvents"], _title(
            job, "the plan's step as the simulator predicts it"
            + (f" ({100 * pred['error']:+.0f}% vs measured)" if pred and "error" in pred else "")))),
        "throughput.png": ("report.json", lambda d: draw.throughput_figure(d)),
        "speed.png": ("report.json", lambda d: draw.speed_figure(d)),
    }
    speeds = doc.get("speeds") or {}
    # not a failure: a report from before slots' speeds were measured, or a job whose workers
    # reported none, simply has no such picture
    absent = {} if speeds.get("paces") or speeds.get("stragglers") else {
        "speed.png": "no slot speeds in report.json (none were measured, or the report predates them)"}
    written, notes = [], []
    for png, (data, figure) in jobs.items():
        if png in absent:
            notes.append(f"{png}: {absent[png]}")
            continue
        if not (src / data).is_file():
            notes.append(f"{png}: no {data} (the report's notes say why)")
            continue
        try:
            draw.save(figure(_read(src / data)), out / png)
        except (ValueError, KeyError, TypeError) as exc:
            notes.append(f"{png}: not drawn: {exc}")
            continue
        written.append(png)
    return written, notes


def draw_traces(traces: Iterable[str | os.PathLike[str]], out_png: str | os.PathLike[str],
                step: int | str | None = "last") -> str:
    """Draw workers' trace files (trace-rank*.json, or directories of them) as one timeline PNG:
    one step (a number, or "last"), or every event (None). Returns a line saying what was drawn."""
    events, chosen = select_step(load_events(traces), step)
    draw = _draw()
    workers = len({(e["pid"], e["tid"]) for e in events})
    draw.save(draw.timeline_figure(events, "all steps" if chosen is None else f"step {chosen}"), out_png)
    return f"wrote {out_png}: {len(events)} events of {workers} worker(s)" + (
        "" if chosen is None else f", step {chosen}")
