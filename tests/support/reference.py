"""The plain single-process PyTorch loop that every P x D run must reproduce."""

import torch

from trainer import GlobalBatches
from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig


def reference_run(steps: int, batch_size: int, *, clip: float | None = None, precision: str = "fp32",
                  device: str = "cpu"):
    """Per-step losses and final named parameters of the tiny GPT under SGD with momentum,
    dropout 0; also the final model's loss on a held-out batch (as `eval`). ``device``: where the
    loop runs (benchmarks/cuda_matrix.py runs it on a GPU too)."""
    torch.manual_seed(1234)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0).to(device)
    data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
    batches = GlobalBatches(len(data), batch_size, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else torch.autocast("cpu", enabled=False))
    for step in range(steps):
        opt.zero_grad()
        with autocast:
            loss = model(**{k: v.to(device) for k, v in data.batch(batches.indices(step)).items()})
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        held_out = model(**{k: v.to(device) for k, v in
                            data.batch(GlobalBatches(len(data), batch_size, seed=99).indices(0)).items()}).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    params["eval"] = held_out
    return losses, params


def keyed_reference_run(steps: int, batch_size: int, *, dropout: float, seed: int = 0) -> list[float]:
    """Per-step losses of the tiny GPT with dropout under SGD with momentum: the plain loop over
    the captured model, whose random ops are keyed by (seed, step, example, op) as every P x D
    run keys them."""
    from trainer.graph.reference import keyed_model, train_step

    torch.manual_seed(1234)
    cfg = GPTConfig.preset("tiny", dropout=dropout)
    model = GPT(cfg, seed=0).train()
    data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
    batches = GlobalBatches(len(data), batch_size, seed=0)
    keyed = keyed_model(model, data.sample_batch(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(train_step(keyed, data.batch(batches.indices(step)), step, seed=seed))
        opt.step()
    return losses
