"""A training script the tied-weight tests launch: the same small GPT trained several times in
one worker process, once per way of tying its embedding and output head and schedule.

* `module`: the head's weight is the embedding's Parameter (one object, as Hugging Face ties);
* `shared`: the head has its own Parameter, named to Varuna in `shared_weights`.

The worker opens the process group itself, so the Varuna instances share it and one launch
covers both styles under each schedule asked for (and, with --resume-from, both resumed from
another run's checkpoints). For each it writes, under `--out/<style>-<schedule>[-resumed]/`,
every rank's per-step losses and digests of its tied copies (values and momentum), and its
stage's final parameters and SGD momentum buffers.
"""

import argparse
import hashlib
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from trainer import GlobalBatches, Varuna
from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig
from trainer.worker_env import WorkerAssignment

STYLES = ("module", "shared")
CONFIG = GPTConfig.preset("tiny", seq_len=16, n_embd=32)

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--chunk-size", type=int, default=2)
p.add_argument("--schedules", default="varuna", help="comma-separated: each style is trained under each")
p.add_argument("--store", default=None, help="checkpoint each style into STORE/<style> after --checkpoint-at steps")
p.add_argument("--checkpoint-at", type=int, default=3)
p.add_argument("--resume-from", default=None,
               help="then train each style again from STORE/<style>'s checkpoint of step --resume-at")
p.add_argument("--resume-at", type=int, default=3)
args = p.parse_args()


def build(style: str) -> tuple[nn.Module, list[tuple[str, str]]]:
    model = GPT(CONFIG, seed=0)
    if style == "module":
        return model, []
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())   # Varuna's way: two Parameters
    return model, [("wte.weight", "lm_head.weight")]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()


def train(style: str, schedule: str, resume_from: str | None = None) -> None:
    torch.manual_seed(1234)
    model, shared = build(style)
    data = TextDataset(CONFIG.seq_len, num_examples=128, seed=0)
    varuna = Varuna(model, None, data.sample_batch, args.batch_size, args.chunk_size,
                    schedule=schedule, shared_weights=shared)
    opt = torch.optim.SGD(varuna.parameters(), lr=0.1, momentum=0.9)
    varuna.set_optimizer(opt)
    if resume_from is not None:
        varuna.load_checkpoint(os.path.join(resume_from, style), args.resume_at)
    store = os.path.join(args.store, style) if args.store and resume_from is None else None
    batches = GlobalBatches(len(data), args.batch_size, seed=0)
    record = []
    while varuna.iteration < args.steps:
        idx = batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)
        loss, _ = varuna.step(data.batch(idx))
        # the bits of every local copy of the tied weight and of its optimizer state, after each step
        tied = {n: [digest(q), digest(opt.state[q]["momentum_buffer"])]
                for n, q in varuna.named_parameters() if n in ("wte.weight", "lm_head.weight")}
        record.append({"step": varuna.iteration - 1, "loss": loss, "tied": tied})
        if store and varuna.iteration == args.checkpoint_at:
            varuna.checkpoint(store)
    named = dict(varuna.named_parameters())
    momentum = {n: opt.state[q]["momentum_buffer"] for n, q in named.items()}
    out = os.path.join(args.out, f"{style}-{schedule}" + ("-resumed" if resume_from else ""))
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/rank{varuna.rank}.json", "w") as f:
        json.dump({"stage": varuna.stage, "replica": varuna.replica, "record": record}, f)
    torch.save({"params": {n: q.detach() for n, q in named.items()}, "momentum": momentum},
               f"{out}/state_rank{varuna.rank}.pt")
    varuna.close()


a = WorkerAssignment.from_env()
dist.init_process_group("gloo", init_method=a.dist_url, rank=a.rank, world_size=a.world_size,
                        timeout=timedelta(seconds=120))
schedules = args.schedules.split(",")
runs = [(style, schedule, None) for schedule in schedules for style in STYLES]
if args.resume_from:
    runs += [(style, schedules[0], args.resume_from) for style in STYLES]
for style, schedule, resume_from in runs:
    train(style, schedule, resume_from)
    dist.barrier()   # every worker is done with this run's sockets before any opens the next's
dist.destroy_process_group()
