"""A job report built from hand-made inputs, for the report tests (in-process and with varunactl)."""

from __future__ import annotations

from pathlib import Path

from support.calibrations import report_calibration
from trainer.engine.trace import TraceRecorder, trace_path
from trainer.planning.schedule import build_table
from trainer.planning.simulator import simulate, stage_costs
from varunad.control.jobs import JobSpec, JobState, MorphEvent
from varunad.report import ReportInputs, build_report
from varunad.report.prices import DEFAULT_PRICES


def morphed_report(root: Path) -> tuple[Path, dict]:
    """The report of a 60-step job that ran 2x2 on steps 0-27, lost vm4 (lease, re-plan), and
    resumed as 2x1 from the checkpoint at step 20, traced in the new epoch, with two stragglers."""
    cal = report_calibration()
    events: list[dict] = []
    simulate(build_table("varuna", 2, 4, True), stage_costs([cal, cal], [0, 2, 4], 2, 1, ["inter"], ["inter"] * 2),
             events=events)
    for stage in range(2):   # the simulated step as two workers' traces of steps 40 (warm-up) and 41
        rec = TraceRecorder(trace_path(root / "store" / "traces" / "epoch3", stage), rank=stage, stage=stage,
                            replica=0)
        rec.events += [{**e, "ts": e["ts"] + 1e5 * k, "args": {**e["args"], "step": step}}
                       for k, step in enumerate((40, 41)) for e in events if e["pid"] == stage]
        rec.save()
    spec = JobSpec(job="gpt", script="t.py", batch_size=16, steps=60, checkpoint_every=10, bundle_digest="0" * 64,
                   bundle_bytes=1)
    lost = MorphEvent(reason="vm4 was lost: its lease expired", from_shape="2x2", to_shape="2x1", from_epoch=1,
                      to_epoch=3, noticed_at=1100.0, stopped_at=1104.0, planned_at=1106.0, checkpoint=True,
                      cause="vm4 was lost")
    plan = {"P": 2, "D": 1, "micro_batch_size": 2, "cuts": [1], "calibrated": True, "schedule": "varuna",
            "members": ["a", "b"], "stage_kinds": ["cpu", "cpu"], "recompute": [True, False], "link_kinds": ["inter"],
            "allreduce_kinds": ["inter", "inter"], "micro_batches": 4, "device_kinds": {"cpu": 2}}
    state = JobState(job="gpt", state="done", epoch=3, epochs=(1, 3), started_at=1000.0, finished_at=1300.0,
                     morphs=(lost,), plan=plan)
    status = {"step": 60, "epochs": {"1": [0, 27], "3": [20, 59]},
              "epoch_spans": {"1": [1003.0, 1098.0], "3": [1125.0, 1295.0]},
              "loss_history": [[s, 4.0 / (1 + s / 10)] for s in range(60)],
              # b/0 computes 2.4x slower than a/0 and the plan gives it fewer layers; c/0, slower
              # still, is in no plan (no longer measured)
              "paces": {"a/0": 1.0, "b/0": 2.4}, "stragglers": {"b/0": 2.4, "c/0": 3.1}}
    inputs = ReportInputs(spec=spec, state=state, status=status, calibrations={"cpu": cal.to_bytes()},
                          store_dir=str(root / "store"), now=1400.0)
    doc = build_report(inputs, root / "report", DEFAULT_PRICES)
    return root / "report", doc
