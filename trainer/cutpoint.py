"""CutPoint: where a model may be split between two pipeline stages."""

from __future__ import annotations

import torch
from torch import nn

from trainer.errors import PartitionError

__all__ = ["CutPoint", "cut_marker"]


class CutPoint(nn.Module):
    """Marks a potential stage boundary.

    Identity in eager mode. When the partitioner traces the model, every CutPoint becomes a
    `cut_marker` node; the active ones split the graph into stages. Its input must be one
    tensor whose first dimension is the batch, and each instance is called once per forward:
    the tensor that crosses the boundary is the only value one stage hands to the next.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise PartitionError(
                f"a CutPoint received {type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of 0 dims'}",
                hint="pass it one tensor whose first dimension is the batch",
            )
        return x


def cut_marker(x: torch.Tensor, name: str) -> torch.Tensor:
    """Identity; in a traced graph it marks CutPoint `name` (or an automatic cut after a block)."""
    return x
