"""How long planning takes as the fleet grows (the daemon re-plans on every membership change).

    python benchmarks/planner_speed.py

Model: the GPT-2 8.3B calibration derived in paper_scale.py (72 segments, micro-batch sizes
1/2/4/8), global batch 8192, 4 slots per host. The mixed fleets add a second device kind that is
2.5x slower per sample with the same memory. Each time is the median of 3 runs of `plan`.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from paper_scale import GLOBAL_BATCH, GPU_MEMORY, gpt2_8b_calibration  # noqa: E402

from trainer.planning.calibration import Calibration  # noqa: E402
from trainer.planning.planner import Slot, plan  # noqa: E402


def slower(cal: Calibration, kind: str, factor: float) -> Calibration:
    segments = tuple(
        replace(seg, costs=tuple(
            replace(c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor,
                    recompute_s=c.recompute_s * factor) for c in seg.costs))
        for seg in cal.segments
    )
    return replace(cal, device_kind=kind, segments=segments)


def fleet(n: int, kind: str, prefix: str) -> list[Slot]:
    return [Slot(f"{prefix}{i // 4:03d}/{i % 4}", f"{prefix}{i // 4:03d}", kind, GPU_MEMORY) for i in range(n)]


def main() -> None:
    fast = gpt2_8b_calibration()
    slow = slower(fast, "slow-16g", 2.5)
    cases = [
        ("v100", fleet(16, "v100-16g", "a"), [fast]),
        ("v100", fleet(64, "v100-16g", "a"), [fast]),
        ("v100", fleet(256, "v100-16g", "a"), [fast]),
        ("v100", fleet(1000, "v100-16g", "a"), [fast]),
        ("v100+slow", fleet(200, "v100-16g", "a") + fleet(200, "slow-16g", "b"), [fast, slow]),
        ("v100+slow", fleet(600, "v100-16g", "a") + fleet(400, "slow-16g", "b"), [fast, slow]),
    ]
    print(f"{'slots':>6}  {'kinds':<10}  {'plan':<11}  {'mbs':>3}  {'m':>5}  {'est_s':>8}  {'plan_ms':>8}  note")
    for kinds, slots, cals in cases:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            p = plan(slots, GLOBAL_BATCH, cals)
            times.append(time.perf_counter() - t0)
        used = "+".join(sorted({s.device_kind for s in p.stages}))
        left = next((n for n in p.notes if n.startswith("left out")), "")
        print(f"{len(slots):>6}  {kinds:<10}  {p.P:>3} x {p.D:<5}  {p.micro_batch_size:>3}  {p.micro_batches:>5}  "
              f"{p.estimated_s:8.1f}  {statistics.median(times) * 1000:8.0f}  uses {used} {left[:60]}")


if __name__ == "__main__":
    main()
