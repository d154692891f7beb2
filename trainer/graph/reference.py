"""The keyed-random model in a plain loop: what any P x D run of it must reproduce.

The engine runs the captured graph, whose random ops draw by (seed, step, example, op)
(trainer.graph.keyed_random). `keyed_model` gives the same captured graph, whole, on the
model's own parameters, so a single process can train it without the engine and check a run
against it:

    keyed = keyed_model(model, get_batch_fn(2, "cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss = train_step(keyed, global_batch(step), step, seed=seed, micro_batch_size=4)
        opt.step()
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx, nn

from trainer.errors import ConfigError
from trainer.graph.capture import capture_model
from trainer.graph.keyed_rng import keyed_randomness
from trainer.graph.loss_weights import Counter, counter_for, step_weights

__all__ = ["keyed_model", "train_step", "keyed_randomness"]


def keyed_model(model: nn.Module, sample: Mapping[str, torch.Tensor], *,
                loss_count: Counter | str | None = "auto") -> fx.GraphModule:
    """`model` captured as the engine captures it (on `sample`, a batch from get_batch_fn),
    random ops keyed; it trains the model's own parameters. Call it with the batch's tensors
    by name inside `keyed_randomness(seed, step, example_offset, examples=n)`. `loss_count`: as
    given to `Varuna` (a script's own counter of the tokens its loss averages over)."""
    gm = capture_model(model, sample).graph_module
    # what train_step weighs micro-batches by, as the engine does
    gm.varuna_loss_count = counter_for(model, loss_count, gm)
    return gm


def train_step(keyed: fx.GraphModule, batch: Mapping[str, torch.Tensor], step: int, *, seed: int = 0,
               micro_batch_size: int | None = None) -> float:
    """Forward and backward of step `step`'s global batch in micro-batches, each weighted as the
    engine weights it (its share of the examples, or of the tokens a Hugging Face model's loss
    averages: trainer.graph.loss_weights); gradients accumulate in the parameters (the caller
    zeroes them and steps its optimizer). Returns the batch's loss."""
    sizes = {int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1:
        raise ConfigError(f"the batch's tensors hold different numbers of examples: {sorted(sizes)}",
                          hint="pass batch-first tensors of one global batch")
    total = sizes.pop()
    size = micro_batch_size or total
    micro = [{k: v[start:start + size] for k, v in batch.items()} for start in range(0, total, size)]
    weights = [min(size, total - start) / total for start in range(0, total, size)]
    # by examples, by the tokens a loss averages, or 1 each for a summed loss
    weights = step_weights(getattr(keyed, "varuna_loss_count", None), micro, weights, lambda mine: mine)
    loss = 0.0
    for start, m, w in zip(range(0, total, size), micro, weights):
        if not w:   # no token its loss averages (0/0): no loss and no gradient, as in the full batch
            continue
        with keyed_randomness(seed, step, start, examples=min(size, total - start)):
            part = keyed(**m) * w
        part.backward()
        loss += part.item()
    return loss
