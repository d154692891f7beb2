"""A job whose activations make the link between VMs matter: a stack of wide MLP blocks over
many tokens (each sample's activation is tokens x width floats at every cut), little compute
per byte. Plain Varuna script: steps and batch from the job (VARUNA_STEPS, VARUNA_BATCH_SIZE);
under `--calibrate profile` the daemon's calibration run profiles it for real."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from trainer import GlobalBatches, Varuna
from trainer.worker_env import job_setting

p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=512)
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--depth", type=int, default=4)
p.add_argument("--chunk-size", type=int, default=2)
args = p.parse_args()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class Wide(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.blocks(x)).squeeze(-1), y)


N = 256
# The data set, built once: drawn again per step it cost more than the step itself (32 MB of
# random numbers), time the measured step then counted and the planner's estimate cannot know.
_g = torch.Generator().manual_seed(0)
XS = torch.randn(N, args.tokens, args.width, generator=_g)
YS = torch.randn(N, args.tokens, generator=_g)


def batch(indices, device=None):
    idx = torch.as_tensor(list(indices), dtype=torch.long) % N
    return {"x": XS[idx], "y": YS[idx]}


def sample_batch(size, device=None):
    return batch(range(size), device)


steps = job_setting("steps", 5)
batch_size = job_setting("batch_size", 8)
torch.manual_seed(0)
model = Wide(args.width, args.depth)
varuna = Varuna(model, None, sample_batch, batch_size, args.chunk_size)
varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.001))
batches = GlobalBatches(N, batch_size, seed=0)
while varuna.iteration < steps:
    loss, _ = varuna.step(batch(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)))
    if varuna.rank == 0:
        print(f"step {varuna.iteration - 1} loss {loss:.6f} t={time.time():.6f}", flush=True)
varuna.close()
