"""The issue's plain model as a Varuna script: an MLP of `--depth` layers of `--width`, a CutPoint
after each but the last, trained with Adam on a fixed random regression set. It runs under the
daemons (steps and batch from the job, a real calibration run when VARUNA_PROFILE is set) and
under trainer.launch.

At the end each worker prints one line `MEMORY {json}`: its rank, stage, parameter bytes and the
peak it measured (Varuna.memory), which benchmarks/memory.py and tests/integration/test_memory_workers.py read from
its log. `--memory-error-at STEP` makes the first stage's forward raise MemoryError at that step,
as an allocation the host refused would.
"""

import argparse
import json

import torch
from mlp import MLP, regression_set

from trainer import GlobalBatches, Varuna
from trainer.worker_env import job_setting

p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=2048)
p.add_argument("--depth", type=int, default=8)
p.add_argument("--chunk-size", type=int, default=4)
p.add_argument("--memory-error-at", type=int, default=None)
p.add_argument("--device", default="-1", help="every worker's device, e.g. cuda:0 (default: the assignment's)")
args = p.parse_args()


refusing = False   # set from --memory-error-at: the first stage's forward then fails to allocate


def refuse(_module, _args):
    if refusing:
        raise MemoryError("out of memory (raised on purpose by --memory-error-at)")


steps = job_setting("steps", 3)
batch_size = job_setting("batch_size", 8)
torch.manual_seed(0)
model = MLP(args.width, args.depth)
xs, ys = regression_set(args.width)


def get_batch(size, device=None):
    return {"x": xs[:size], "y": ys[:size]}


varuna = Varuna(model, None, get_batch, batch_size, args.chunk_size, device=args.device)
del model   # the worker keeps its stage only
if args.memory_error_at is not None and varuna.stage == 0:
    varuna.module.register_forward_pre_hook(refuse)
varuna.set_optimizer(torch.optim.Adam(varuna.parameters(), lr=1e-4))
batches = GlobalBatches(len(xs), batch_size, seed=0)
while varuna.iteration < steps:
    refusing = args.memory_error_at is not None and varuna.iteration >= args.memory_error_at
    idx = torch.as_tensor(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth))
    loss, _ = varuna.step({"x": xs[idx], "y": ys[idx]})
    if varuna.rank == 0:
        print(f"step {varuna.iteration - 1} loss {loss:.6f}", flush=True)
print("MEMORY " + json.dumps({"rank": varuna.rank, "stage": varuna.stage, "P": varuna.pipeline_depth,
                              "param_bytes": varuna.parameter_bytes(), "peak": varuna.memory.peak_bytes(),
                              "device": str(varuna.device)}), flush=True)
varuna.close()
