"""Fine-tune a Hugging Face causal LM whose weights are in a checkpoint directory, each worker
holding only its stage: the model is built on the meta device (no storage), and Varuna fills
each worker's stage from the files, reading only that stage's tensors.

    python examples/finetune_hf.py --save-weights /tmp/hf-small     # once: random weights, locally
    python -m trainer.launch --stages 2 examples/finetune_hf.py --weights /tmp/hf-small --steps 30
    varunactl submit --name ft --batch-size 32 --steps 200 examples/finetune_hf.py --weights /tmp/hf-small

`--save-weights` stands for a downloaded checkpoint: it builds GPT-2 or Llama from a small random
config and writes it with `save_pretrained` (config.json and model.safetensors, or shards with
model.safetensors.index.json); nothing is downloaded. The weights directory must be readable by
every worker (a shared mount, or the same path on every VM). Needs `pip install transformers`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from trainer import GlobalBatches, Varuna
from trainer.data import TextDataset
from trainer.models.hf import CausalLM
from trainer.worker_env import job_setting


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", help="the checkpoint directory to fine-tune (save_pretrained's output)")
    p.add_argument("--save-weights", metavar="DIR", help="write random weights to DIR and exit")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="with --save-weights")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=job_setting("steps", 30), help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=job_setting("batch_size", 32),
                   help="global batch (sequences per step, all replicas)")
    p.add_argument("--chunk-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0, help="fixes the data order")
    p.add_argument("--examples", type=int, default=4096)
    args = p.parse_args()
    if (args.weights is None) == (args.save_weights is None):
        p.error("give --weights DIR to fine-tune, or --save-weights DIR to make a checkpoint first")
    return args


def save_random_weights(transformers, args: argparse.Namespace, vocab: int) -> None:
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if args.arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=args.seq_len, n_embd=256, n_layer=8,
                                         n_head=8, use_cache=False, **ids)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=args.seq_len, hidden_size=256,
                                          intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                                          use_cache=False, **ids)
    torch.manual_seed(args.seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(args.save_weights, max_shard_size="5MB")
    print(f"wrote random {args.arch} weights to {args.save_weights}")


def main() -> None:
    args = parse_args()
    try:
        import transformers
    except ImportError:
        sys.exit("examples/finetune_hf.py needs Hugging Face transformers: pip install transformers")
    transformers.logging.set_verbosity_error()
    ds = TextDataset(args.seq_len, args.examples, seed=args.seed)
    if args.save_weights:
        save_random_weights(transformers, args, ds.vocab_size)
        return

    config = transformers.AutoConfig.from_pretrained(args.weights)
    with torch.device("meta"):   # no storage: each worker materializes its stage from the weights
        model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    varuna = Varuna(model, None, ds.sample_batch, batch_size=args.batch_size, chunk_size=args.chunk_size,
                    weights=args.weights)
    del model   # what is left of it is other stages' meta tensors
    varuna.set_optimizer(torch.optim.AdamW(varuna.parameters(), lr=args.lr))
    if varuna.iteration and varuna.rank == 0:
        print(f"resumed at step {varuna.iteration}", flush=True)
    batches = GlobalBatches(len(ds), args.batch_size, args.seed)
    while varuna.iteration < args.steps:
        step = varuna.iteration
        loss, _ = varuna.step(ds.batch(batches.shard(step, varuna.replica, varuna.data_depth)))
        if varuna.rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    varuna.close()


if __name__ == "__main__":
    main()
