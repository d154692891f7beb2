"""A GPT whose memory is mostly its logits: a vocabulary of `--vocab` tokens over the tiny
preset's 48-wide residual stream, trained with SGD on random tokens, as a Varuna script for the
daemons (steps and batch from the job, a real calibration run when VARUNA_PROFILE is set).

A loss over such a head holds the logits beside their log-softmax in the forward and the
gradients of both in the backward: about three times the logits of a micro-batch on the stage
that holds the head, most of it no tensor the graph saves. At the end each worker prints one line
`MEMORY {json}` (its rank, stage and measured peak), as tests/memory_job/mlp_job.py does.
"""

import argparse
import json

import torch

from trainer import GlobalBatches, Varuna
from trainer.models.gpt import GPT, GPTConfig
from trainer.worker_env import job_setting

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=32768)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--chunk-size", type=int, default=4)
args = p.parse_args()

steps = job_setting("steps", 2)
batch_size = job_setting("batch_size", 8)
model = GPT(GPTConfig.preset("tiny", vocab_size=args.vocab, seq_len=args.seq), seed=0)
tokens = torch.randint(0, args.vocab, (64, args.seq + 1), generator=torch.Generator().manual_seed(0))


def get_batch(size, device=None):
    return {"input_ids": tokens[:size, :-1], "targets": tokens[:size, 1:]}


varuna = Varuna(model, None, get_batch, batch_size, args.chunk_size)
del model   # the worker keeps its stage only
varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.1))
batches = GlobalBatches(len(tokens), batch_size, seed=0)
while varuna.iteration < steps:
    idx = torch.as_tensor(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth))
    loss, _ = varuna.step({"input_ids": tokens[idx, :-1], "targets": tokens[idx, 1:]})
    if varuna.rank == 0:
        print(f"step {varuna.iteration - 1} loss {loss:.6f}", flush=True)
print("MEMORY " + json.dumps({"rank": varuna.rank, "stage": varuna.stage, "P": varuna.pipeline_depth,
                              "peak": varuna.memory.peak_bytes()}), flush=True)
varuna.close()
