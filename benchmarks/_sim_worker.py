"""Worker of benchmarks/simulator.py, started by trainer.launch (so it runs in the workers'
environment: one torch thread, the workers' allocator settings). Two modes:

* train (default): trains the reference GPT and writes this rank's per-step wall times (after
  warm-up) to <out>/times_rank<rank>.json;
* --profile FILE: profiles the reference GPT (AdamW, like training) with `gpus_per_node=--slots`
  and writes the calibration to FILE (network costs from --network FILE when given).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer import GlobalBatches, Varuna  # noqa: E402
from trainer.data import TextDataset  # noqa: E402
from trainer.models.gpt import GPT, GPTConfig  # noqa: E402
from trainer.planning.calibration import Calibration  # noqa: E402
from trainer.profiler import Profiler  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", help="train: directory for times_rank<r>.json")
p.add_argument("--config", required=True, help="JSON GPTConfig fields")
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--chunk-size", type=int, default=4)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--profile", metavar="FILE", help="profile instead of training; write the calibration here")
p.add_argument("--sizes", default="2,4", help="profile: micro-batch sizes")
p.add_argument("--slots", type=int, default=1, help="profile: worker slots busy at once")
p.add_argument("--repeats", type=int, default=5, help="profile: timed repeats")
p.add_argument("--network", metavar="FILE", help="profile: take the network costs from this calibration")
p.add_argument("--in-flight", type=int, help="profile: micro-batches in flight (default: the profiler's)")
args = p.parse_args()

torch.manual_seed(0)
cfg = GPTConfig(**json.loads(args.config))
model = GPT(cfg, seed=0)
data = TextDataset(cfg.seq_len, num_examples=256, seed=0)

if args.profile:
    torch.set_num_threads(int(os.environ.get("VARUNA_THREADS", "1")))
    net = {}
    if args.network:
        known = Calibration.load(args.network)
        net = {"links": dict(known.links), "allreduce": dict(known.allreduce)}
    prof = Profiler(model, data.sample_batch, gpus_per_node=args.slots, out_folder=os.path.dirname(args.profile),
                    from_cache=False, repeats=args.repeats, in_flight=args.in_flight, **net)
    prof.set_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    prof.profile_all([int(s) for s in args.sizes.split(",")]).save(args.profile)
    raise SystemExit(0)

varuna = Varuna(model, None, data.sample_batch, args.batch_size, args.chunk_size)
varuna.set_optimizer(torch.optim.AdamW(varuna.parameters(), lr=args.lr))
batches = GlobalBatches(len(data), args.batch_size, seed=0)
total = args.warmup + args.steps
shards = [data.batch(batches.shard(s, varuna.replica, varuna.data_depth)) for s in range(total)]
times = []
for s in range(total):
    start = time.perf_counter()
    varuna.step(shards[s])
    if s >= args.warmup:
        times.append(time.perf_counter() - start)
os.makedirs(args.out, exist_ok=True)
with open(f"{args.out}/times_rank{varuna.rank}.json", "w") as f:
    json.dump({"stage": varuna.stage, "replica": varuna.replica, "cuts": varuna.cuts, "times": times}, f)
varuna.close()
