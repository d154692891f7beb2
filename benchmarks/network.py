"""The plan follows the network: one job over two "VMs" (network namespaces on a bridge, as root),
their links uncapped and capped at 1 Gbit/s, 100 Mbit/s and 10 Mbit/s by `tc tbf`.

For each speed both daemons start afresh (new VMs: the leader has them measure the link between
them, varunad.control.links), the wide job (tests/integration/netns/wide_job.py: activations large for its compute)
is submitted, and the table shows the link as measured (and as a ratio of the cap, the limit
measured in the same run), the plan chosen, its estimated step, the measured steady step (the
median from rank 0's log, warm-up steps and the final checkpoint's step left out: the estimate is
of a steady step; tests/support/linkrun.py), and the error. One one-thread slot per VM (two workers
on two cores): other work on the machine's cores shows in the measured column.

Run (as root):  python benchmarks/network.py [--steps N] [--batch B]
The last line is `bench network: max_error=<...> plans=<distinct plans chosen>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.fabric import Fabric, _rate_bits, unavailable_reason  # noqa: E402
from support.linkrun import FabricRing, run_once, table  # noqa: E402

RATES = (None, "1gbit", "100mbit", "10mbit")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(f"bench network: skipped ({why})")
        return 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="varunad-bench-network-") as tmp:
        fabric = Fabric(2, Path(tmp))
        fabric.up()
        ring = None
        try:
            ring = FabricRing(fabric, "/bench-network/")
            for rate in RATES:
                runs.append(run_once(fabric, ring, rate, steps=args.steps, batch=args.batch))
                print(f"  {rate or 'uncapped'}: {runs[-1].shape} mb {runs[-1].micro_batch}, estimated "
                      f"{runs[-1].estimated_s:.4f}s, measured {runs[-1].measured_s:.4f}s", flush=True)
        finally:
            if ring is not None:
                ring.close()
            fabric.close()
    table(runs)
    for r in runs:
        if r.rate:
            print(f"  {r.rate}: measured link / cap = {r.bandwidth_Bps * 8 / _rate_bits(r.rate):.2f}")
    plans = sorted({f"{r.shape}/mb{r.micro_batch}" for r in runs})
    print(f"bench network: max_error={max(r.error for r in runs):.3f} plans={len(plans)} ({' '.join(plans)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
