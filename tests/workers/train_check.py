"""A Varuna training script the correctness tests launch: trains the tiny GPT for a few steps
and writes every rank's per-step losses and (replica 0) its stage's final parameters."""

import argparse
import json
import os

import torch

from trainer import GlobalBatches, Varuna
from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch-size", type=int, default=12)
p.add_argument("--chunk-size", type=int, default=4)
p.add_argument("--schedule", default="varuna")
p.add_argument("--recompute", type=int, default=1, help="1 on, 0 off, -1 as the plan says (VARUNA_PLAN)")
p.add_argument("--dropout", type=float, default=0.0)
p.add_argument("--precision", default="fp32")
p.add_argument("--init-loss-scale", type=float, default=2.0**20)
p.add_argument("--store", default=None, help="checkpoint store")
p.add_argument("--checkpoint-at", type=int, default=None, help="checkpoint after this many steps")
p.add_argument("--tmpdir", default=None, help="stage the checkpoint here and copy it in the background")
p.add_argument("--resume", type=int, default=None, help="load this checkpoint before training")
p.add_argument("--grads", action="store_true", help="do one forward/backward and dump gradients, no step")
p.add_argument("--clip", type=float, default=None, help="global gradient-norm clipping")
args = p.parse_args()

torch.manual_seed(1234)
cfg = GPTConfig.preset("tiny", dropout=args.dropout)
model = GPT(cfg, seed=0)
data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
varuna = Varuna(model, None, data.sample_batch, args.batch_size, args.chunk_size,
                precision=args.precision, schedule=args.schedule,
                recompute=None if args.recompute < 0 else bool(args.recompute))
# SGD with momentum: stateful (checkpoints carry its buffers) but, unlike Adam, it does not
# blow float summation-order noise on near-zero gradients up to full-size updates.
opt = torch.optim.SGD(varuna.parameters(), lr=0.1, momentum=0.9)
varuna.set_optimizer(opt, init_loss_scale=args.init_loss_scale)
if args.resume is not None:
    varuna.load_checkpoint(args.store, args.resume)
batches = GlobalBatches(len(data), args.batch_size, seed=0)
os.makedirs(args.out, exist_ok=True)

if args.grads:
    idx = batches.shard(0, varuna.replica, varuna.data_depth)
    varuna.optimizer.step = lambda: None   # keep the gradients, change nothing
    varuna.step(data.batch(idx))
    torch.save({n: p.grad for n, p in varuna.named_parameters()}, f"{args.out}/grads_rank{varuna.rank}.pt")
    raise SystemExit(0)

record = []
while varuna.iteration < args.steps:
    idx = batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)
    loss, overflow = varuna.step(data.batch(idx), clip_grad_max_norm=args.clip)
    record.append({"step": varuna.iteration - 1, "loss": loss, "overflow": overflow,
                   "scale": varuna.scaler.scale})
    if args.checkpoint_at is not None and varuna.iteration == args.checkpoint_at:
        varuna.checkpoint(args.store, tmpdir=args.tmpdir)
eval_idx = GlobalBatches(len(data), args.batch_size, seed=99).shard(0, varuna.replica, varuna.data_depth)
eval_loss = varuna.evaluate(data.batch(eval_idx))
with open(f"{args.out}/losses_rank{varuna.rank}.json", "w") as f:
    json.dump({"stage": varuna.stage, "replica": varuna.replica, "P": varuna.pipeline_depth,
               "record": record, "param_bytes": varuna.parameter_bytes(), "eval": eval_loss,
               "grad_norm": varuna.grad_norm}, f)
if varuna.replica == 0:
    torch.save({n: p.detach() for n, p in varuna.named_parameters()}, f"{args.out}/params_rank{varuna.rank}.pt")
varuna.close()
