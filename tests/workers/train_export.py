"""A training script the export tests launch: a model trained a few steps with Adam and a
checkpoint store, its stage's tensors saved as each worker holds them at the end.

* `tagger`: hand-written: an embedding tied to the output head (one Parameter), CutPoints, a
  BatchNorm (persistent running statistics), a persistent buffer the forward reads and a
  non-persistent one (which a state_dict leaves out), and a head and a buffer it never uses;
* `gpt2`: transformers' GPT2LMHeadModel from a tiny random config (head tied to the token
  embedding), wrapped in a module whose forward returns the loss, no CutPoint.

It checkpoints after each step in --checkpoint-at (into --store) and writes, per rank,
`--out/rank<r>.pt`: {name: tensor} of every parameter and buffer its stage owns, by the
engine's names, as they are after the last step.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint, GlobalBatches, Varuna
from trainer.data import TextDataset

SEQ = 16


class Tagger(nn.Module):
    def __init__(self, vocab: int, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.register_buffer("offsets", torch.linspace(-0.1, 0.1, d), persistent=False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(layers))
        self.norm = nn.BatchNorm1d(d)
        self.register_buffer("temperature", torch.tensor(2.0))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        # a head and a buffer forward never uses (another task's): kept untrained, exported
        self.other_task = nn.Linear(d, 3)
        self.register_buffer("other_scale", torch.tensor(0.5))

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.offsets
        for block, cut in zip(self.blocks, self.cuts):
            x = cut(x + block(x))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        logits = self.head(x) / self.temperature
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LossOf(nn.Module):
    """What a user writes around a Hugging Face model: forward(batch) -> loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=targets).loss


def gpt2_config(vocab: int):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
                                   use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build(kind: str, vocab: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "tagger":
        return Tagger(vocab)
    import transformers

    return LossOf(transformers.GPT2LMHeadModel(gpt2_config(vocab)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tagger", "gpt2"], required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--checkpoint-at", default="2,4", help="comma-separated steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=2)
    args = p.parse_args()
    data = TextDataset(SEQ, num_examples=64, seed=0)
    model = build(args.model, data.vocab_size)
    varuna = Varuna(model, None, data.sample_batch, args.batch_size, args.chunk_size)
    del model
    varuna.set_optimizer(torch.optim.Adam(varuna.parameters(), lr=0.01))
    batches = GlobalBatches(len(data), args.batch_size, seed=0)
    at = {int(s) for s in args.checkpoint_at.split(",") if s}
    while varuna.iteration < args.steps:
        varuna.step(data.batch(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)))
        if varuna.iteration in at:
            varuna.checkpoint(args.store)
    os.makedirs(args.out, exist_ok=True)
    torch.save({n: t.detach().cpu().clone() for n, t in varuna.named_tensors().items()},
               os.path.join(args.out, f"rank{varuna.rank}.pt"))
    varuna.close()


if __name__ == "__main__":
    main()
