"""Trains the models of tests/support/keyed_zoo.py (randomness inside forward) one after another in one
set of workers, each a fresh Varuna on one process group, and writes each one's per-step losses.

Each replica passes its even shard, as scripts written before uneven shares do, whatever shares the
plan gives; --own-share passes the replica's share instead (`varuna.shares`), and --reverse-replicas
numbers the replicas against the ranks (a stage_to_rank_map), so that replica order is not rank order;
--evaluate adds the loss of an evaluation batch passed both ways."""

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
p.add_argument("--own-share", action="store_true")
p.add_argument("--reverse-replicas", action="store_true")
p.add_argument("--evaluate", action="store_true")
args = p.parse_args()

a = WorkerAssignment.from_env()
dist.init_process_group("gloo", init_method=a.dist_url, rank=a.rank, world_size=a.world_size,
                        timeout=timedelta(seconds=120))
os.makedirs(args.out, exist_ok=True)


def mine_of(varuna, batch, own):
    """This replica's part of a global batch: its share of an uneven plan, or its even shard."""
    if own and varuna.shares is not None:
        start, size = sum(varuna.shares[:varuna.replica]), varuna.shares[varuna.replica]
    else:
        size = keyed_zoo.BATCH // varuna.data_depth
        start = varuna.replica * size
    return {k: v[start:start + size] for k, v in batch.items()}


for name in args.models.split(","):
    stage_to_rank = {s: list(reversed(row)) for s, row in a.plan.stage_to_rank.items()} if args.reverse_replicas else None
    varuna = Varuna(keyed_zoo.build(name), stage_to_rank, keyed_zoo.sample_batch, keyed_zoo.BATCH, args.chunk_size,
                    schedule=args.schedule, recompute=bool(args.recompute), seed=keyed_zoo.SEED)
    varuna.set_optimizer(keyed_zoo.optimizer(varuna.parameters()))
    if args.resume is not None:
        varuna.load_checkpoint(f"{args.store}/{name}", args.resume)
    record = []
    while varuna.iteration < args.steps:
        batch = keyed_zoo.global_batch(varuna.iteration)
        mine = mine_of(varuna, batch, args.own_share)
        loss, _ = varuna.step(mine)
        record.append({"step": varuna.iteration - 1, "loss": loss})
        if args.checkpoint_at is not None and varuna.iteration == args.checkpoint_at:
            varuna.checkpoint(f"{args.store}/{name}")
    evaluated = {}
    if args.evaluate:
        held_out = keyed_zoo.global_batch(10_000)
        evaluated = {"eval": varuna.evaluate(mine_of(varuna, held_out, own=False)),
                     "eval_own": varuna.evaluate(mine_of(varuna, held_out, own=True))}
    with open(f"{args.out}/{name}_losses_rank{varuna.rank}.json", "w") as f:
        json.dump({"record": record, "cuts": varuna.cuts, **evaluated}, f)
    varuna.close()
dist.destroy_process_group()
