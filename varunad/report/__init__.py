"""Job reports: what a run did and cost, recorded as data, drawn as pictures elsewhere.

    record     the report's data files (loss.json, trace*.json, cost.json, report.json/.txt):
               what the leader writes into <job store>/report/ when a job ends
    cost       device time, dollars and the time lost to morphs
    traces     the measured step and the simulator's predicted one as Chrome traces; reading trace files
    pictures   `varunactl report`'s PNGs from those files; imports draw only when asked
    draw       the matplotlib figures (the optional `report` extra)

Layer 4 of varunad (store < cluster < control < report < node < ctl; tests/unit/test_imports.py checks it).
May import: varunad.store, varunad.cluster, varunad.control (jobs, records, the job's status) and
trainer's numpy-only planning modules (calibration, schedule, simulator). Never varunad.node or ctl. Never torch; matplotlib only in draw, so a daemon (whose leader writes
the data) runs without it. Importing this package imports neither.
"""

from varunad.report.cost import Interval, cost_report, morph_losses, run_intervals
from varunad.report.record import (
    DATA_FILES,
    PICTURES,
    ReportInputs,
    build_report,
    collect,
    format_report,
    write_end_of_job_report,
)
from varunad.report.traces import MeasuredStep, pick_measured_step, predict

__all__ = ["DATA_FILES", "PICTURES", "ReportInputs", "Interval", "MeasuredStep", "collect", "run_intervals",
           "morph_losses", "cost_report", "predict", "pick_measured_step", "build_report", "format_report",
           "write_end_of_job_report"]
