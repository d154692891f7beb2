"""Randomness that belongs to the sample: the counter-based generator, the capture's keyed random
ops, and (slow) every P x D, recompute and resume reproducing the plain loop with dropout on.

Launch tests use real worker processes, real gloo and ZeroMQ; the models are Hugging Face GPT-2
and BERT with dropout 0.1 everywhere (random init, tiny configs) and a hand-written network with
stochastic depth, dropout on flattened tokens and noise injection (tests/support/keyed_zoo.py).
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer.graph.capture import capture_model
from trainer.graph.keyed_random import draws_in_evaluation, draws_unkeyed
from trainer.graph.keyed_rng import Draws, keyed_keep, keyed_normal, keyed_randomness, keyed_uniform, keyed_words
from trainer.graph.reference import keyed_model, train_step

# -- the generator ---------------------------------------------------------------------------

def test_a_micro_batch_draws_the_concatenation_of_its_examples_draws():
    with keyed_randomness(5, 9, 0):
        whole = keyed_uniform(3, (8, 4, 5))
        whole_mask = keyed_keep(3, (8, 3, 5), 0.5)   # an odd count per example: words hold two
    parts, masks = [], []
    for start, size in ((0, 3), (3, 1), (4, 4)):
        with keyed_randomness(5, 9, start):
            parts.append(keyed_uniform(3, (size, 4, 5)))
            masks.append(keyed_keep(3, (size, 3, 5), 0.5))
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(torch.cat(masks), whole_mask)
    # each part of the key matters
    for seed, step, op in ((6, 9, 3), (5, 10, 3), (5, 9, 4)):
        with keyed_randomness(seed, step, 0):
            assert not torch.equal(keyed_uniform(op, (8, 4, 5)), whole)


def test_the_batch_dimension_may_be_any_dimension_and_span_several_rows():
    with keyed_randomness(1, 2, 0):
        first = keyed_uniform(0, (6, 4))
        seq_first = keyed_uniform(0, (4, 6), batch_dim=1)
        flat = keyed_uniform(0, (6 * 2, 2), rows_per_example=2)
    assert torch.equal(seq_first, first.t())
    assert torch.equal(flat.view(6, 4), first)
    with pytest.raises(ValueError, match="not a multiple"):
        keyed_uniform(0, (5, 2), rows_per_example=2)


def test_uniforms_and_normals_have_their_distributions():
    with keyed_randomness(7, 0, 0):
        u = keyed_uniform(0, (64, 16384), dtype=torch.float64)
        n = keyed_normal(1, (64, 16384))
        keep = keyed_keep(2, (64, 16384), 0.1)
        words = keyed_words(3, 0, 64, 16384, "cpu")
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u.float(), 256, 0, 1)
    expected = u.numel() / 256
    assert ((counts - expected) ** 2 / expected).sum().item() / 255 < 1.3   # chi-square per degree
    # neighbours along an example and across examples are uncorrelated
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 5e-3
    bits = torch.stack([(words >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2))
    assert ((bits - 0.5).abs() < 3e-3).all()
    assert abs(n.mean().item()) < 5e-3 and abs(n.std().item() - 1) < 5e-3
    assert abs(keep.double().mean().item() - 0.9) < 2e-3


def test_draws_validate_themselves():
    with pytest.raises(ValueError, match="step"):
        Draws(step=-1)
    with pytest.raises(ValueError, match="seed"):
        Draws(seed=True)
    with pytest.raises(ValueError, match="example_offset"):
        Draws(example_offset=2**32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_same_bits_as_the_cpu():
    with keyed_randomness(3, 4, 10):
        for shape, dim, rows in (((8, 3, 5), 0, 1), ((3, 8), 1, 1), ((16, 7), 0, 2)):
            cpu = keyed_uniform(2, shape, batch_dim=dim, rows_per_example=rows)
            gpu = keyed_uniform(2, shape, batch_dim=dim, rows_per_example=rows, device="cuda")
            assert torch.equal(gpu.cpu(), cpu)
            assert torch.equal(keyed_keep(2, shape, 0.3, batch_dim=dim, rows_per_example=rows, device="cuda").cpu(),
                               keyed_keep(2, shape, 0.3, batch_dim=dim, rows_per_example=rows))
        torch.testing.assert_close(keyed_normal(1, (8, 9), device="cuda").cpu(), keyed_normal(1, (8, 9)))


# -- the capture -----------------------------------------------------------------------------

class Everything(nn.Module):
    """Every kind of random op the capture keys, on shapes the code was not written for:
    channel dropout, dropout on (B*T, C), per-example masks, in-place fills, attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qkv = nn.Linear(6, 8), nn.Linear(8, 24)
        self.drop, self.drop1d, self.alpha = nn.Dropout(0.3), nn.Dropout1d(0.2), nn.AlphaDropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.drop(self.inp(x))
        h = F.dropout(h.reshape(b * t, 8), 0.25, True).view(b, t, 8)
        h = self.alpha(self.drop1d(h))
        q, k, v = self.qkv(h).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True).transpose(1, 2).reshape(b, t, 8)
        keep = (torch.rand(b, 1, 1, device=x.device) > 0.3).to(h.dtype)
        noise = torch.empty_like(h).uniform_(-0.1, 0.1) + torch.empty_like(h).normal_(0, 0.1)
        coins = torch.bernoulli(torch.full_like(h, 0.5)) + torch.empty_like(h).bernoulli_(0.3)
        h = h * keep + noise + coins * 0.1 + torch.randn_like(h) * 0.01
        return h.pow(2).mean() + torch.rand(3, 8, device=x.device).sum()


def _loss_and_grads(gm, x, micro: int, step: int = 3):
    gm.zero_grad()
    total = 0.0
    for start in range(0, x.shape[0], micro):
        part = x[start:start + micro]
        with keyed_randomness(11, step, start, examples=part.shape[0]):
            loss = gm(x=part) * (part.shape[0] / x.shape[0])
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in gm.named_parameters()}


def test_every_random_op_of_a_captured_model_draws_the_same_at_every_micro_batch_size():
    torch.manual_seed(0)
    model = Everything().train()
    x = torch.randn(8, 5, 6)
    traced = capture_model(model, {"x": x[:2]})
    gm = traced.graph_module
    assert not draws_unkeyed(gm)
    keyed = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__module__", "") == "trainer.graph.keyed_random"]
    assert len(keyed) == 12 and "attention" in keyed and "uniform_" in keyed
    ref_loss, ref_grads = _loss_and_grads(gm, x, 8)
    for micro in (1, 3, 4):   # 3: ragged micro-batches of 3, 3 and 2
        loss, grads = _loss_and_grads(gm, x, micro)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert _loss_and_grads(gm, x, 8, step=4)[0] != pytest.approx(ref_loss, rel=1e-3)   # the step is in the key
    # the sequence length stays symbolic: the dropout over (B*T, C) reads T from the micro-batch's
    # examples, which a plain loop must then give
    flat = [n for n in gm.graph.nodes if n.op == "call_function" and n.kwargs.get("key_rows") == 0]
    assert len(flat) == 1, [(n.target.__name__, n.kwargs.get("key_rows")) for n in gm.graph.nodes if "key_op" in n.kwargs]
    longer = torch.randn(4, 7, 6)
    with keyed_randomness(11, 3, 0, examples=4):
        assert torch.isfinite(gm(x=longer))
    with keyed_randomness(11, 3, 0), pytest.raises(ValueError, match=r"examples=N"):
        gm(x=longer)


class Repeated(nn.Module):
    """Batches whose examples repeat along a dimension, as people write them: a sequence-first
    encoder's tokens flattened to (T*B, C) (fairseq), a batch concatenated with itself for two
    dropout views (SimCSE), a batch repeated; and, beside them, repeat_interleave, whose copies
    of an example stay together."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        c = h.shape[-1]
        flat = F.dropout(h.transpose(0, 1).reshape(-1, c), 0.3, True)
        views = F.dropout(torch.cat([h, h]), 0.3, True)
        again = F.dropout(h.repeat(2, 1, 1), 0.3, True)
        together = F.dropout(h.repeat_interleave(2, 0), 0.3, True)
        return sum((t * t.detach().abs().sqrt()).mean() for t in (flat, views, again, together))


def test_examples_repeated_along_the_batch_dimension_draw_the_same_at_every_micro_batch_size():
    """Each such row gets its own example's draw: keyed as if an example's rows were together,
    the row of example e in a micro-batch of m was keyed as example e // 2 (or t's), and the
    model changed with the micro-batch size (a probe's SimCSE model: 1.9e-2)."""
    torch.manual_seed(0)
    gm = capture_model(Repeated().train(), {"x": torch.randn(2, 5, 6)}).graph_module
    rows = [n.kwargs["key_rows"] for n in gm.graph.nodes if "key_rows" in n.kwargs]
    assert rows == [-1, -1, -1, 2], rows
    x = torch.randn(6, 5, 6)
    ref_loss, ref_grads = _loss_and_grads(gm, x, 6)
    for micro in (1, 2, 4):   # 4: ragged micro-batches of 4 and 2
        loss, grads = _loss_and_grads(gm, x, micro)
        assert loss == pytest.approx(ref_loss, rel=1e-5), micro
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class Encoder(nn.Module):
    """torch's own batch-first encoder, whose attention transposes (B, T, C) to (T, B, C) inside."""

    def __init__(self, width: int = 16, tokens: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 2, 32, 0.1, batch_first=True), 2,
                                         enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(self.inp(x)).pow(2).mean()


@pytest.mark.parametrize("examples", [4, 8])
def test_a_sample_with_as_many_examples_as_tokens_keeps_every_draw_keyed_by_example(examples):
    """A probe's samples of 16 examples of 16 tokens: comparing two shapes made the batch size and
    the sequence length one symbol, and every later dropout was keyed by the op alone (its model
    changed with the micro-batch size, 8.5e-3 in the loss, silently); with a fixed number of
    tokens equal to the batch size the capture fixed the batch size and was refused."""
    torch.manual_seed(0)
    tokens = 8
    gm = capture_model(Encoder().train(), {"x": torch.randn(examples, tokens, 4)}).graph_module
    keyed = [n.kwargs["key_dim"] for n in gm.graph.nodes if "key_dim" in n.kwargs]
    assert len(keyed) >= 6 and -1 not in keyed, keyed
    x = torch.randn(8, tokens, 4)
    ref_loss, ref_grads = _loss_and_grads(gm, x, 8)
    for micro in (2, 3):
        loss, grads = _loss_and_grads(gm, x, micro)
        assert loss == pytest.approx(ref_loss, rel=1e-5), micro
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_sequence_first_model_keys_its_dropout_by_the_batch_dimension_it_has():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = F.dropout(self.lin(x).transpose(0, 1), 0.5, True)   # (T, B, C)
            return h.pow(2).mean()

    torch.manual_seed(0)
    gm = capture_model(SeqFirst(), {"x": torch.randn(2, 5, 6)}).graph_module
    x = torch.randn(6, 5, 6)
    ref_loss, ref_grads = _loss_and_grads(gm, x, 6)
    loss, grads = _loss_and_grads(gm, x, 2)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_random_op_without_a_batch_dimension_is_keyed_by_the_op_alone():
    class Shared(nn.Module):
        def forward(self, x):
            return (x * torch.rand(x.shape[1], device=x.device)).sum()

    gm = capture_model(Shared(), {"x": torch.ones(4, 3)}).graph_module
    draws = {}
    for step, offset in ((1, 0), (1, 2), (2, 0)):
        with keyed_randomness(0, step, offset):
            draws[step, offset] = gm(x=torch.ones(2, 3)).item()
    assert draws[1, 0] == draws[1, 2]   # every micro-batch of a step draws the same vector
    assert draws[1, 0] != draws[2, 0]


def test_random_ops_that_draw_in_an_evaluation_as_in_training_are_named():
    """A probe's timm-style drop-path and added noise, each under `if self.training`: the capture
    is of the training forward, so an evaluation drew them (2e-2 off model.eval(), no word);
    dropout alone is off in an evaluation and is not named."""
    class DropPath(nn.Module):
        def __init__(self, noisy: bool):
            super().__init__()
            self.lin, self.noisy = nn.Linear(4, 4), noisy

        def forward(self, x):
            h = F.dropout(self.lin(x), 0.1, self.training)
            if self.training and self.noisy:
                keep = x.new_empty(x.shape[0], 1).bernoulli_(0.7)
                h = h / 0.7 * keep + torch.randn_like(h) * 0.1
            return h.pow(2).mean()

    x = torch.randn(4, 4)
    assert draws_in_evaluation(capture_model(DropPath(True).train(), {"x": x}).graph_module) == [
        "bernoulli_", "randn_like"]
    assert draws_in_evaluation(capture_model(DropPath(False).train(), {"x": x}).graph_module) == []


def test_outside_training_dropout_is_the_identity():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x)

    x = torch.randn(6, 4)
    gm = capture_model(_Sum(Loss()), {"x": x}).graph_module
    with keyed_randomness(0, 0, 0, training=False):
        assert gm(x=x).item() == pytest.approx(model[0](x).sum().item(), rel=1e-6)
    with keyed_randomness(0, 0, 0):
        assert gm(x=x).item() != pytest.approx(model[0](x).sum().item(), rel=1e-3)


class _Sum(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum()


def test_a_random_op_the_engine_cannot_key_is_named_in_the_log(caplog):
    class Ints(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return (self.lin(x) * torch.randint_like(x, 0, 3)).sum()

    with caplog.at_level(logging.WARNING, logger="varuna"):
        gm = capture_model(Ints(), {"x": torch.randn(4, 4)}).graph_module
    assert draws_unkeyed(gm)
    assert "randint_like" in caplog.text and "P x D" in caplog.text


def test_the_plain_loop_helper_splits_a_step_as_the_engine_does():
    torch.manual_seed(0)
    model = Everything().train()
    keyed = keyed_model(model, {"x": torch.randn(2, 5, 6)})
    x = torch.randn(6, 5, 6)
    whole = train_step(keyed, {"x": x}, 2, seed=11)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    split = train_step(keyed, {"x": x}, 2, seed=11, micro_batch_size=4)
    assert split == pytest.approx(whole, rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_executor_keys_each_micro_batch_and_saves_no_generator_state():
    """The executor enters each micro-batch's key around its forward: two micro-batches of one
    step draw as examples 0..1 and 2..3 of it, what the plain loop draws for them."""
    from trainer.engine.executor import StageExecutor
    from trainer.planning.schedule import Action, Kind

    torch.manual_seed(0)
    model = Everything().train()
    gm = capture_model(model, {"x": torch.randn(2, 5, 6)}).graph_module
    executor = StageExecutor(gm, stage=0, stages=1, takes_activation=False, channel=None,
                             device=torch.device("cpu"), precision="fp32")
    assert not executor._saves_rng   # keyed ops replay from their keys: nothing to save
    x = torch.randn(4, 5, 6)
    micro = [{"x": x[:2]}, {"x": x[2:]}]
    actions = [Action(0, kind, m) for m in (0, 1) for kind in (Kind.FORWARD, Kind.BACKWARD)]
    got = executor.run(actions, micro, [0.5, 0.5], draws=[Draws(11, 3, 0, examples=2), Draws(11, 3, 2, examples=2)])
    engine_grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    want, grads = _loss_and_grads(gm, x, 4, step=3)
    assert got == pytest.approx(want, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(engine_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_plain_loops_reference_weighs_micro_batches_by_the_scripts_loss_count():
    """keyed_model took no loss_count: a script's own counter, which Varuna(loss_count=) uses,
    was left out, and train_step weighed micro-batches by examples (a probe: 2.0e-2 off)."""
    from trainer.graph.reference import keyed_model, train_step

    class TokenMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            per_token = self.lin(x).pow(2).mean(-1)
            return (per_token * mask).sum() / mask.sum()

    torch.manual_seed(0)
    model = TokenMean()
    x, mask = torch.randn(4, 5, 4), torch.tensor([[1.0] * 5, [1.0] + [0.0] * 4, [1.0] * 3 + [0.0] * 2, [1.0] * 5])
    whole = model(x, mask).item()
    keyed = keyed_model(model, {"x": x[:2], "mask": mask[:2]}, loss_count=lambda m: m["mask"].sum())
    assert train_step(keyed, {"x": x, "mask": mask}, 0, micro_batch_size=2) == pytest.approx(whole, rel=1e-6)
    # on auto, the masked mean is read from the graph (trainer.graph.loss_form): its divisor counts
    read = keyed_model(model, {"x": x[:2], "mask": mask[:2]})
    assert train_step(read, {"x": x, "mask": mask}, 0, micro_batch_size=2) == pytest.approx(whole, rel=1e-6)
    by_examples = keyed_model(model, {"x": x[:2], "mask": mask[:2]}, loss_count=None)
    assert train_step(by_examples, {"x": x, "mask": mask}, 0, micro_batch_size=2) != pytest.approx(whole, rel=1e-3)
