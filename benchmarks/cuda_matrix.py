"""The correctness matrix on CUDA: every P x D the GPU host can hold computes what a plain loop computes.

For a lent GPU machine (not CI: CI has no GPU). Each shape runs tests/workers/train_check.py under
the local launcher (real worker processes, ZeroMQ streams between stages, NCCL all-reduce between
replicas on CUDA tensors) for the tiny GPT, and compares its per-step losses with the plain
single-process loop of tests/support/reference.py run on the same GPU and on the CPU.

With one GPU every worker shares it (``--device cuda:0``). NCCL refuses two ranks of one
communicator on one GPU ('Duplicate GPU detected'), so ranks that find they share one (their GPUs'
UUIDs in the rendezvous store, trainer.engine.groups) reduce CUDA tensors over gloo: every shape
runs, NCCL itself only at 1x1. With a GPU
per rank (``--device cuda``) every shape runs on NCCL. Measured on one H200 (torch 2.11, NCCL
2.28.9) before the gloo fallback: 1x1 ran, 1.0e-7 from the plain loop on the same GPU; every other
shape stopped at NCCL's duplicate-GPU check.

Run:  python benchmarks/cuda_matrix.py [--device cuda:0] [--shapes 1x1,2x1,4x1,1x2,2x2]
The last line is `bench cuda: shapes=<n> ran=<n> equal=<n> max_rel=<x>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from support.reference import reference_run  # noqa: E402  (tests/support/reference.py: the plain loop)

from trainer.launch import launch  # noqa: E402

WORKER = REPO / "tests" / "workers" / "train_check.py"
STEPS, BATCH = 5, 12


def run_shape(stages: int, replicas: int, device: str, out: Path) -> tuple[list[float] | None, str, float]:
    t0 = time.monotonic()
    result = launch(WORKER, ["--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH)],
                    stages=stages, replicas=replicas, timeout=300, device=device)
    wall = time.monotonic() - t0
    if not result.ok:
        why = (result.reason + " " + " | ".join(result.errors[-3:]))[-300:]
        return None, why, wall
    last = stages - 1  # the last stage's replica 0 reports the losses
    record = json.loads((out / f"losses_rank{last}.json").read_text())["record"]
    return [r["loss"] for r in record], "", wall


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="what every worker gets (cuda: one GPU per rank)")
    ap.add_argument("--shapes", default="1x1,2x1,4x1,1x2,2x2")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="relative, per step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: this benchmark is for a GPU host", file=sys.stderr)
        return 2
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    on_gpu, on_cpu = reference_run(STEPS, BATCH, device="cuda:0")[0], reference_run(STEPS, BATCH)[0]
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
    print(f"plain loop on the GPU vs on the CPU: max rel {rel(on_gpu, on_cpu):.2e}")
    one_gpu = args.device != "cuda"
    print(f"{'shape':<6} {'ran':>4} {'collectives':>11} {'max rel vs plain GPU':>21} {'max rel vs CPU':>15} "
          f"{'wall s':>7}  note")
    ran = equal = 0
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="varuna-cuda-") as tmp:
        for stages, replicas in shapes:
            over = "gloo" if one_gpu and stages * replicas > 1 else "nccl"
            losses, why, wall = run_shape(stages, replicas, args.device, Path(tmp) / f"{stages}x{replicas}")
            if losses is None:
                print(f"{stages}x{replicas:<4} {'no':>4} {over:>11} {'-':>21} {'-':>15} {wall:>7.1f}  {why}")
                continue
            ran += 1
            r_gpu, r_cpu = rel(losses, on_gpu), rel(losses, on_cpu)
            worst = max(worst, r_gpu)
            equal += r_gpu <= args.tolerance
            print(f"{stages}x{replicas:<4} {'yes':>4} {over:>11} {r_gpu:>21.2e} {r_cpu:>15.2e} {wall:>7.1f}  "
                  f"losses {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"bench cuda: shapes={len(shapes)} ran={ran} equal={equal} max_rel={worst:.2e}")
    return 0 if ran and equal == ran else 1


if __name__ == "__main__":
    sys.exit(main())
