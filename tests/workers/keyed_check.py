"""Trains the models of tests/support/keyed_zoo.py (randomness inside forward) one after another in one
set of workers, each a fresh Varuna on one process group, and writes each one's per-step losses."""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import keyed_zoo  # noqa: E402

from trainer import Varuna  # noqa: E402
from trainer.worker_env import WorkerAssignment  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--models", default=",".join(keyed_zoo.MODELS))
p.add_argument("--steps", type=int, default=keyed_zoo.STEPS)
p.add_argument("--recompute", type=int, default=1)
p.add_argument("--schedule", default="varuna")
p.add_argument("--chunk-size", type=int, default=keyed_zoo.CHUNK)
p.add_argument("--store", default=None)
p.add_argument("--checkpoint-at", type=int, default=None)
p.add_argument("--resume", type=int, default=None)
args = p.parse_args()

a = WorkerAssignment.from_env()
dist.init_process_group("gloo", init_method=a.dist_url, rank=a.rank, world_size=a.world_size,
                        timeout=timedelta(seconds=120))
os.makedirs(args.out, exist_ok=True)
for name in args.models.split(","):
    varuna = Varuna(keyed_zoo.build(name), None, keyed_zoo.sample_batch, keyed_zoo.BATCH, args.chunk_size,
                    schedule=args.schedule, recompute=bool(args.recompute), seed=keyed_zoo.SEED)
    varuna.set_optimizer(keyed_zoo.optimizer(varuna.parameters()))
    if args.resume is not None:
        varuna.load_checkpoint(f"{args.store}/{name}", args.resume)
    record = []
    while varuna.iteration < args.steps:
        batch = keyed_zoo.global_batch(varuna.iteration)
        shard = keyed_zoo.BATCH // varuna.data_depth
        mine = {k: v[varuna.replica * shard:(varuna.replica + 1) * shard] for k, v in batch.items()}
        loss, _ = varuna.step(mine)
        record.append({"step": varuna.iteration - 1, "loss": loss})
        if args.checkpoint_at is not None and varuna.iteration == args.checkpoint_at:
            varuna.checkpoint(f"{args.store}/{name}")
    with open(f"{args.out}/{name}_losses_rank{varuna.rank}.json", "w") as f:
        json.dump({"record": record, "cuts": varuna.cuts}, f)
    varuna.close()
dist.destroy_process_group()
