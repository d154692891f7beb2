"""Trains tests/support/batchnorm_net.py under the launcher, evaluates, and writes each rank's
buffers and the evaluation's loss (the test compares them with the plain loop's)."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.batchnorm_net import BATCH, CHUNK, STEPS, BatchNormNet, batch  # noqa: E402

from trainer import Varuna  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

varuna = Varuna(BatchNormNet(), None, lambda n, device: {k: v[:n] for k, v in batch(0).items()}, BATCH, CHUNK,
                recompute=True)
varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.1))
while varuna.iteration < STEPS:
    varuna.step(batch(varuna.iteration))
loss = varuna.evaluate(batch(STEPS))
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
buffers = {n: t for n, t in varuna.named_tensors().items() if not isinstance(t, torch.nn.Parameter)}
torch.save(buffers, out / f"buffers_rank{varuna.rank}.pt")
(out / f"eval_rank{varuna.rank}.json").write_text(json.dumps(loss))
varuna.close()
