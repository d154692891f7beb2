"""Calibrates the tiny GPT with a large vocabulary on the CPU, under a calibration run's malloc
setting (blocks of 1 MiB and more handed back once freed: trainer.engine.memory), and prints one
JSON line: each segment's measured working bytes at `--size`, and the logits' bytes of one
micro-batch, which dominate the loss segment's."""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.tiny_gpt import tiny_gpt  # noqa: E402

from trainer import Profiler  # noqa: E402
from trainer.engine.memory import return_freed_blocks  # noqa: E402
from trainer.planning.calibration import LinkCost  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=16384)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--size", type=int, default=4)
args = p.parse_args()

assert return_freed_blocks(), "glibc's mallopt is not there"
torch.manual_seed(0)
torch.set_num_threads(1)
model, data = tiny_gpt(vocab_size=args.vocab, seq_len=args.seq)
link = LinkCost(1e-4, 1e9)
with tempfile.TemporaryDirectory() as folder:
    prof = Profiler(model, data.sample_batch, out_folder=folder, links={"intra": link}, allreduce={"intra": link},
                    repeats=1, warmup=1)
    prof.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    cal = prof.profile_all([args.size])
print(json.dumps({"working": [s.costs[0].working_bytes for s in cal.segments],
                  "saved": [s.costs[0].peak_activation_bytes for s in cal.segments],
                  "logits": args.size * args.seq * args.vocab * 4}))
