"""A small model with a BatchNorm (buffers that training updates) and its batches, for tests of
what a stage checkpoints and of the scheduler, in one process."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), y)


def normed_batch(size: int, device=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(size)
    batch = {"x": torch.randn(size, 6, generator=gen) * 3 + 2, "y": torch.randn(size, 1, generator=gen)}
    return {k: v.to(device) if device is not None else v for k, v in batch.items()}
