"""Synthetic calibrations for tests of the planner, the simulator and the report."""

from __future__ import annotations

from trainer.planning.calibration import Calibration, LinkCost, SegmentCost, SegmentProfile


def report_calibration(n_segments: int = 4, kind: str = "cpu") -> Calibration:
    links = {"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e8)}
    sizes = (1, 2, 4)
    costs = tuple(SegmentCost(1e-3 * b, 2e-3 * b, 1e-3 * b, 10_000 * b, 10_000 * b) for b in sizes)
    return Calibration(model="m", device_kind=kind, micro_batch_sizes=sizes, input_bytes=tuple(100 * b for b in sizes),
                       segments=(SegmentProfile(1_000_000, 1_000_000, 1e-4, costs),) * n_segments, links=links,
                       allreduce=links)
