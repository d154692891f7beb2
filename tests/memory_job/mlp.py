"""The issue's plain model: an MLP of `depth` layers of `width`, a CutPoint after each but the
last, a regression loss. Shared by the job script beside it and benchmarks/memory.py."""

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint

__all__ = ["MLP", "regression_set"]


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth - 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return F.mse_loss(x, y)


def regression_set(width: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)
