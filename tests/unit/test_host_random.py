"""Randomness the capture cannot key (trainer.graph.host_random): Python's and NumPy's
generators and torch.manual_seed called in forward are named with their line, and a model's own
torch.Generator is refused in words that say so. A probe found each of them silent or named in
words about something else (a layer dropped with random.random() was fixed at capture, and
replicas that captured differently failed in gloo with "a collective mismatch")."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from trainer.errors import PartitionError
from trainer.graph.capture import capture_model


class LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)
        h = self.a(x) * float(np.random.rand())
        if random.random() < 0.5:
            h = self.b(h)
        return h.sum()


class OwnGenerator(nn.Module):
    def __init__(self, batch_shaped: bool) -> None:
        super().__init__()
        self.lin, self.batch_shaped = nn.Linear(4, 4), batch_shaped
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape if self.batch_shaped else (4,), generator=self.g)
        return (self.lin(x) + noise).sum()


def test_host_randomness_in_forward_is_named_with_its_line(caplog):
    originals = (random.random, np.random.rand, torch.manual_seed)
    with caplog.at_level(logging.WARNING, logger="varuna"):
        capture_model(LayerDrop(), {"x": torch.randn(2, 4)})
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "random.random at" in said and "test_host_random.py" in said and "fixed into the model" in said
    assert "numpy.random.rand at" in said
    assert "torch.manual_seed at" in said and "no effect" in said
    # the generators are themselves again after the capture
    assert (random.random, np.random.rand, torch.manual_seed) == originals


def test_a_models_own_generator_is_refused_in_words_that_name_it():
    for batch_shaped in (True, False):
        with pytest.raises(PartitionError) as err:
            capture_model(OwnGenerator(batch_shaped), {"x": torch.randn(2, 4)})
        assert "generator" in (str(err.value) + (err.value.hint or "")).split("graph has an input")[-1], str(err.value)
