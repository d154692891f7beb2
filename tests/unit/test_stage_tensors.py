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
from support.normed import Normed, normed_batch

from trainer import Varuna
from trainer.checkpoint.contents import _optimizer_state_on
from trainer.checkpoint.reading import checkpoint_dir, read_tensors, verify


def _device() -> str:
    return "0" if torch.cuda.is_available() else "-1"


def test_trained_buffers_reach_the_checkpoint_and_loaded_ones_the_stage(tmp_path):
    v = Varuna(Normed(), {0: [0]}, normed_batch, 8, 4, device=_device())
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.01))
        live = {n: b for n, b in v.module.named_buffers()}
        means = [b for n, b in live.items() if n.endswith("running_mean")]
        assert len(means) == 1 and bool((means[0] == 0).all())
        # what checkpoints read is what the stage computes with, object for object
        assert {id(b) for b in live.values()} <= {id(t) for t in v._named.values()}
        for step in range(2):
            v.step(normed_batch(8, v.device))
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
