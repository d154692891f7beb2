"""Trains several models of tests/support/zoo.py one after another in one set of workers (each a
fresh Varuna on one process group, so a launcher run covers many models) and writes each
one's per-step losses and (replica 0) its stage's final parameters."""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import zoo  # noqa: E402

from trainer import Varuna  # noqa: E402
from trainer.worker_env import WorkerAssignment  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--models", required=True, help="comma-separated names from tests/support/zoo.py, "
               "each optionally name@schedule")
p.add_argument("--steps", type=int, default=zoo.STEPS)
p.add_argument("--store", default=None)
p.add_argument("--checkpoint-at", type=int, default=None)
p.add_argument("--resume", type=int, default=None)
args = p.parse_args()

a = WorkerAssignment.from_env()
# One process group for all the models: each Varuna finds it initialised and leaves it alone.
dist.init_process_group("gloo", init_method=a.dist_url, rank=a.rank, world_size=a.world_size,
                        timeout=timedelta(seconds=120))
os.makedirs(args.out, exist_ok=True)
for spec in args.models.split(","):
    name, _, schedule = spec.partition("@")
    model = zoo.build(name)
    varuna = Varuna(model, None, zoo.sample_batch_fn(name), zoo.BATCH, zoo.CHUNK,
                    schedule=schedule or "varuna", shared_weights=zoo.SHARED.get(name))
    varuna.set_optimizer(zoo.optimizer(varuna.parameters(), name))
    if args.resume is not None:
        varuna.load_checkpoint(args.store, args.resume)
    record = []
    while varuna.iteration < args.steps:
        batch = zoo.global_batch(name, varuna.iteration)
        shard = zoo.BATCH // varuna.data_depth
        mine = {k: v[varuna.replica * shard:(varuna.replica + 1) * shard] for k, v in batch.items()}
        loss, _ = varuna.step(mine)
        record.append({"step": varuna.iteration - 1, "loss": loss})
        if args.checkpoint_at is not None and varuna.iteration == args.checkpoint_at:
            varuna.checkpoint(args.store)
    tag = spec.replace("@", "_")
    with open(f"{args.out}/{tag}_losses_rank{varuna.rank}.json", "w") as f:
        json.dump({"record": record, "cuts": varuna.cuts}, f)
    if varuna.replica == 0:
        torch.save({n: t.detach() for n, t in varuna.named_parameters()}, f"{args.out}/{tag}_params_rank{varuna.rank}.pt")
    varuna.close()
dist.destroy_process_group()
