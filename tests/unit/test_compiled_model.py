"""A torch.compile'd model given to Varuna: it trains the module the compiled wrapper holds (the
wrapper took its batch only through **kwargs, and the capture refused it with words that did not
say "compile")."""

from __future__ import annotations

import logging

import pytest
import torch
from support.normed import Normed, normed_batch

from trainer import Varuna


def _losses(model, steps=3) -> list[float]:
    v = Varuna(model, {0: [0]}, normed_batch, 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.05))
        return [v.step(normed_batch(8))[0] for _ in range(steps)]
    finally:
        v.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.compile's imports of torch.jit
def test_a_compiled_model_trains_as_the_module_it_wraps(caplog):
    plain = _losses(Normed())
    with caplog.at_level(logging.WARNING, logger="varuna"):
        compiled = _losses(torch.compile(Normed()))
    assert compiled == plain
    assert "the model is torch.compile'd: Varuna captures and runs the module it wraps (Normed)" in caplog.text
