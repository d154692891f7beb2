"""The plain single-process PyTorch loop that every P x D run must reproduce."""

import torch

from trainer import GlobalBatches
from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig


def reference_run(steps: int, batch_size: int):
    """Per-step losses and final named parameters of the tiny GPT under SGD with momentum, dropout 0."""
    torch.manual_seed(1234)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0)
    data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
    batches = GlobalBatches(len(data), batch_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**data.batch(batches.indices(step)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
