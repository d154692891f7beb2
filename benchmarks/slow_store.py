"""A slow checkpoint store: what a checkpoint costs the step it follows, written in place or staged.

The tiny GPT at P = 2 (the local launcher, two CPU workers), a checkpoint every `--every` steps
into a store that takes `--rate` bytes per second (benchmarks/_slow_store_worker.py: a storage
backend whose writes sleep for their share, as a rate-limited mount would). Two runs:
- in place   each worker writes its files into the store before the step returns (what the final
             checkpoint and a notice's still do: they must be complete);
- staged     each worker writes them to a local directory and a background thread copies them
             into the store while training goes on (VARUNA_CHECKPOINT_TMPDIR; under varunad
             every periodic checkpoint, `--stage-checkpoints`, on by default); the next
             checkpoint waits for the previous copy.
For each: the median step without a checkpoint, and the most a checkpoint step took beyond it
(the stall), in seconds and in steps (the slower worker of each step). Staging hides the store's
latency, not its throughput: a store that cannot take one checkpoint per interval makes the next
checkpoint wait for the copy (try `--every 8`).

Run:  python benchmarks/slow_store.py [--rate BYTES_PER_S] [--steps N] [--every K]
The last line is  `bench slow_store: rate_mb_s=<r> checkpoint_mb=<one worker's share> step_s=<median>
in_place_stall_steps=<s> staged_stall_steps=<s>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.launch import launch  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_slow_store_worker.py"


def run(tmp: Path, name: str, *, rate: float, steps: int, every: int, staged: bool) -> list[float]:
    out, store = tmp / name / "out", tmp / name / "store"
    env = {"VARUNA_STORE": f"slow://{store}", "VARUNA_CHECKPOINT_EVERY": str(every)}
    if staged:
        env["VARUNA_CHECKPOINT_TMPDIR"] = str(tmp / name / "staging")
    result = launch(WORKER, ["--out", str(out), "--steps", str(steps), "--rate", str(rate)], stages=2, replicas=1,
                    timeout=600, env=env)
    if not result.ok:
        raise SystemExit(f"{name}: the run failed: {result.errors}")
    per_rank = [json.loads((out / f"times_rank{r}.json").read_text()) for r in (0, 1)]
    return [max(ts) for ts in zip(*per_rank)]


def stall(times: list[float], every: int) -> tuple[float, float]:
    """(median step without a checkpoint, the most a checkpoint step took beyond it); step 0 warms up."""
    at = {s for s in range(len(times)) if (s + 1) % every == 0}
    plain = statistics.median(t for s, t in enumerate(times) if s and s not in at)
    return plain, max(times[s] - plain for s in at)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1e6, help="bytes per second the store takes (default 1 MB/s)")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--every", type=int, default=32)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="varuna-slow-store-") as tmp:
        for name, staged in (("in place", False), ("staged", True)):
            times = run(Path(tmp), name.replace(" ", "_"), rate=args.rate, steps=args.steps, every=args.every,
                        staged=staged)
            rows.append((name, *stall(times, args.every)))
        share = max(f.stat().st_size for f in (Path(tmp) / "in_place" / "store").rglob("*.pt"))
        ckpt = sum(f.stat().st_size for d in sorted((Path(tmp) / "in_place" / "store").glob("varuna_ckpt_*"))[-1:]
                   for f in d.glob("*.pt"))
    print(f"{'checkpoint':<10} {'step s':>8} {'stall s':>8} {'stall steps':>12}")
    for name, plain, extra in rows:
        print(f"{name:<10} {plain:>8.3f} {extra:>8.3f} {extra / plain:>12.1f}")
    print(f"(a checkpoint of {ckpt / 1e6:.2f} MB, the largest file {share / 1e6:.2f} MB, into a store taking "
          f"{args.rate / 1e6:g} MB/s; a checkpoint every {args.every} of {args.steps} steps)")
    step = rows[1][1]
    print(f"bench slow_store: rate_mb_s={args.rate / 1e6:g} checkpoint_mb={ckpt / 2e6:.2f} step_s={step:.3f} "
          f"in_place_stall_steps={rows[0][2] / rows[0][1]:.1f} staged_stall_steps={rows[1][2] / rows[1][1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
