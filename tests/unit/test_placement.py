"""A captured stage moved to another device makes its own tensors there too (trainer/graph/placement.py).

torch.export records the capture's device in the graph (`arange(..., device=cpu)` for position ids);
on a GPU host that stage failed its first step with 'index is on cpu' until the graph was retargeted.
No GPU here, so the test checks the graphs themselves; benchmarks/cuda_matrix.py runs them on one.
"""

import torch
from torch import fx

from trainer.data import TextDataset
from trainer.graph.partition import capture_model, slice_stages
from trainer.graph.placement import retarget_graph
from trainer.models.gpt import GPT, GPTConfig


def _devices(module: torch.nn.Module) -> list[torch.device]:
    found = []
    for gm in module.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                fx.node.map_aggregate((node.args, node.kwargs),
                                      lambda v: found.append(v) if isinstance(v, torch.device) else v)
    return found


def _stages(model, batch, cuts):
    return [sl.module for sl in slice_stages(capture_model(model, batch), cuts)]


def test_every_recorded_device_follows_the_stage():
    cfg = GPTConfig.preset("tiny")
    data = TextDataset(cfg.seq_len, num_examples=8, seed=0)
    for stage in _stages(GPT(cfg, seed=0), data.batch(list(range(4))), [1]):
        before = _devices(stage)
        changed = retarget_graph(stage, torch.device("cpu"), torch.device("meta"))
        assert changed == sum(d.type == "cpu" for d in before)
        assert all(d.type == "meta" for d in _devices(stage))
        # and back: the profiler moves a segment in for its measurement and out again
        assert retarget_graph(stage, torch.device("meta"), torch.device("cpu")) == changed
        assert _devices(stage) == before
    # the GPT's position ids are such a device constant: the test above is not vacuous
    assert any(_devices(s) for s in _stages(GPT(cfg, seed=0), data.batch(list(range(4))), []))


def test_a_hugging_face_model_is_retargeted_too():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel(cfg)

        def forward(self, input_ids, labels):
            return self.lm(input_ids=input_ids, labels=labels).loss

    ids = torch.randint(0, 64, (4, 16))
    stages = _stages(LM(), {"input_ids": ids, "labels": ids}, [0])
    assert len(stages) == 2
    assert any(d.type == "cpu" for s in stages for d in _devices(s))
    for stage in stages:
        retarget_graph(stage, torch.device("cpu"), torch.device("meta"))
        assert all(d.type == "meta" for d in _devices(stage))
