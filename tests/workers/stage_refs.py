"""A training script the stage-ownership tests launch: it builds a model, holds a weak reference
to each of its parameters and buffers and to the model itself, wraps it in Varuna, drops its own
reference and collects. What is still alive is what the worker keeps; it writes that, beside the
names of its stage's tensors, to `--out/rank<r>.json`, trains one step (the stage still works)
and exits.

`--model mlp`: a hand-written MLP with CutPoints and a buffer; `--model gpt2`: transformers'
GPT2LMHeadModel from a small random config, its head tied to its token embedding.
"""

import argparse
import gc
import json
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint, Varuna
from trainer.models.hf import CausalLM

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--model", choices=["mlp", "gpt2"], required=True)
args = p.parse_args()


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block, cut in zip(self.blocks, self.cuts):
            h = cut(torch.relu(block(h)) * self.gain)
        return F.cross_entropy(self.out(h), y)


def build():
    torch.manual_seed(0)
    if args.model == "mlp":
        def batch(size, device):
            gen = torch.Generator().manual_seed(size)
            return {"x": torch.randn(size, 8, generator=gen).to(device),
                    "y": torch.randint(0, 3, (size,), generator=gen).to(device)}
        return MLP(), batch
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=4, n_head=4, use_cache=False)

    def batch(size, device):
        gen = torch.Generator().manual_seed(size)
        return {"input_ids": torch.randint(0, 96, (size, 16), generator=gen).to(device)}
    return CausalLM(transformers.GPT2LMHeadModel(config)), batch


model, batch = build()
refs = {}
for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
    refs[name] = weakref.ref(t)
model_ref = weakref.ref(model)
varuna = Varuna(model, None, batch, batch_size=8, chunk_size=4)
del model
gc.collect()
alive = sorted(n for n, r in refs.items() if r() is not None)
mine = {id(t) for t in varuna._named.values()}
record = {
    "stage": varuna.stage,
    "model_collected": model_ref() is None,
    "alive": alive,
    # a name is this stage's when its tensor is one the stage computes with
    "alive_not_mine": sorted(n for n, r in refs.items() if r() is not None and id(r()) not in mine),
    "mine": sorted(varuna._named),
    "names": sorted(refs),
}
varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.1))
loss, _ = varuna.step(batch(8, "cpu"))
record["loss"] = loss
with open(os.path.join(args.out, f"rank{varuna.rank}.json"), "w") as f:
    json.dump(record, f)
varuna.close()
