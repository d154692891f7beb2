"""A backward split in an input pass and a weight pass gives the whole backward's gradients, and
computes each matrix product once."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.engine.split_backward import backward_input, backward_weight
from trainer.graph.partition import ACTIVATION, capture_model, slice_stages
from trainer.models.gpt import GPT, GPTConfig


class _Products(TorchDispatchMode):
    """Counts the matrix products autograd runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(module):
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _both_ways(module, x, grad=None, **inputs):
    """(input gradient, parameter gradients) of a whole backward and of a split one."""
    results = []
    for split in (False, True):
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(True)
        out = module(leaf, **inputs)
        params = [p for p in module.parameters() if p.requires_grad]
        if split:
            grad_in, pending = backward_input(out, grad, leaf, params)
            assert all(p.grad is None for p in params), "the input pass must leave the weights alone"
            backward_weight(pending)
        else:
            torch.autograd.backward(out, grad)
            grad_in = leaf.grad
        results.append((grad_in, _grads(module)))
    return results


class _Chain(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


class _SharedTwice(nn.Module):
    """One weight used at two depths, a bias reached without the input, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.offset = nn.Parameter(torch.randn(8))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        y = self.shared(torch.relu(self.frozen(self.shared(x))))
        return (y + torch.sin(self.offset) * 2).sum(-1).pow(2).mean()


@pytest.mark.parametrize("make, grad_shape", [
    (lambda: _Chain(), (4, 16)),
    (lambda: _SharedTwice(), None),
])
def test_split_backward_equals_the_whole_one(make, grad_shape):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(4, 8 if grad_shape is None else 16)
    grad = None if grad_shape is None else torch.randn(grad_shape)
    (whole_in, whole), (split_in, split) = _both_ways(module, x, grad)
    torch.testing.assert_close(split_in, whole_in)
    assert split.keys() == whole.keys()
    for name in whole:
        if whole[name] is None:
            assert split[name] is None, name
        else:
            torch.testing.assert_close(split[name], whole[name], msg=name)


def test_each_matrix_product_runs_once_across_the_two_passes():
    torch.manual_seed(0)
    module = _Chain(depth=4)
    x = torch.randn(4, 16).requires_grad_(True)
    grad = torch.randn(4, 16)
    out = module(x)
    with _Products() as whole:
        torch.autograd.backward(out, grad)
    out = module(x)
    params = list(module.parameters())
    with _Products() as first:
        _, pending = backward_input(out, grad, x, params)
    with _Products() as second:
        backward_weight(pending)
    # four layers: four products for the input's gradient, four for the weights'
    assert (first.count, second.count) == (4, 4)
    assert first.count + second.count == whole.count


def test_the_weight_pass_fires_the_parameters_accumulation_hooks():
    module = _Chain()
    seen = []
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(id(p)))
    x = torch.randn(2, 16).requires_grad_(True)
    _, pending = backward_input(module(x), torch.ones(2, 16), x, list(module.parameters()))
    assert seen == []
    backward_weight(pending)
    assert sorted(seen) == sorted(id(p) for p in module.parameters())


def test_without_an_input_gradient_the_weight_pass_is_the_whole_backward():
    module = _Chain()
    x = torch.randn(2, 16)   # a first stage's input: no gradient wanted
    grad_in, pending = backward_input(module(x), torch.ones(2, 16), x, list(module.parameters()))
    assert grad_in is None and all(p.grad is None for p in module.parameters())
    backward_weight(pending)
    assert all(p.grad is not None for p in module.parameters())


def test_what_the_split_holds_between_its_passes_is_counted_and_freed():
    module = _Chain(width=16, depth=3)
    x = torch.randn(4, 16).requires_grad_(True)
    _, pending = backward_input(module(x), torch.ones(4, 16), x, list(module.parameters()))
    # at least one recorded gradient per linear layer, each a 4 x 16 float tensor
    assert pending.held_bytes() >= 3 * 4 * 16 * 4
    backward_weight(pending)
    assert pending.held_bytes() == 0


def test_a_stage_that_passes_its_input_on_sends_the_gradient_it_received():
    x = torch.randn(2, 3).requires_grad_(True)
    grad = torch.randn(2, 3)
    grad_in, pending = backward_input(x, grad, x, [])
    assert grad_in is grad
    backward_weight(pending)


def _gpt_stage_one(cfg, batch):
    slices = slice_stages(capture_model(GPT(cfg, seed=0), batch), [0])
    first, second = slices
    x = first.module(**{k: batch[k] for k in first.input_names}).detach()
    inputs = {k: batch[k] for k in second.input_names}

    class Stage(nn.Module):   # the captured stage, called as the executor calls it
        def __init__(self):
            super().__init__()
            self.inner = second.module

        def forward(self, act, **kw):
            return self.inner(**{ACTIVATION: act, **kw})

    return Stage(), x, inputs


def test_a_captured_gpt_stage_with_the_tied_head_splits_exactly():
    cfg = GPTConfig.preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    stage, x, inputs = _gpt_stage_one(cfg, {"input_ids": ids, "targets": torch.roll(ids, -1, 1)})
    (whole_in, whole), (split_in, split) = _both_ways(stage, x, None, **inputs)
    torch.testing.assert_close(split_in, whole_in)
    assert any(g is not None for g in whole.values())
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], msg=name)


def test_a_hugging_face_gpt2_stage_splits_exactly():
    pytest.importorskip("transformers")
    from support import zoo
    model = zoo.build("gpt2").eval()
    batch = zoo.global_batch("gpt2", 0)
    first, second = slice_stages(capture_model(model, batch), [0])
    x = first.module(**{k: batch[k] for k in first.input_names}).detach()

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = second.module

        def forward(self, act, **kw):
            return self.inner(**{ACTIVATION: act, **kw})

    (whole_in, whole), (split_in, split) = _both_ways(Stage(), x, None, **{k: batch[k] for k in second.input_names})
    torch.testing.assert_close(split_in, whole_in)
    assert any(g is not None for g in whole.values())
    for name in whole:
        if whole[name] is not None:
            torch.testing.assert_close(split[name], whole[name], msg=name)
