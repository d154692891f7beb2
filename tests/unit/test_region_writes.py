"""Buffers a model updates under `torch.no_grad()` in forward (an EMA of activations, a step
counter): export keeps that block as one op on a subgraph, whose writes the engine did not see.
An outside probe found such an update dropped from every stage when forward never read the
buffer (the counter stayed 0, at 1 x 1 too), and applied twice by a stage that recomputes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint, Varuna
from trainer.graph.capture import capture_model
from trainer.graph.partition import slice_stages
from trainer.graph.written import written_buffers


class Tracker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))
                self.count += 1
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.t1, self.t2, self.cut = Tracker(), Tracker(), CutPoint()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.cut(self.t1(torch.tanh(self.a(x))))
        return F.cross_entropy(self.head(self.t2(torch.tanh(self.b(h)))), y)


def _batch(size: int, device=None, step: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(size, 8, generator=g), "y": torch.randint(0, 3, (size,), generator=g)}


def test_each_stage_keeps_and_knows_the_buffers_it_updates_under_no_grad():
    traced = capture_model(Net(), _batch(2))
    stages = slice_stages(traced, [0])
    # what a stage's recompute saves and puts back, so that it updates them once per micro-batch
    assert [written_buffers(s.module) for s in stages] == [("t1.ema", "t1.count"), ("t2.ema", "t2.count")]


def test_buffers_updated_under_no_grad_train_as_in_the_plain_loop():
    plain = Net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):   # Varuna's way at 1 x 1: micro-batches of 2, gradients summed, one step
        opt.zero_grad()
        batch = _batch(4, step=step)
        for start in (0, 2):
            (plain(**{k: v[start:start + 2] for k, v in batch.items()}) * 0.5).backward()
        opt.step()
    v = Varuna(Net(), {0: [0]}, _batch, 4, 2)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.1))
        for step in range(3):
            v.step(_batch(4, step=step))
        got = v.named_tensors()
        for name in ("t1.count", "t2.count", "t1.ema", "t2.ema"):
            torch.testing.assert_close(got[name], dict(plain.named_buffers())[name], msg=name)
        assert int(got["t1.count"]) == 6
    finally:
        v.close()
