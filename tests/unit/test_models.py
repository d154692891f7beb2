"""Reference models: shapes, tying, determinism, capture with torch.export, micro-batch invariance, learning."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.data import GlobalBatches, ImageDataset, TextDataset
from trainer.errors import ConfigError
from trainer.graph.capture import capture_model
from trainer.graph.cutpoint import CutPoint
from trainer.models.cnn import CNN, CNNConfig
from trainer.models.cnn import PRESETS as CNN_PRESETS
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.gpt import PRESETS as GPT_PRESETS

TINY = GPTConfig.preset("tiny")


@pytest.fixture(autouse=True)
def _one_thread():
    # Models this small gain nothing from intra-op threads, and on a shared, busy machine
    # spinning thread pools make the training tests many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tokens(cfg: GPTConfig, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(cfg.vocab_size, (n, cfg.seq_len), generator=g),
        "targets": torch.randint(cfg.vocab_size, (n, cfg.seq_len), generator=g),
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --- GPT -------------------------------------------------------------------------------

def test_parameter_formula_matches_the_built_model():
    for cfg in (TINY, GPTConfig(vocab_size=50, seq_len=7, n_layer=2, n_head=2, n_embd=16)):
        model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_presets_have_their_advertised_sizes():
    assert 80_000 <= GPT_PRESETS["tiny"].num_parameters() <= 250_000
    assert 10_000_000 <= GPT_PRESETS["small"].num_parameters() <= 30_000_000
    assert 90_000_000 <= GPT_PRESETS["gpt100m"].num_parameters() <= 110_000_000


def test_output_head_is_tied_to_the_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    model(**_tokens(TINY, 2)).backward()
    # The shared Parameter collects gradient from both uses, and is listed once.
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "wte.weight" in names


def test_initialisation_is_deterministic_and_ignores_the_global_rng():
    torch.manual_seed(1)
    a = GPT(TINY, seed=7).state_dict()
    torch.manual_seed(2)
    b = GPT(TINY, seed=7).state_dict()
    c = GPT(TINY, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.c_attn.weight"], c["blocks.0.attn.c_attn.weight"])


def test_initial_loss_is_near_uniform_over_the_vocabulary():
    loss = GPT(TINY)(**_tokens(TINY, 8))
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.2


def test_attention_is_causal():
    model = GPT(TINY).eval()
    captured = []
    model.ln_f.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
    batch = _tokens(TINY, 2)
    model(**batch)
    changed = batch["input_ids"].clone()
    changed[:, -1] = (changed[:, -1] + 1) % TINY.vocab_size
    model(input_ids=changed, targets=batch["targets"])
    before, after = captured
    assert torch.allclose(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_capture_keeps_one_cut_point_per_layer_and_matches_eager():
    model = GPT(TINY)
    batch = _tokens(TINY, 3)
    traced = capture_model(model, batch)
    assert traced.input_names == ("input_ids", "targets")
    assert traced.marker_names == [f"cuts.{i}" for i in range(TINY.n_layer)]
    torch.testing.assert_close(traced.graph_module(**batch), model(**batch))


def test_dropout_masks_replay_from_the_rng_state():
    cfg = GPTConfig.preset("tiny", dropout=0.2)
    model = GPT(cfg).train()
    batch = _tokens(cfg, 2)
    state = torch.get_rng_state()
    first = model(**batch)
    second = model(**batch)
    torch.set_rng_state(state)
    replay = model(**batch)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)


def test_equal_micro_batches_average_to_the_full_batch_gradient():
    # [Note: the global batch defines the math] in ARCHITECTURE.md: splitting a batch into equal micro-batches must not change the gradient.
    model = GPT(TINY)
    batch = _tokens(TINY, 4)
    model(**batch).backward()
    full = _grads(model)
    model.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        (model(**{k: v[half] for k, v in batch.items()}) / 2).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, full[name], rtol=1e-4, atol=1e-6)


def test_tiny_gpt_learns_the_generated_text():
    torch.manual_seed(0)
    ds = TextDataset(TINY.seq_len, num_examples=512)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = GlobalBatches(len(ds), 16, seed=0)
    losses = []
    for step in range(60):
        loss = model(**ds.batch(batches.indices(step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Uniform guessing is ln(96) = 4.56; the generated text's character statistics alone are worth ~1.3 nats.
    assert losses[0] > 4.0
    assert sum(losses[-5:]) / 5 < 3.3


def test_gpt_config_rejects_bad_shapes():
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(n_embd=50, n_head=4)
    with pytest.raises(ConfigError, match="preset"):
        GPTConfig.preset("huge")
    assert GPTConfig.preset("tiny", n_layer=2).n_layer == 2


# --- CNN -------------------------------------------------------------------------------

def test_cnn_has_a_sequential_body_and_no_cut_points():
    for cfg in CNN_PRESETS.values():
        model = CNN(cfg)
        assert isinstance(model.body, torch.nn.Sequential)
        assert len(model.body) == cfg.num_blocks
        assert not any(isinstance(m, (CutPoint, torch.nn.BatchNorm2d)) for m in model.modules())
        images = torch.randn(3, cfg.in_channels, cfg.image_size, cfg.image_size)
        assert model.body(images).shape == (3, cfg.num_classes)


def test_cnn_captures_and_matches_eager():
    cfg = CNN_PRESETS["tiny"]
    model = CNN(cfg)
    batch = ImageDataset(8, channels=cfg.in_channels, image_size=cfg.image_size).batch(range(8))
    traced = capture_model(model, batch)
    assert traced.input_names == ("images", "labels")
    torch.testing.assert_close(traced.graph_module(**batch), model(**batch))


def test_cnn_gradient_does_not_depend_on_micro_batching():
    cfg = CNN_PRESETS["tiny"]
    model = CNN(cfg)
    batch = ImageDataset(8).batch(range(8))
    model(**batch).backward()
    full = _grads(model)
    model.zero_grad()
    for part in (slice(0, 4), slice(4, 8)):
        (model(**{k: v[part] for k, v in batch.items()}) / 2).backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, full[name], rtol=1e-4, atol=1e-6)


def test_cnn_learns_the_synthetic_images():
    cfg = CNN_PRESETS["tiny"]
    ds = ImageDataset(512, channels=cfg.in_channels, image_size=cfg.image_size, num_classes=cfg.num_classes)
    model = CNN(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = GlobalBatches(len(ds), 32, seed=0)
    losses = []
    for step in range(50):
        loss = model(**ds.batch(batches.indices(step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_cnn_config_rejects_an_image_it_cannot_pool():
    with pytest.raises(ConfigError, match="halved"):
        CNNConfig(image_size=18, stages=2)
