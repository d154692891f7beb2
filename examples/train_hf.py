"""Train a Hugging Face causal LM (GPT-2 or Llama, random init) with Varuna, no annotation.

    python -m trainer.launch --stages 2 --replicas 2 examples/train_hf.py --steps 30
    varunactl submit --name hf --batch-size 32 --steps 200 --checkpoint-every 50 examples/train_hf.py

The model is `transformers`' own class, built from a config (nothing is downloaded) and
wrapped in a module whose forward takes the batch and returns the loss. It has no CutPoint:
Varuna captures it with torch.export and cuts between the blocks of its largest ModuleList
(`transformer.h` for GPT-2, `model.layers` for Llama); GPT-2's head stays tied to its token
embedding across stages. Needs `pip install transformers` (the engine itself does not).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from trainer import GlobalBatches, Varuna
from trainer.data import TextDataset
from trainer.models.hf import CausalLM
from trainer.worker_env import job_setting

SIZES = {  # hidden, layers, heads
    "tiny": (64, 4, 4),
    "small": (256, 8, 8),
    "gpt2": (768, 12, 12),   # GPT-2 small's shape, ~85M parameters with this vocabulary
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=job_setting("steps", 30), help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=job_setting("batch_size", 32),
                   help="global batch (sequences per step, all replicas)")
    p.add_argument("--chunk-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="fixes the weights and the data order")
    p.add_argument("--examples", type=int, default=4096)
    return p.parse_args()


def build(arch: str, size: str, vocab: int, seq_len: int) -> nn.Module:
    try:
        import transformers
    except ImportError:
        sys.exit("examples/train_hf.py needs Hugging Face transformers: pip install transformers "
                 "(or pip install -e .[test]); the training engine itself does not")
    transformers.logging.set_verbosity_error()
    d, layers, heads = SIZES[size]
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=d, n_layer=layers,
                                         n_head=heads, use_cache=False, **ids)
        return CausalLM(transformers.GPT2LMHeadModel(config))
    config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq_len, hidden_size=d,
                                      intermediate_size=4 * d, num_hidden_layers=layers, num_attention_heads=heads,
                                      use_cache=False, **ids)
    return CausalLM(transformers.LlamaForCausalLM(config))


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)   # the weights: every worker builds the same model
    ds = TextDataset(args.seq_len, args.examples, seed=args.seed)
    model = build(args.arch, args.size, ds.vocab_size, args.seq_len)

    varuna = Varuna(model, None, ds.sample_batch, batch_size=args.batch_size, chunk_size=args.chunk_size)
    varuna.set_optimizer(torch.optim.AdamW(varuna.parameters(), lr=args.lr))
    if varuna.iteration and varuna.rank == 0:
        print(f"resumed at step {varuna.iteration}", flush=True)
    batches = GlobalBatches(len(ds), args.batch_size, args.seed)
    while varuna.iteration < args.steps:
        step = varuna.iteration   # the step's index: what status, plots and the loss history call it
        idx = batches.shard(step, varuna.replica, varuna.data_depth)
        loss, _ = varuna.step(ds.batch(idx))
        if varuna.rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    varuna.close()


if __name__ == "__main__":
    main()
