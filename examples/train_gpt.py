"""Train the GPT on generated English-like text (or this package's own source) with Varuna (pipeline + data parallelism).

    python -m trainer.launch --stages 2 --replicas 2 examples/train_gpt.py --steps 50
    python examples/train_gpt.py --steps 20            # one worker, no launcher

The script is what any Varuna script looks like: build the whole model, wrap it in `Varuna`
(which keeps only this worker's stage), give the optimizer the stage's parameters, and feed
each step this replica's shard of the global batch. The global batch of step s is fixed by
(seed, s), so any --stages x --replicas prints the same losses (up to float rounding).

With a checkpoint store (`--store DIR --checkpoint-every K` on the launcher, or under varunad),
Varuna resumes from the newest complete checkpoint and writes one every K steps by itself: stop
the run, relaunch it with another P x D, and it carries on where it was. No code here for that.
"""

from __future__ import annotations

import argparse

import torch

from trainer import GlobalBatches, Varuna
from trainer.data import TextDataset, source_corpus
from trainer.models.gpt import GPT, PRESETS, GPTConfig
from trainer.worker_env import job_setting


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (default tiny)")
    p.add_argument("--steps", type=int, default=job_setting("steps", 50), help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=job_setting("batch_size", 32),
                   help="global batch (sequences per step, all replicas)")
    p.add_argument("--chunk-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="fixes the weights, the data order and dropout")
    p.add_argument("--examples", type=int, default=4096, help="sequences in the corpus (at most what it holds)")
    p.add_argument("--corpus", choices=["generated", "source"], default="generated",
                   help="generated: English-like text from a grammar; source: the Python source of the trainer "
                        "and protocol packages, real text shipped with the install (every VM must run the same "
                        "version). Nothing is downloaded either way.")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cfg = GPTConfig.preset(args.preset, dropout=args.dropout)
    ds = TextDataset(cfg.seq_len, args.examples, seed=args.seed,
                     text=source_corpus() if args.corpus == "source" else None)
    model = GPT(cfg, seed=args.seed)

    def get_batch_fn(size, device):
        # Real examples for the dry run that measures the cut points.
        return ds.sample_batch(size, device)

    # seed= keys the dropout masks by (seed, step, example): torch.manual_seed does not reach them
    varuna = Varuna(model, None, get_batch_fn, batch_size=args.batch_size, chunk_size=args.chunk_size,
                    seed=args.seed)
    opt = torch.optim.AdamW(varuna.parameters(), lr=args.lr)
    varuna.set_optimizer(opt)
    if varuna.iteration and varuna.rank == 0:
        print(f"resumed at step {varuna.iteration}", flush=True)

    batches = GlobalBatches(len(ds), args.batch_size, args.seed)
    while varuna.iteration < args.steps:
        step = varuna.iteration   # the step's index: what status, plots and the loss history call it
        idx = batches.shard(step, varuna.replica, varuna.data_depth)
        loss, overflow = varuna.step(ds.batch(idx))
        if varuna.rank == 0:
            print(f"step {step} loss {loss:.4f}" + (" (overflow, skipped)" if overflow else ""),
                  flush=True)
    varuna.close()


if __name__ == "__main__":
    main()
