"""A small model with BatchNorm (running statistics, a count of batches) and a buffer its forward
updates in place, for the tests of buffer writes: the launched worker and the plain loop it is
compared with build it from here, so that both hold the very same model and data."""

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH, CHUNK = 3, 8, 2


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))   # examples forwarded

    def forward(self, x, y):
        self.seen.add_(x.shape[0])
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"x": torch.randn(BATCH, 6, generator=g) * 2 + 1, "y": torch.randint(0, 3, (BATCH,), generator=g)}


def plain_run() -> tuple[dict[str, torch.Tensor], float]:
    """What an eager loop ends with: every buffer after STEPS steps of micro-batches of CHUNK, and
    the loss of `model.eval()` on the batch of step STEPS."""
    model = BatchNormNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        b = batch(step)
        for s in range(0, BATCH, CHUNK):
            (model(**{k: v[s:s + CHUNK] for k, v in b.items()}) * (CHUNK / BATCH)).backward()
        opt.step()
    buffers = {n: t.clone() for n, t in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        loss = float(model(**batch(STEPS)))
    return buffers, loss
