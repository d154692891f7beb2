"""The report's pictures as matplotlib figures, drawn from the report's data (varunad.report.record).

Each function takes plain data (what loss.json, trace*.json and report.json hold) and returns a
`matplotlib.figure.Figure` on an Agg canvas; `save` writes it as a PNG. pyplot is never imported:
its global state and GUI backends have no place in a command-line tool or a test. Only
varunad.report.pictures imports this module, and only when pictures are asked for: matplotlib
is the optional `report` extra, absent from a daemon's image.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

__all__ = ["CATEGORY_COLORS", "loss_figure", "timeline_figure", "throughput_figure", "speed_figure", "save"]

# One colour per activity, as in the Varuna paper's schedule figure: compute in strong colours,
# communication in its own thin lane under it (an asynchronous send overlaps compute).
CATEGORY_COLORS: dict[str, str] = {
    "forward": "#1f77b4",
    "recompute": "#ff7f0e",
    "backward": "#2ca02c",
    "optimizer": "#8c564b",
    "send": "#9467bd",
    "recv": "#17becf",
    "allreduce": "#d62728",
}
COMM_CATEGORIES = frozenset({"send", "recv", "allreduce"})
_LABELS = {"recv": "receive", "allreduce": "all-reduce"}
_OTHER = "#7f7f7f"
_MORPH, _RESTART, _REDONE = "#d62728", "#7f7f7f", "#ffbb78"
_DPI = 100
_LOSS, _REDONE_LABEL = "loss", "steps redone from the checkpoint"
_MORPH_LABEL, _RESTART_LABEL = "morph (where the job stood)", "restart after a worker failed"
_RATE_LABEL, _NOTICED_LABEL, _STALL_LABEL = ("samples/s (mean over the plan's steps)", "morph noticed",
                                             "no training: stop, re-plan, restart")
_CALIBRATION, _CALIBRATION_LABEL = "#c5b0d5", "calibration (the script profiled once)"
_STARTUP, _STARTUP_LABEL = "#dbdb8d", "start-up: workers start, build the model, load"
# Legends sit beside the axes, never on them: the labels of morphs and restarts stand at the top of
# the axes, where any legend inside would cover some of them.
_BESIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}


def _legend(ax: Any, order: Sequence[str], **where: Any) -> None:
    """A legend whose entries follow `order` (labels), whatever order the artists were drawn in."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    rank = {label: i for i, label in enumerate(order)}
    pairs = sorted(zip(handles, labels), key=lambda p: rank.get(p[1], len(order)))
    ax.legend([h for h, _ in pairs], [lab for _, lab in pairs], fontsize=9, framealpha=0.9, **where)


def _figure(width_in: float, height_in: float) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write `fig` as a PNG; a reader never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=_DPI, facecolor="white")
    os.replace(tmp, path)


# --- loss ---------------------------------------------------------------------------------------------

def loss_figure(loss: Mapping[str, Any]) -> Figure:
    """The loss per step (loss.json): a dashed line where each morph happened, labelled with its
    cause, a dotted one per restart, and the steps redone from the checkpoint after them shaded."""
    points = sorted((float(s), float(v)) for s, v in loss.get("history", ())
                    if math.isfinite(float(s)) and math.isfinite(float(v)))
    if not points:
        raise ValueError("no finite loss to draw")
    morphs = list(loss.get("morphs", ()))
    fig = _figure(9.0, 4.5)
    ax = fig.add_subplot()
    for i, (a, b) in enumerate(loss.get("redone", ())):
        ax.axvspan(a - 0.5, b + 0.5, color=_REDONE, alpha=0.45, lw=0,
                   label=_REDONE_LABEL if i == 0 else None)
    xs, ys = [x for x, _ in points], [y for _, y in points]
    ax.plot(xs, ys, color=CATEGORY_COLORS["forward"], lw=1.6, marker="o" if len(points) <= 40 else None, ms=3,
            label=_LOSS, zorder=3)
    seen = set()
    for m in morphs:
        kind = "restart" if m.get("restart") else "morph"
        ax.axvline(m["step"], color=_RESTART if kind == "restart" else _MORPH, ls=":" if kind == "restart" else "--",
                   lw=1.4, zorder=2, label=None if kind in seen else
                   (_RESTART_LABEL if kind == "restart" else _MORPH_LABEL))
        seen.add(kind)
        ax.annotate(m.get("label", ""), xy=(m["step"], 1.0), xycoords=("data", "axes fraction"),
                    xytext=(-3, -4), textcoords="offset points", rotation=90, ha="right", va="top", fontsize=8,
                    color=_RESTART if kind == "restart" else _MORPH, zorder=4,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    ax.set_xlabel("step (model.iteration)")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    n_morphs = sum(not m.get("restart") for m in morphs)
    n_restarts = len(morphs) - n_morphs
    extra = f", {n_restarts} restart{'s' * (n_restarts != 1)}" if n_restarts else ""
    ax.set_title(f"{loss.get('job', '')}: loss per step ({n_morphs} morph{'s' * (n_morphs != 1)}{extra})".lstrip(": "))
    _legend(ax, [_LOSS, _MORPH_LABEL, _RESTART_LABEL, _REDONE_LABEL], **_BESIDE)
    return fig


# --- schedule timeline ----------------------------------------------------------------------------------

def _ink_on(color: str) -> str:
    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def timeline_figure(events: Sequence[Mapping[str, Any]], title: str) -> Figure:
    """One step's complete ("X") trace events as the paper draws a schedule: a row per worker
    (stage-major, then replica), compute bars in the upper lane with their micro-batch number,
    sends, receives and all-reduce in a thin lane under them; time in ms from the first event."""
    events = [e for e in events if e.get("ph", "X") == "X"]
    if not events:
        raise ValueError("the trace holds no events to draw")
    keys = sorted({(int(e["pid"]), int(e["tid"])) for e in events})
    row = {k: i for i, k in enumerate(keys)}
    t0 = min(float(e["ts"]) for e in events)
    span_ms = max((max(float(e["ts"]) + float(e.get("dur", 0)) for e in events) - t0) / 1000.0, 1e-6)
    fig = _figure(12.0, 1.6 + 0.55 * len(keys))
    ax = fig.add_subplot()
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        start = (float(e["ts"]) - t0) / 1000.0
        width = max(float(e.get("dur", 0)) / 1000.0, span_ms / 2000)  # an instant still shows
        bars.setdefault((row[(int(e["pid"]), int(e["tid"]))], str(e.get("cat", ""))), []).append((start, width))
    for (y, cat), spans in bars.items():
        lane = (y + 0.22, 0.2) if cat in COMM_CATEGORIES else (y - 0.4, 0.58)
        ax.broken_barh(spans, lane, facecolors=CATEGORY_COLORS.get(cat, _OTHER), edgecolors="white", linewidth=0.5)
    # micro-batch numbers where a bar is wide enough to hold them (about 1/90 of the axis per digit)
    for e in events:
        mb, cat = e.get("args", {}).get("micro_batch"), str(e.get("cat", ""))
        dur_ms = float(e.get("dur", 0)) / 1000.0
        if mb is None or cat in COMM_CATEGORIES or dur_ms < span_ms * len(str(mb)) / 90:
            continue
        ax.text((float(e["ts"]) - t0) / 1000.0 + dur_ms / 2, row[(int(e["pid"]), int(e["tid"]))] - 0.11, str(mb),
                ha="center", va="center", fontsize=8, color=_ink_on(CATEGORY_COLORS.get(cat, _OTHER)))
    ax.set_yticks(range(len(keys)), [f"stage {s}, replica {r}" for s, r in keys])
    ax.set_ylim(len(keys) - 0.5, -0.6)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time since the step's first event (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    shown = [c for c in CATEGORY_COLORS if any(cat == c for _, cat in bars)]
    shown += sorted({cat for _, cat in bars} - set(CATEGORY_COLORS))
    ax.legend(handles=[Patch(color=CATEGORY_COLORS.get(c, _OTHER), label=_LABELS.get(c, c or "other"))
                       for c in shown],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False)
    stages, replicas = len({s for s, _ in keys}), len({r for _, r in keys})
    ax.set_title(f"{title}  (P={stages}, D={replicas}, {span_ms:.1f} ms)")
    return fig


# --- throughput and P x D -------------------------------------------------------------------------------

def throughput_figure(report: Mapping[str, Any]) -> Figure:
    """Over the job's wall-clock time (report.json's runs): above, the samples per second of each
    run plan between its first and last step, with the calibration before the first plan, the
    first plan's start-up and the stalls of the morphs between plans shaded and labelled; below,
    the devices it held (P x D), labelled with the shape."""
    runs = [r for r in report.get("runs", ()) if r.get("start") is not None]
    if not runs:
        raise ValueError("the report has no run plan to draw")
    calibration = report.get("calibration")
    zero = min([r["start"] for r in runs] + ([calibration[0]] if calibration else []))
    total = max(r["end"] for r in runs) - zero
    unit, scale = ("min", 60.0) if total > 600 else ("s", 1.0)

    def t(x: float) -> float:
        return (x - zero) / scale

    fig = _figure(9.0, 5.5)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": (3, 2)})
    timed = [r for r in runs if r.get("samples_per_s")]
    for i, r in enumerate(timed):
        top.hlines(r["samples_per_s"], t(r["first_step_at"]), t(r["last_step_at"]), color=CATEGORY_COLORS["forward"],
                   lw=3, label=_RATE_LABEL if i == 0 else None)
        top.annotate(f"{r['shape']}", xy=((t(r["first_step_at"]) + t(r["last_step_at"])) / 2, r["samples_per_s"]),
                     xytext=(0, 5), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    stalls = [(a["last_step_at"], b["first_step_at"]) for a, b in zip(runs, runs[1:])
              if a.get("last_step_at") is not None and b.get("first_step_at") is not None]
    # before a plan's first step its workers start, build their stage and load the state: no
    # samples yet, but not a stall either (a stall is what a morph costs between two plans)
    startups = [(r["start"], r["first_step_at"]) for r in runs[:1] if r.get("first_step_at")]
    for ax in (top, bottom):
        if calibration:
            ax.axvspan(t(calibration[0]), t(calibration[1]), color=_CALIBRATION, alpha=0.6, lw=0,
                       label=_CALIBRATION_LABEL if ax is top else None)
        for a, b in startups:
            ax.axvspan(t(a), t(b), color=_STARTUP, alpha=0.5, lw=0, label=_STARTUP_LABEL if ax is top else None)
        for i, (a, b) in enumerate(stalls):
            ax.axvspan(t(a), t(b), color=_REDONE, alpha=0.45, lw=0,
                       label=_STALL_LABEL if i == 0 and ax is top else None)
        for i, r in enumerate(r for r in runs if r.get("after")):
            restart = r["after"].get("restart")
            ax.axvline(t(r["after"]["noticed_at"]), color=_RESTART if restart else _MORPH,
                       ls=":" if restart else "--", lw=1.4,
                       label=_NOTICED_LABEL if i == 0 and ax is top else None)
            if ax is top:
                ax.annotate(r["after"].get("cause", "").replace(" was lost", " lost"),
                            xy=(t(r["after"]["noticed_at"]), 1.0), xycoords=("data", "axes fraction"),
                            xytext=(-3, -4), textcoords="offset points", rotation=90, ha="right", va="top",
                            fontsize=8, color=_RESTART if restart else _MORPH,
                            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    if not timed:
        top.text(0.5, 0.5, "no step timing was recorded", transform=top.transAxes, ha="center", va="center",
                 color=_OTHER)
    top.set_ylabel("samples / s")
    top.set_ylim(bottom=0, top=max([r["samples_per_s"] for r in timed] or [1.0]) * 1.25)
    top.grid(True, alpha=0.3)
    _legend(top, [_RATE_LABEL, _CALIBRATION_LABEL, _STARTUP_LABEL, _NOTICED_LABEL, _STALL_LABEL], **_BESIDE)
    for r in runs:
        bottom.fill_between([t(r["start"]), t(r["end"])], 0, r["devices"], step="pre", color="#aec7e8",
                            edgecolor=CATEGORY_COLORS["forward"], lw=1.2)
        bottom.text((t(r["start"]) + t(r["end"])) / 2, r["devices"] / 2, r["shape"], ha="center", va="center",
                    fontsize=9)
    bottom.set_ylabel("devices (P × D)")
    bottom.set_ylim(0, max(r["devices"] for r in runs) * 1.2 + 0.5)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel(f"time since the job started ({unit})")
    bottom.grid(True, alpha=0.3)
    top.set_title(f"{report.get('job', '')}: throughput and P × D over time".lstrip(": "))
    return fig


# --- per-slot speed -------------------------------------------------------------------------------------

_PACE_LABEL, _STRAGGLER_LABEL = "slot", "straggler: the plan works around it"
_UNUSED_LABEL, _PAR_LABEL = "straggler left out of the last plan", "1.0: as fast as the fastest of its kind"
_MAX_SLOTS = 40   # beyond this the bars are too thin to read; the slowest are the ones that matter


def speed_figure(report: Mapping[str, Any]) -> Figure:
    """Each slot's slowdown (report.json's speeds): a bar per slot, how many times longer than the
    fastest slot of its device kind it computes a micro-batch, slowest on top, a line at 1.0; the
    stragglers in their own colour with their factor written beside them."""
    speeds = report.get("speeds") or {}
    paces = {str(k): float(v) for k, v in (speeds.get("paces") or {}).items()}
    stragglers = {str(k): float(v) for k, v in (speeds.get("stragglers") or {}).items()}
    # a straggler no plan uses any more is no longer measured: its last factor is all there is
    factors = {**stragglers, **paces}
    if not factors:
        raise ValueError("the report has no slot speeds to draw")
    order = sorted(factors, key=lambda slot: (slot not in stragglers, -factors[slot], slot))[:_MAX_SLOTS]
    fig = _figure(9.0, 1.6 + 0.32 * len(order))
    ax = fig.add_subplot()
    seen = set()
    for y, slot in enumerate(order):
        kind = ("pace" if slot not in stragglers else "straggler" if slot in paces else "unused")
        label = {"pace": _PACE_LABEL, "straggler": _STRAGGLER_LABEL, "unused": _UNUSED_LABEL}[kind]
        ax.barh(y, factors[slot], height=0.6, color=_MORPH if kind != "pace" else CATEGORY_COLORS["forward"],
                alpha=0.45 if kind == "unused" else 1.0, hatch="//" if kind == "unused" else None,
                edgecolor="white" if kind != "unused" else _MORPH, label=None if kind in seen else label)
        seen.add(kind)
        ax.annotate(f"{factors[slot]:.2f}x" + (" straggler" if kind != "pace" else ""), xy=(factors[slot], y),
                    xytext=(3, 0), textcoords="offset points", ha="left", va="center", fontsize=8,
                    color=_MORPH if kind != "pace" else "black")
    ax.axvline(1.0, color=_RESTART, ls="--", lw=1.2, label=_PAR_LABEL)
    ax.set_yticks(range(len(order)), order)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, max(max(factors[s] for s in order), 1.0) * 1.25)
    ax.set_xlabel("compute per micro-batch over the fastest slot of its kind (1.0 = as fast)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    _legend(ax, [_PACE_LABEL, _STRAGGLER_LABEL, _UNUSED_LABEL, _PAR_LABEL], **_BESIDE)
    n = len(stragglers)
    shown = f", the {len(order)} slowest of {len(factors)} slots" if len(order) < len(factors) else ""
    ax.set_title(f"{report.get('job', '')}: per-slot speed ({n} straggler{'s' * (n != 1)}{shown})".lstrip(": "))
    return fig
