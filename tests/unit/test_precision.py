"""The gradient norms the overflow check and clipping start from (trainer.engine.precision)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.engine.precision import squared_norms


def test_squared_norms_match_float64_and_keep_half_precision_from_overflowing():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(512, 512, generator=g), torch.randn(7, generator=g).bfloat16(),
             (100 * torch.randn(1000, 1000, generator=g)).half()]   # its norm, 1e5, is past float16's 65504
    exact = [float(t.double().pow(2).sum()) for t in grads]
    assert squared_norms(grads) == pytest.approx(exact, rel=1e-4)   # float32's sums, as clip_grad_norm_'s
    assert all(math.isfinite(v) for v in squared_norms(grads))


def test_a_non_finite_gradient_gives_a_non_finite_square_and_float64_keeps_its_precision():
    assert not math.isfinite(sum(squared_norms([torch.ones(3), torch.tensor([1.0, float("nan")])])))
    assert not math.isfinite(sum(squared_norms([torch.tensor([float("inf")]).half()])))
    tiny = torch.tensor([1.0, 1e-9], dtype=torch.float64)
    assert squared_norms([tiny]) == [1.0 + 1e-18]
    assert squared_norms([]) == []
