"""Calibrates the issue's model (an MLP of `--depth` layers of `--width`, a CutPoint after each
but the last, Adam) on the CPU and prints one JSON line: the model's weight bytes and the
calibration's resident high-water growth, measured from the captured model (what any worker
holds before it trains) to the end of `profile_all`. Run in a process of its own, under the
workers' malloc settings, so the high-water mark is this calibration's alone."""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory_job"))
from mlp import MLP  # noqa: E402  (the issue's model, as the memory job and benchmark build it)

from trainer import Profiler  # noqa: E402
from trainer.engine.memory import PeakMemory  # noqa: E402
from trainer.planning.calibration import LinkCost  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=2048)
p.add_argument("--depth", type=int, default=8)
p.add_argument("--sizes", type=int, nargs="+", default=[4])
args = p.parse_args()


torch.manual_seed(0)
torch.set_num_threads(1)
model = MLP(args.width, args.depth)
batch = lambda b, device=None: {"x": torch.randn(b, args.width), "y": torch.randn(b, args.width)}  # noqa: E731
link = LinkCost(1e-4, 1e9)
with tempfile.TemporaryDirectory() as folder:
    prof = Profiler(model, batch, out_folder=folder, links={"intra": link}, allreduce={"intra": link},
                    repeats=2, warmup=1)
    prof.set_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    meter = PeakMemory(torch.device("cpu"))   # VmHWM starts again from the current resident size
    cal = prof.profile_all(args.sizes)
    growth = meter.growth_bytes()   # the profiler's own resets of the mark inside kept
weights = sum(q.numel() * q.element_size() for q in model.parameters())
print(json.dumps({"weights": weights, "growth": growth, "segments": cal.n_segments,
                  "segment_bytes": max(s.param_bytes for s in cal.segments)}))
