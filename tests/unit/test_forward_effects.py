"""What forward does that a captured graph does not keep (trainer.graph.forward_effects): a
custom autograd.Function's backward, a Python attribute it changes, a buffer it replaces. A
probe found each training a different model from the plain loop's at every layout, 1 x 1
included, without a word (a straight-through estimator's first layer never trained)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.graph.capture import capture_model
from trainer.graph.partition import slice_stages


class RoundThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = RoundThrough.apply(self.lin(x)) * (1.0 / self.calls)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        self.seen.add_(1)   # in place: kept, not warned of
        return h.sum()


def _warnings(model: nn.Module, caplog) -> str:
    with caplog.at_level(logging.WARNING, logger="varuna"):
        capture_model(model, {"x": torch.randn(2, 4)})
    return "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("capture:"))


def test_a_custom_functions_backward_a_changed_attribute_and_a_replaced_buffer_are_named(caplog):
    said = _warnings(Quantized(), caplog)
    assert "the custom autograd.Function RoundThrough at" in said and "test_forward_effects.py" in said, said
    assert "its own backward never runs" in said
    assert "forward changes calls (0 -> 1)" in said, said
    assert "forward replaces the buffer ema with a new tensor" in said and "in place" in said, said
    assert "seen" not in said


def test_models_that_keep_their_state_as_captured_get_no_such_warning(caplog):
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = bn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False).sum()

    said = _warnings(Loss(), caplog)
    assert "autograd.Function" not in said and "forward changes" not in said and "replaces" not in said, said


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.block, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return h.pow(2).sum() + self.inp.weight.sum()


def test_a_reentrant_checkpoint_is_refused_and_the_non_reentrant_one_trains_its_layers():
    """The reentrant checkpoint was captured as a region without gradients: its layers got no
    gradient (or backward failed with 'does not require grad'), with a warning about cut points."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"use_reentrant=True at .*test_forward_effects.py.*use_reentrant=False"):
        capture_model(Checkpointed(reentrant=True), {"x": x})
    model = Checkpointed(reentrant=False)
    stage = slice_stages(capture_model(model, {"x": x}), [])[0]
    stage.module(x=x).backward()
    got = model.block.weight.grad.clone()
    model.zero_grad()
    model(x).backward()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, model.block.weight.grad)
