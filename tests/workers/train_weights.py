"""A training script the meta-device weight tests launch: it builds its model under
`torch.device("meta")`, hands Varuna the weights to fill its stage with, and trains a few steps
with SGD, writing each step's loss, the names of the tensors its stage holds, and whether any of
the model's tensors outside its stage got storage, to `--out/rank<r>.json`.
"""

import argparse
import json
import os

import torch
from meta_models import build, data

from trainer import GlobalBatches, Varuna

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--model", choices=["mixer", "gpt2", "llama"], required=True)
p.add_argument("--weights", required=True)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--batch-size", type=int, default=8)
args = p.parse_args()

examples = data()


def batch(size, device):
    return {"input_ids": examples[:size].to(device)}


with torch.device("meta"):
    model = build(args.model)
varuna = Varuna(model, None, batch, batch_size=args.batch_size, chunk_size=2, weights=args.weights)
outside = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if n not in varuna._named and t.numel() and not t.is_meta)
del model
varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.1))
batches = GlobalBatches(len(examples), args.batch_size, seed=0)
losses = []
while varuna.iteration < args.steps:
    idx = batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)
    loss, _ = varuna.step({"input_ids": examples[idx]})
    losses.append(loss)
with open(os.path.join(args.out, f"rank{varuna.rank}.json"), "w") as f:
    json.dump({"stage": varuna.stage, "losses": losses, "mine": sorted(varuna._named), "outside": outside,
               "meta_left": sorted(n for n, t in varuna._named.items() if t.is_meta)}, f)
varuna.close()
