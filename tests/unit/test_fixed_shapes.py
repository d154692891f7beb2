"""The dimensions after the batch are fixed when Varuna captures the model: a batch padded to a
shorter length than get_batch_fn's sample is refused by step() with what to do, where it failed
deep inside the captured graph ("index 6 is out of bounds for dimension 1 with size 6")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer import Varuna
from trainer.errors import ConfigError

SEQ, VOCAB = 8, 11


class TinyLM(nn.Module):
    """A causal LM as GPT code writes it: a mask buffer sliced to the input's length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(SEQ, 16)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = input_ids.size(1)
        x = self.emb(input_ids) + self.pos(torch.arange(t))
        att = (x @ x.transpose(1, 2)).masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return F.cross_entropy(self.head(att @ x).flatten(0, 1), labels.flatten())


def batch(size: int, device=None, seq: int = SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(size * 100 + seq)
    ids = torch.randint(0, VOCAB, (size, seq), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def test_a_batch_of_another_length_than_the_capture_is_refused_with_what_to_do():
    v = Varuna(TinyLM(), {0: [0]}, batch, 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        loss, _ = v.step(batch(8))
        assert loss > 0
        with pytest.raises(ConfigError, match=r"the batch's input_ids has shape \[8, 6\], but the model was "
                                              r"captured with \[batch, 8\]") as err:
            v.step(batch(8, seq=6))
        assert "pad every batch to one length" in err.value.hint
        assert v.iteration == 1   # refused before anything ran: the next step is still step 1
        v.step(batch(8))
        assert v.iteration == 2
    finally:
        v.close()
