"""Synthetic calibrations for tests of the planner, the simulator, the memory estimate, link
measurements and the report: one builder, ``calibration``, of identical segments whose costs
scale linearly with the micro-batch size (``Calibration.uniform`` with the tests' defaults), and
``report_calibration``, the report tests' instance of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainer.planning.calibration import Calibration, LinkCost


def calibration(segments: int = 4, *, model: str = "m", kind: str = "cpu", sizes: Sequence[int] = (1,),
                forward_s: float = 1e-3, backward_s: float | None = None, recompute_s: float | None = None,
                activation_bytes: int = 1000, peak_activation_bytes: int | None = None, input_bytes: int = 100,
                param_bytes: int = 1000, optimizer_bytes: int = 1000, step_s: float = 0.0,
                links: Mapping[str, LinkCost], allreduce: Mapping[str, LinkCost] | None = None) -> Calibration:
    """``segments`` identical segments; per sample: ``forward_s``, ``backward_s`` (default twice
    the forward), ``recompute_s`` (default the forward), ``activation_bytes`` and
    ``peak_activation_bytes`` (default the activations) and ``input_bytes``. ``allreduce``
    defaults to ``links``."""
    return Calibration.uniform(
        model=model, device_kind=kind, segments=segments, micro_batch_sizes=sizes, forward_s=forward_s,
        backward_s=2 * forward_s if backward_s is None else backward_s, recompute_s=recompute_s,
        activation_bytes=activation_bytes,
        peak_activation_bytes=activation_bytes if peak_activation_bytes is None else peak_activation_bytes,
        param_bytes=param_bytes, optimizer_bytes=optimizer_bytes, step_s=step_s, input_bytes=input_bytes,
        links=links, allreduce=allreduce,
    )


def report_calibration(n_segments: int = 4, kind: str = "cpu") -> Calibration:
    return calibration(n_segments, kind=kind, sizes=(1, 2, 4), activation_bytes=10_000, param_bytes=1_000_000,
                       optimizer_bytes=1_000_000, step_s=1e-4,
                       links={"intra": LinkCost(50e-6, 5e9), "inter": LinkCost(200e-6, 1e8)})
