"""Batches whose sizes after the batch dimension change from step to step (padded to their own
longest sequence, as a collator pads): the capture leaves those sizes symbolic, so one captured
model trains them as the plain model does. Where the model's code fixes a size, `step()` refuses
a batch of another one with what to do, where it failed deep inside the captured graph ("index 6
is out of bounds for dimension 1 with size 6")."""

from __future__ import annotations

import logging

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


class FlatLM(TinyLM):
    """A head over the flattened sequence: its code fixes the length at SEQ."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16 * SEQ, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(input_ids).flatten(1)), labels[:, 0])


def batch(size: int, device=None, seq: int = SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(size * 100 + seq)
    ids = torch.randint(0, VOCAB, (size, seq), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


LENGTHS = (8, 6, 5, 7, 6)


def test_batches_of_changing_lengths_train_as_the_plain_model_and_a_longer_one_is_warned_of(caplog):
    plain = TinyLM()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = []
    for seq in LENGTHS:   # Varuna's way at 1 x 1: micro-batches of 4, gradients summed, one step
        opt.zero_grad()
        b, total = batch(8, seq=seq), 0.0
        for start in (0, 4):
            loss = plain(**{k: v[start:start + 4] for k, v in b.items()}) * 0.5
            loss.backward()
            total += loss.item()
        opt.step()
        want.append(total)

    # the sample is 6 long: the batches of 8 and 7 are larger than what the plan measured
    v = Varuna(TinyLM(), {0: [0]}, lambda size, device: batch(size, device, seq=6), 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        with caplog.at_level(logging.WARNING, logger="varuna"):
            got = [v.step(batch(8, seq=seq))[0] for seq in LENGTHS]
        assert got == pytest.approx(want, rel=1e-5)
        for name, p in plain.named_parameters():
            torch.testing.assert_close(dict(v.named_parameters())[name], p, rtol=1e-5, atol=1e-6)
        larger = [r.getMessage() for r in caplog.records if "larger than get_batch_fn's sample" in r.getMessage()]
        assert len(larger) == 1 and "input_ids dimension 1: 8 > 6" in larger[0], larger
    finally:
        v.close()


def test_a_batch_of_a_size_the_model_fixes_is_refused_with_what_to_do():
    v = Varuna(FlatLM(), {0: [0]}, batch, 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        loss, _ = v.step(batch(8))
        assert loss > 0
        with pytest.raises(ConfigError, match=r"the batch's input_ids has shape \[8, 6\], but the model was "
                                              r"captured with \[batch, 8\]") as err:
            v.step(batch(8, seq=6))
        assert "padding='max_length'" in err.value.hint and "x.size(1)" in err.value.hint
        assert v.iteration == 1   # refused before anything ran: the next step is still step 1
        v.step(batch(8))
        assert v.iteration == 2
    finally:
        v.close()


class Branchy(TinyLM):
    """forward branches on the sequence length: the capture keeps the sample's branch."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(input_ids, labels)
        return loss * 0.5 if input_ids.size(1) < 4 else loss


def test_a_batch_outside_the_sizes_the_capture_traced_is_warned_of(caplog):
    # the sample is 6 long: the branch not taken (8, the mask's whole length, would fix the length)
    v = Varuna(Branchy(), {0: [0]}, lambda size, device: batch(size, device, seq=6), 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.0))
        with caplog.at_level(logging.WARNING, logger="varuna"):
            v.step(batch(8, seq=7))
            v.step(batch(8, seq=3))
            v.step(batch(8, seq=2))
        said = [r.getMessage() for r in caplog.records if "outside the sizes" in r.getMessage()]
        assert len(said) == 1 and "input_ids dimension 1: 3 < 4" in said[0], said   # once per input
    finally:
        v.close()


def test_a_sample_one_long_says_that_the_capture_fixed_it():
    v = Varuna(TinyLM(), {0: [0]}, lambda size, device: batch(size, device, seq=1), 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        with pytest.raises(ConfigError, match=r"captured with \[batch, 1\]") as err:
            v.step(batch(8, seq=5))
        assert "a size of 1 there, which the capture always fixes" in err.value.hint
    finally:
        v.close()


def test_a_batch_longer_than_the_models_position_table_is_named_with_its_shapes():
    """A batch past the position embeddings failed with torch's bare "index out of range in self"."""
    v = Varuna(TinyLM(), {0: [0]}, lambda size, device: batch(size, device, seq=6), 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        with pytest.raises(ConfigError, match=r"indexed outside one of its tables on a micro-batch of "
                                              r"input_ids \(4, 10\), labels \(4, 10\).*position embeddings"):
            v.step(batch(8, seq=SEQ + 2))
    finally:
        v.close()
