"""Hand-made trace files: one step of one worker, as the trace recorder writes it."""

from __future__ import annotations

from trainer.engine.trace import TraceRecorder, trace_path


def trace_step(directory, stage: int, replica: int, rank: int, step: int, t0: float) -> TraceRecorder:
    rec = TraceRecorder(trace_path(directory, rank), rank=rank, stage=stage, replica=replica)
    for i, cat in enumerate(("forward", "recompute", "backward", "allreduce")):
        rec.events.append({"name": cat, "cat": cat, "ph": "X", "ts": t0 + 1000 * i, "dur": 900, "pid": stage,
                           "tid": replica, "args": {"step": step, "micro_batch": 0}})
    return rec
