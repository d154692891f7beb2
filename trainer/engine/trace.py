"""Per-worker Chrome trace events (open the files in Perfetto or chrome://tracing).

Each worker records what it does as complete ("X") events: the categories the engine uses are
CATEGORIES below; `micro_batch` and the current step go into the event's args. pid is the
stage and tid the replica, so every worker of a P x D job gets its own row under a
"stage k" process once all the files are loaded together (Perfetto merges them), and
`varunactl report --traces DIR` draws them as one picture.

Timestamps are microseconds on a wall-clock axis: `time.time()` read once when the recorder
starts, advanced with `time.perf_counter()` (monotonic, fine-grained). Workers on one machine
therefore line up to within microseconds, and workers on NTP-synchronised machines to within
the clock skew.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["CATEGORIES", "TraceRecorder", "NullRecorder", "trace_path", "recorder_for"]

CATEGORIES = ("forward", "recompute", "backward", "send", "recv", "allreduce", "optimizer")


def trace_path(trace_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank `rank` writes its trace inside `trace_dir`."""
    return Path(trace_dir) / f"trace-rank{rank:04d}.json"


class TraceRecorder:
    """Collects one worker's events in memory; `save()` writes them as a Chrome trace JSON file."""

    enabled = True

    def __init__(self, path: str | os.PathLike[str], *, rank: int, stage: int, replica: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.stage = stage
        self.replica = replica
        self.step: int | None = None
        self._perf0 = time.perf_counter()
        self._wall0_us = time.time() * 1e6
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}},
            {"name": "process_sort_index", "ph": "M", "pid": stage, "args": {"sort_index": stage}},
            {"name": "thread_name", "ph": "M", "pid": stage, "tid": replica,
             "args": {"name": f"replica {replica} (rank {rank})"}},
            {"name": "thread_sort_index", "ph": "M", "pid": stage, "tid": replica,
             "args": {"sort_index": replica}},
        ]

    def now_us(self) -> float:
        return self._wall0_us + (time.perf_counter() - self._perf0) * 1e6

    def set_step(self, step: int) -> None:
        """Tag the events that follow with `step` (the timeline can draw one step)."""
        self.step = step

    @contextmanager
    def span(self, name: str, cat: str, micro_batch: int | None = None, **args: Any) -> Iterator[None]:
        """Record the enclosed work as one event, even if it raises (its duration is still real)."""
        start = self.now_us()
        try:
            yield
        finally:
            end = self.now_us()
            event_args = dict(args)
            if micro_batch is not None:
                event_args["micro_batch"] = micro_batch
            if self.step is not None:
                event_args["step"] = self.step
            self.events.append({
                "name": name, "cat": cat, "ph": "X",
                "ts": round(start, 3), "dur": round(end - start, 3),
                "pid": self.stage, "tid": self.replica, "args": event_args,
            })

    def save(self) -> Path:
        """Write every event so far (atomically: readers never see half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {"rank": self.rank, "stage": self.stage, "replica": self.replica},
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, self.path)
        return self.path


class NullRecorder:
    """Same interface as TraceRecorder, records nothing: used when tracing is off."""

    enabled = False
    step: int | None = None

    def set_step(self, step: int) -> None:
        pass

    @contextmanager
    def span(self, name: str, cat: str, micro_batch: int | None = None, **args: Any) -> Iterator[None]:
        yield

    def save(self) -> None:
        return None


def recorder_for(trace_dir: str | os.PathLike[str] | None, *, rank: int, stage: int, replica: int
                 ) -> TraceRecorder | NullRecorder:
    """A recorder writing to `trace_path(trace_dir, rank)`, or a NullRecorder when trace_dir is None."""
    if trace_dir is None:
        return NullRecorder()
    return TraceRecorder(trace_path(trace_dir, rank), rank=rank, stage=stage, replica=replica)
