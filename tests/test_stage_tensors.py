"""The tensors a worker checkpoints are the ones its stage computes with, wherever it runs.

Module.to() replaces buffers with new tensors; a stage that kept the old ones for checkpoints
would save (and load into) stale copies once it moves to a GPU. Here, in one process on this
machine's device: running statistics updated by training reach the checkpoint, and loading puts
saved values into the tensors the stage uses. Optimizer state loads onto the parameter's device,
but a scalar Adam step stays where torch keeps it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer import Varuna
from trainer.checkpoint.contents import _optimizer_state_on
from trainer.checkpoint.reading import checkpoint_dir, read_tensors, verify


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


def _batch(size: int, device=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(size)
    batch = {"x": torch.randn(size, 6, generator=gen) * 3 + 2, "y": torch.randn(size, 1, generator=gen)}
    return {k: v.to(device) if device is not None else v for k, v in batch.items()}


def _device() -> str:
    return "0" if torch.cuda.is_available() else "-1"


def test_trained_buffers_reach_the_checkpoint_and_loaded_ones_the_stage(tmp_path):
    v = Varuna(Normed(), {0: [0]}, _batch, 8, 4, device=_device())
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.01))
        live = {n: b for n, b in v.module.named_buffers()}
        means = [b for n, b in live.items() if n.endswith("running_mean")]
        assert len(means) == 1 and bool((means[0] == 0).all())
        # what checkpoints read is what the stage computes with, object for object
        assert {id(b) for b in live.values()} <= {id(t) for t in v._named.values()}
        for step in range(2):
            v.step(_batch(8, v.device))
        trained = means[0].detach().cpu().clone()
        assert not bool((trained == 0).any()), "training should have moved the running mean"
        path = v.checkpoint(str(tmp_path))
        index = verify(path)["meta"]["index"]
        name = next(n for n in index if n.endswith("running_mean"))
        saved = read_tensors(path, index[name])["buffers"][name]
        assert torch.equal(saved, trained)
        with torch.no_grad():
            means[0].fill_(-5.0)
        assert v.load_checkpoint(str(tmp_path), 2) == 2
        assert torch.equal(means[0].detach().cpu(), trained)   # back in the tensor the stage uses
        assert checkpoint_dir(str(tmp_path), 2) == path
    finally:
        v.close()


def test_loaded_optimizer_state_goes_where_the_optimizer_keeps_it():
    p = nn.Parameter(torch.empty(3, device="meta"))   # stands for an accelerator's tensor
    saved = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3), "note": 1}
    plain = _optimizer_state_on(torch.optim.Adam([p]).param_groups[0], p, saved)
    assert plain["step"].device.type == "cpu" and plain["exp_avg"].device.type == "meta" and plain["note"] == 1
    capturable = _optimizer_state_on(torch.optim.Adam([p], capturable=True).param_groups[0], p, saved)
    assert capturable["step"].device.type == "meta"
