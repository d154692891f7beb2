"""Draw the workers' traces as one schedule picture (PNG), like the Varuna paper's figures.

    python -m trainer.timeline TRACE_DIR -o timeline.png [--step N|last]

One row per worker (stage-major, then replica); each row has an upper lane for compute
(forward, recompute, backward, optimizer) and a thin lower lane for communication (send,
recv, allreduce), so an asynchronous send can overlap compute and still be seen. Bars carry
their micro-batch number when wide enough. Only numpy and zlib are used: the PNG is encoded
here and text comes from a built-in 3x5 pixel font, so rendering works on a bare worker
image without matplotlib or Pillow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import ConfigError

__all__ = ["CATEGORY_COLORS", "COMM_CATEGORIES", "Timeline", "load_events", "render_timeline", "write_png", "main"]

CATEGORY_COLORS: dict[str, tuple[int, int, int]] = {
    "forward": (66, 133, 244),
    "recompute": (251, 188, 5),
    "backward": (52, 168, 83),
    "optimizer": (121, 85, 72),
    "send": (171, 71, 188),
    "recv": (0, 172, 193),
    "allreduce": (234, 67, 53),
}
COMM_CATEGORIES = frozenset({"send", "recv", "allreduce"})
_OTHER = (158, 158, 158)
_BACKGROUND = (255, 255, 255)
_ROW_BG = (241, 243, 244)
_INK = (33, 33, 33)

_SCALE = 2                    # font pixels per glyph pixel
_CHAR_W = 4 * _SCALE          # 3 columns + 1 spacing
_CHAR_H = 5 * _SCALE
_ROW_H, _ROW_GAP = 30, 6
_COMPUTE_H = 20               # upper lane; the rest of the row is the communication lane
_LEFT, _RIGHT, _TOP = 64, 16, 34
_AXIS_H, _LEGEND_H = 34, 30

# A 3x5 font, rows top to bottom, for the few labels drawn (upper case, digits, punctuation).
_FONT_ROWS = {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 001 010 010", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", "A": "010 101 111 101 101", "B": "110 101 110 101 110",
    "C": "011 100 100 100 011", "D": "110 101 101 101 110", "E": "111 100 110 100 111",
    "F": "111 100 110 100 100", "G": "011 100 101 101 011", "H": "101 101 111 101 101",
    "I": "111 010 010 010 111", "J": "001 001 001 101 010", "K": "101 101 110 101 101",
    "L": "100 100 100 100 111", "M": "101 111 111 101 101", "N": "110 101 101 101 101",
    "O": "010 101 101 101 010", "P": "110 101 110 100 100", "Q": "010 101 101 110 011",
    "R": "110 101 110 101 101", "S": "011 100 010 001 110", "T": "111 010 010 010 010",
    "U": "101 101 101 101 111", "V": "101 101 101 101 010", "W": "101 101 101 111 101",
    "X": "101 101 010 101 101", "Y": "101 101 010 010 010", "Z": "111 001 010 100 111",
    " ": "000 000 000 000 000", ".": "000 000 000 000 010", "-": "000 000 111 000 000",
    ":": "000 010 000 010 000", "/": "001 001 010 100 100", "(": "010 100 100 100 010",
    ")": "010 001 001 001 010", "=": "000 111 000 111 000", "?": "111 001 010 000 010",
    ">": "100 010 001 010 100", "<": "001 010 100 010 001", ",": "000 000 000 010 100",
    "+": "000 010 111 010 000", "%": "101 001 010 100 101", "_": "000 000 000 000 111",
}
_FONT = {ch: np.array([[c == "1" for c in row] for row in rows.split()], dtype=bool)
         for ch, rows in _FONT_ROWS.items()}


@dataclass(frozen=True, slots=True)
class Timeline:
    """Where things were drawn, so callers (and tests) can find a bar's pixels."""

    width: int
    height: int
    rows: dict[tuple[int, int], int]
    """(stage, replica) -> y of the row's top edge."""
    t0_us: float
    t1_us: float
    plot_x0: int
    plot_x1: int
    num_events: int

    def x_of(self, ts_us: float) -> int:
        span = max(self.t1_us - self.t0_us, 1e-9)
        return self.plot_x0 + int((ts_us - self.t0_us) / span * (self.plot_x1 - self.plot_x0))

    def lane(self, stage: int, replica: int, cat: str) -> tuple[int, int]:
        """[y0, y1) of the lane that category `cat` is drawn in on that worker's row."""
        top = self.rows[(stage, replica)]
        if cat in COMM_CATEGORIES:
            return top + _COMPUTE_H + 1, top + _ROW_H
        return top, top + _COMPUTE_H


# --- PNG -------------------------------------------------------------------------------

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | os.PathLike[str], rgb: np.ndarray) -> None:
    """Write an (H, W, 3) uint8 array as an 8-bit truecolour PNG."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 array, got {rgb.shape} {rgb.dtype}")
    h, w, _ = rgb.shape
    # Filter type 0 (None) on every scanline: a leading zero byte per row.
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")
    Path(path).write_bytes(data)


# --- drawing ---------------------------------------------------------------------------

def _fill(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: Sequence[int]) -> None:
    h, w, _ = img.shape
    x0, x1, y0, y1 = max(x0, 0), min(x1, w), max(y0, 0), min(y1, h)
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1] = color


def _text(img: np.ndarray, x: int, y: int, text: str, color: Sequence[int] = _INK) -> int:
    """Draw `text` with its top-left corner at (x, y); returns the x after the last glyph."""
    h, w, _ = img.shape
    for ch in text.upper():
        glyph = np.kron(_FONT.get(ch, _FONT["?"]), np.ones((_SCALE, _SCALE), dtype=bool))
        gy, gx = glyph.shape
        ys, xs = slice(max(y, 0), min(y + gy, h)), slice(max(x, 0), min(x + gx, w))
        if ys.start < ys.stop and xs.start < xs.stop:
            mask = glyph[ys.start - y:ys.stop - y, xs.start - x:xs.stop - x]
            img[ys, xs][mask] = color
        x += _CHAR_W
    return x


def _text_width(text: str) -> int:
    return len(text) * _CHAR_W - _SCALE


def _nice_step(span: float, target: int = 8) -> float:
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * magnitude:
            return m * magnitude
    return 10 * magnitude


def _format_ms(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def _darker(color: Sequence[int]) -> tuple[int, int, int]:
    return tuple(int(c * 0.6) for c in color)  # type: ignore[return-value]


def _text_color_on(color: Sequence[int]) -> tuple[int, int, int]:
    luminance = 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]
    return _INK if luminance > 150 else (255, 255, 255)


# --- traces ----------------------------------------------------------------------------

def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return files


def load_events(trace_files: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """All complete ("X") events of the given files (directories are searched for *.json)."""
    events: list[dict[str, Any]] = []
    files = _expand(trace_files)
    if not files:
        raise ConfigError("no trace files found", hint="run with --trace-dir DIR and pass DIR or its .json files")
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read trace file {f}: {exc}") from exc
        raw = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
        events += [e for e in raw if isinstance(e, dict) and e.get("ph") == "X"]
    return events


def _select_step(events: list[dict[str, Any]], step: int | str | None) -> tuple[list[dict[str, Any]], int | None]:
    """The events of `step` (None: all, "last": the highest tagged step) and the step chosen."""
    if step is None:
        return events, None
    steps = {e.get("args", {}).get("step") for e in events} - {None}
    if step == "last":
        if not steps:
            return events, None  # untagged traces: draw everything
        step = max(steps)
    chosen = [e for e in events if e.get("args", {}).get("step") == step]
    if not chosen:
        raise ConfigError(f"no events for step {step}", hint=f"steps in these traces: {sorted(steps) or 'none tagged'}")
    return chosen, int(step)


def render_timeline(
    trace_files: Iterable[str | os.PathLike[str]],
    out_png: str | os.PathLike[str],
    step: int | str | None = None,
    *,
    width: int = 1400,
    title: str | None = None,
) -> Timeline:
    """Draw the traces' events (all of them, one step, or "last") into `out_png`; `title`
    goes before the step and shape in the heading (e.g. "measured" or "predicted")."""
    events, chosen_step = _select_step(load_events(trace_files), step)
    if not events:
        raise ConfigError("the traces hold no events to draw")
    keys = sorted({(int(e["pid"]), int(e["tid"])) for e in events})
    t0 = min(float(e["ts"]) for e in events)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)

    height = _TOP + len(keys) * (_ROW_H + _ROW_GAP) + _AXIS_H + _LEGEND_H
    width = max(width, _LEFT + _RIGHT + 100)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = _BACKGROUND
    rows = {key: _TOP + i * (_ROW_H + _ROW_GAP) for i, key in enumerate(keys)}
    tl = Timeline(width=width, height=height, rows=rows, t0_us=t0, t1_us=t1,
                  plot_x0=_LEFT, plot_x1=width - _RIGHT, num_events=len(events))

    heading = f"P={len({s for s, _ in keys})} D={len({r for _, r in keys})}"
    if chosen_step is not None:
        heading = f"step {chosen_step}   " + heading
    if title:
        heading = f"{title}   " + heading
    _text(img, _LEFT, 10, heading)
    for (stage, replica), top in rows.items():
        _fill(img, tl.plot_x0, top, tl.plot_x1, top + _ROW_H, _ROW_BG)
        _text(img, 8, top + (_ROW_H - _CHAR_H) // 2, f"S{stage} R{replica}")

    # Long events first so short ones nested inside them (e.g. a send within a backward) stay visible.
    for e in sorted(events, key=lambda e: -float(e.get("dur", 0))):
        cat = str(e.get("cat", ""))
        color = CATEGORY_COLORS.get(cat, _OTHER)
        y0, y1 = tl.lane(int(e["pid"]), int(e["tid"]), cat)
        x0 = tl.x_of(float(e["ts"]))
        x1 = max(x0 + 1, tl.x_of(float(e["ts"]) + float(e.get("dur", 0))))
        _fill(img, x0, y0, x1, y1, color)
        if x1 - x0 >= 4:  # a darker right edge tells adjacent bars of one colour apart
            _fill(img, x1 - 1, y0, x1, y1, _darker(color))
        mb = e.get("args", {}).get("micro_batch")
        if mb is not None and y1 - y0 >= _CHAR_H + 2 and x1 - x0 >= _text_width(str(mb)) + 4:
            label = str(mb)
            _text(img, (x0 + x1 - _text_width(label)) // 2, (y0 + y1 - _CHAR_H) // 2, label, _text_color_on(color))

    _draw_axis(img, tl, _TOP + len(keys) * (_ROW_H + _ROW_GAP))
    _draw_legend(img, height - _LEGEND_H + 6)
    write_png(out_png, img)
    return tl


def _draw_axis(img: np.ndarray, tl: Timeline, y: int) -> None:
    _fill(img, tl.plot_x0, y, tl.plot_x1, y + 1, _INK)
    span_ms = max((tl.t1_us - tl.t0_us) / 1000.0, 1e-6)
    step = _nice_step(span_ms)
    k = 0
    while k * step <= span_ms + 1e-9:
        x = tl.x_of(tl.t0_us + k * step * 1000.0)
        _fill(img, x, y, x + 1, y + 5, _INK)
        label = _format_ms(k * step, step)
        _text(img, min(x - _text_width(label) // 2, tl.plot_x1 - _text_width(label)), y + 8, label)
        k += 1
    _text(img, tl.plot_x1 - _text_width("MS"), y + 8 + _CHAR_H + 4, "ms")


def _draw_legend(img: np.ndarray, y: int) -> None:
    x = _LEFT
    for cat, color in CATEGORY_COLORS.items():
        _fill(img, x, y, x + _CHAR_H, y + _CHAR_H, color)
        x = _text(img, x + _CHAR_H + 4, y, cat) + 3 * _CHAR_W


def _parse_step(text: str) -> int | str:
    if text == "last":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'last', got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.timeline",
        description="Render the Chrome traces written by `trainer.launch --trace-dir DIR` as one PNG: "
                    "one row per worker (stage, replica), coloured bars per activity.",
    )
    parser.add_argument("traces", nargs="+", help="trace directories and/or trace .json files")
    parser.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    parser.add_argument("--step", type=_parse_step, help="draw only this step (a number or 'last'); default all")
    parser.add_argument("--width", type=int, default=1400, help="image width in pixels (default 1400)")
    ns = parser.parse_args(argv)
    try:
        tl = render_timeline(ns.traces, ns.output, ns.step, width=ns.width)
    except ConfigError as exc:
        parser.error(str(exc))
    print(f"wrote {ns.output}: {tl.num_events} events, {len(tl.rows)} workers, "
          f"{(tl.t1_us - tl.t0_us) / 1000:.1f} ms, {tl.width}x{tl.height} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
