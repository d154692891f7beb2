"""A line chart as a PNG (the loss curve of a job), with labelled vertical markers (its morphs).

Drawn with the same numpy canvas, 3x5 pixel font and PNG writer as `trainer.timeline`, so a
report renders on a bare daemon image without matplotlib or Pillow. Only the primitives a line
chart needs beyond the timeline's (a polyline and a dashed vertical line) live here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from trainer.timeline import (  # the timeline's private drawing kit, shared within trainer
    _BACKGROUND,
    _CHAR_H,
    _INK,
    _ROW_BG,
    _fill,
    _nice_step,
    _text,
    _text_width,
    write_png,
)

__all__ = ["LINE_COLOR", "MARKER_COLOR", "SPAN_COLOR", "Chart", "render_line_chart"]

LINE_COLOR = (66, 133, 244)
MARKER_COLOR = (234, 67, 53)
SPAN_COLOR = (252, 228, 214)  # pale marker colour: steps redone after a morph
_GRID = (224, 224, 224)
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 24, 40, 44
_LABEL_ROWS = 3  # marker labels are staggered over this many rows so close markers stay legible


@dataclass(frozen=True, slots=True)
class Chart:
    """Where the data went, so callers (and tests) can find a point's or a marker's pixels."""

    width: int
    height: int
    plot_x0: int
    plot_x1: int
    plot_y0: int  # top edge
    plot_y1: int  # bottom edge (the x axis)
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    marker_xs: tuple[int, ...]

    def x_of(self, x: float) -> int:
        lo, hi = self.x_range
        return self.plot_x0 + round((x - lo) / (hi - lo) * (self.plot_x1 - 1 - self.plot_x0))

    def y_of(self, y: float) -> int:
        lo, hi = self.y_range
        return self.plot_y1 - 1 - round((y - lo) / (hi - lo) * (self.plot_y1 - 1 - self.plot_y0))


def _range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:  # a flat series still needs a span to map onto
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def _polyline(img: np.ndarray, xs: Sequence[int], ys: Sequence[int], color: Sequence[int], thick: int = 2) -> None:
    """Connect consecutive points with straight segments `thick` pixels wide."""
    h, w, _ = img.shape
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        n = max(abs(x1 - x0), abs(y1 - y0)) + 1
        px = np.rint(np.linspace(x0, x1, n)).astype(int)
        py = np.rint(np.linspace(y0, y1, n)).astype(int)
        for dy in range(thick):
            for dx in range(thick):
                ok = (px + dx >= 0) & (px + dx < w) & (py + dy >= 0) & (py + dy < h)
                img[py[ok] + dy, px[ok] + dx] = color
    if len(xs) == 1:
        _fill(img, xs[0] - 1, ys[0] - 1, xs[0] + thick + 1, ys[0] + thick + 1, color)


def _dashed_vline(img: np.ndarray, x: int, y0: int, y1: int, color: Sequence[int], dash: int = 6) -> None:
    for y in range(y0, y1, 2 * dash):
        _fill(img, x, y, x + 2, min(y + dash, y1), color)


def _format_tick(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def _ticks(lo: float, hi: float) -> tuple[list[float], float]:
    step = _nice_step(hi - lo, 6)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)], step


def _draw_axes(img: np.ndarray, c: Chart, x_label: str, y_label: str) -> None:
    _fill(img, c.plot_x0, c.plot_y0, c.plot_x1, c.plot_y1, _ROW_BG)
    xs, xstep = _ticks(*c.x_range)
    for v in xs:
        x = c.x_of(v)
        _fill(img, x, c.plot_y0, x + 1, c.plot_y1, _GRID)
        _fill(img, x, c.plot_y1, x + 1, c.plot_y1 + 5, _INK)
        label = _format_tick(v, xstep)
        _text(img, x - _text_width(label) // 2, c.plot_y1 + 8, label)
    ys, ystep = _ticks(*c.y_range)
    for v in ys:
        y = c.y_of(v)
        _fill(img, c.plot_x0, y, c.plot_x1, y + 1, _GRID)
        _fill(img, c.plot_x0 - 5, y, c.plot_x0, y + 1, _INK)
        label = _format_tick(v, ystep)
        _text(img, c.plot_x0 - 8 - _text_width(label), y - _CHAR_H // 2, label)
    _fill(img, c.plot_x0, c.plot_y1, c.plot_x1, c.plot_y1 + 1, _INK)
    _fill(img, c.plot_x0 - 1, c.plot_y0, c.plot_x0, c.plot_y1, _INK)
    _text(img, c.plot_x1 - _text_width(x_label), c.plot_y1 + 8 + _CHAR_H + 6, x_label)
    _text(img, 8, c.plot_y0 - _CHAR_H - 6, y_label)


def render_line_chart(
    out_png: str | os.PathLike[str],
    points: Sequence[tuple[float, float]],
    *,
    markers: Sequence[tuple[float, str]] = (),
    spans: Sequence[tuple[float, float]] = (),
    title: str = "",
    x_label: str = "step",
    y_label: str = "loss",
    width: int = 900,
    height: int = 420,
) -> Chart:
    """Draw `points` (x, y) as a line and each marker (x, label) as a dashed vertical line with
    its label at the top, and each span (x0, x1) as a shaded band (steps redone after a morph);
    write the PNG to `out_png`. ValueError if there is nothing to draw."""
    points = sorted((float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y))
    if not points:
        raise ValueError("no finite points to draw")
    width, height = max(width, _LEFT + _RIGHT + 100), max(height, _TOP + _BOTTOM + 60)
    x_range = _range([x for x, _ in points] + [x for x, _ in markers])
    label_h = _LABEL_ROWS * (_CHAR_H + 4) if markers else 0
    c = Chart(width=width, height=height, plot_x0=_LEFT, plot_x1=width - _RIGHT, plot_y0=_TOP + label_h,
              plot_y1=height - _BOTTOM, x_range=x_range, y_range=_range([y for _, y in points]),
              marker_xs=tuple(0 for _ in markers))
    c = replace(c, marker_xs=tuple(c.x_of(x) for x, _ in markers))
    img = np.empty((height, width, 3), np.uint8)
    img[:] = _BACKGROUND
    _text(img, _LEFT, 12, title)
    _draw_axes(img, c, x_label, y_label)
    for x0, x1 in spans:
        a, b = sorted((c.x_of(x0), c.x_of(x1)))
        img[c.plot_y0:c.plot_y1, a:b + 1] = SPAN_COLOR
    for i, (x, (_, label)) in enumerate(zip(c.marker_xs, markers)):
        _dashed_vline(img, x, c.plot_y0, c.plot_y1, MARKER_COLOR)
        label_y = _TOP + (i % _LABEL_ROWS) * (_CHAR_H + 4)
        _text(img, min(max(x - _text_width(label) // 2, 0), width - _text_width(label)), label_y, label,
              MARKER_COLOR)
    # The curve goes over the markers: the data matters more than the dashes.
    _polyline(img, [c.x_of(x) for x, _ in points], [c.y_of(y) for _, y in points], LINE_COLOR)
    write_png(out_png, img)
    return c
