"""The chaos suite as a table: one fault per scenario against real etcd, daemons and workers.

The scenarios are tests/support/chaos_harness.py's (the same ones tests/integration/chaos/ asserts on): kill -9
of a VM, of the leader, of two VMs at once, SIGTERM to the leader, etcd SIGKILLed and restarted,
etcd frozen (SIGSTOP) for 3 TTLs, one member of a 3-member etcd lost, its quorum lost briefly, a
daemon frozen (SIGSTOP of its process group) for 3 TTLs, the newest checkpoint corrupted, garbage
in every etcd key family and plans no leader wrote, then garbage and forged reports on every socket
(one run: the epoch must survive them), etcd's history compacted and etcd restarted before the
leader is killed, etcd compacting every second through a kill, a join and a notice, and the
checkpoint store full (alone, and while a VM is lost) and read-only for a while (root: a tmpfs
and a bind mount). For each: whether the job
finished, whether its per-step losses equal the plain PyTorch loop (1e-4), how many steps were
redone, seconds from the fault to the next new step, and whether anything was left running.

Run:  python benchmarks/chaos.py [--quick] [--only NAME[,NAME]]
--quick runs every scenario once with the short job (14 steps, a checkpoint every 4, TTL 2 s);
without it the job is twice as long. The last line is
`bench chaos: scenarios=<n> finished=<n> equal=<n> max_redone=<n>`.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from support.chaos_harness import EVERY, SCENARIOS, STEPS, run_named  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each scenario once with the short job")
    ap.add_argument("--only", help="comma-separated scenario names (default: all): " + ", ".join(SCENARIOS))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="varunad-chaos-") as tmp:
        for name in names:
            overrides = {} if args.quick else {"steps": 2 * SCENARIOS[name].get("steps", STEPS)}
            t0 = time.monotonic()
            out = run_named(name, Path(tmp) / name, **overrides)
            rows.append((out, time.monotonic() - t0))
            print(f"  {name}: {'ok' if not out.problems(EVERY) else '; '.join(out.problems(EVERY))[:200]}",
                  file=sys.stderr, flush=True)
    print(f"{'scenario':<20} {'finished':>8} {'equal':>6} {'redone':>6} {'allowed':>7} {'fault->step s':>13} "
          f"{'left':>5} {'morphs':>6} {'wall s':>7}")
    for out, wall in rows:
        rec = "-" if math.isnan(out.recovery_s) else f"{out.recovery_s:.1f}"
        print(f"{out.scenario:<20} {str(out.finished):>8} {str(out.equal):>6} {out.redone:>6} {out.max_redone:>7} "
              f"{rec:>13} {len(out.left_running):>5} {len(out.state.get('morphs', [])):>6} {wall:>7.0f}")
    finished = sum(o.finished for o, _ in rows)
    equal = sum(o.equal for o, _ in rows)
    max_redone = max((o.redone for o, _ in rows), default=0)
    print(f"(checkpoint every {EVERY} steps: one interval may be redone, two when the newest checkpoint is refused; "
          f"{time.monotonic() - started:.0f} s in all)")
    print(f"bench chaos: scenarios={len(rows)} finished={finished} equal={equal} max_redone={max_redone}")
    return 0 if all(not o.problems(EVERY) for o, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
