"""Models with randomness inside forward (Hugging Face GPT-2 and BERT with dropout 0.1
everywhere, random init from tiny configs; hand-written code with stochastic depth), and the
plain single-process loop over their keyed-random capture that every P x D run must match."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from support.zoo import LossOf  # what a user writes around a Hugging Face model, as the zoo has it
from trainer import CutPoint
from trainer.graph.reference import keyed_model, train_step

STEPS, BATCH, CHUNK, SEED = 5, 12, 2, 1234
VOCAB, SEQ = 64, 16
MODELS = ("gpt2", "bert", "depth")


class DepthBlock(nn.Module):
    """A residual MLP block skipped per example with probability `p` (stochastic depth), with
    dropout inside, one of them on the tokens flattened to (B*T, C)."""

    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.drop(F.gelu(self.fc(self.ln(x))))
        h = F.dropout(self.out(h).reshape(b * t, c), 0.1, self.training).view(b, t, c)
        keep = (torch.rand(b, 1, 1, device=x.device) >= self.p).to(x.dtype) / (1 - self.p)
        return x + keep * h


class DepthNet(nn.Module):
    def __init__(self, d: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(DepthBlock(d, 0.2) for _ in range(layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(layers - 1))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + 0.01 * torch.randn_like(self.wte(input_ids))   # noise injection
        for i, block in enumerate(self.blocks):
            x = block(self.cuts[i - 1](x) if i else x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build(name: str) -> nn.Module:
    import transformers as tf
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        model = LossOf(tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.1,
            embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0)))
    elif name == "bert":
        model = LossOf(tf.BertForMaskedLM(tf.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1, pad_token_id=0)))
    elif name == "depth":
        model = DepthNet()
    else:
        raise ValueError(name)
    return model.train()


def global_batch(step: int, size: int = BATCH) -> dict[str, torch.Tensor]:
    """Step `step`'s batch, of a length that changes from step to step (padded to its longest, as
    a collator pads): the dropout over flattened tokens then has a different number of rows per
    example each step. The sample (step 99) is the longest."""
    g = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randint(1, VOCAB, (size, SEQ - step % 3), generator=g)
    return {"input_ids": x, "labels": torch.roll(x, -1, 1)}


def sample_batch(size, device):
    return {k: v.to(device) for k, v in global_batch(99, size).items()}


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(name: str, steps: int = STEPS, micro_batch_size: int = BATCH) -> list[float]:
    """The plain loop over the keyed-random capture: one micro-batch per step unless told."""
    model = build(name)
    keyed = keyed_model(model, sample_batch(CHUNK, "cpu"))
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        opt.zero_grad()
        losses.append(train_step(keyed, global_batch(step), step, seed=SEED, micro_batch_size=micro_batch_size))
        opt.step()
    return losses


def references(names: Sequence[str]) -> dict[str, list[float]]:
    """`reference` of each model, computed on one thread as the launched workers compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: reference(name) for name in names}
    finally:
        torch.set_num_threads(threads)
