"""A capture kept on disk is loaded by the next capture of the same model, computes what a fresh
one computes with the model's own tensors, and is not used when the model or torch changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer.graph import capture_cache
from trainer.graph.partition import ACTIVATION, capture_model, slice_stages
from trainer.models.gpt import GPT, GPTConfig


def _gpt(seed=0, **overrides):
    cfg = GPTConfig.preset("tiny", **overrides)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    return GPT(cfg, seed=seed), {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}


def _loss_and_grads(traced, model, batch, cuts):
    """The sliced stages run one after another, then one backward: the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    x = None
    for sl in slice_stages(traced, cuts):
        kwargs = {k: batch[k] for k in sl.input_names}
        if sl.takes_activation:
            kwargs[ACTIVATION] = x
        x = sl.module(**kwargs)
    x.backward()
    return x.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _entries(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("capture-"))


def test_a_kept_capture_is_loaded_and_trains_the_models_own_weights(tmp_path):
    model, batch = _gpt()
    first = capture_model(model, batch, cache_dir=tmp_path)
    assert not first.reused and len(_entries(tmp_path)) == 1
    again = capture_model(model, batch, cache_dir=tmp_path)
    assert again.reused and len(_entries(tmp_path)) == 1
    for cuts in ([], [1]):
        loss, grads = _loss_and_grads(first, model, batch, cuts)
        loss2, grads2 = _loss_and_grads(again, model, batch, cuts)
        torch.testing.assert_close(loss2, loss)
        assert grads2.keys() == grads.keys() and grads
        for name in grads:
            torch.testing.assert_close(grads2[name], grads[name], msg=name)
    # the kept file holds the graph, not the weights
    size = (tmp_path / _entries(tmp_path)[0]).stat().st_size
    assert size < sum(p.numel() * p.element_size() for p in model.parameters())
    # what a loaded capture computes follows the model's weights as they are now
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5) if hasattr(model, "lm_head") else next(model.parameters()).mul_(0.5)
    now = capture_model(model, batch, cache_dir=tmp_path)
    assert now.reused
    torch.testing.assert_close(_loss_and_grads(now, model, batch, [])[0], model(**batch).detach())


def test_a_loaded_capture_draws_its_dropout_as_a_fresh_one(tmp_path):
    """Random ops are keyed after the load as after an export: the same draws for the same key."""
    from trainer.graph.keyed_rng import Draws, drawing
    model, batch = _gpt(dropout=0.3)
    fresh = capture_model(model, batch, cache_dir=tmp_path)
    loaded = capture_model(model, batch, cache_dir=tmp_path)
    assert loaded.reused
    losses = []
    for traced in (fresh, loaded, fresh):
        with drawing(Draws(seed=5, step=3, example_offset=8)):
            losses.append(_loss_and_grads(traced, model, batch, [1])[0])
    with drawing(Draws(seed=5, step=4, example_offset=8)):
        other = _loss_and_grads(loaded, model, batch, [1])[0]
    assert losses[0] == losses[1] == losses[2] != other


def test_a_changed_model_or_torch_is_a_miss(tmp_path, monkeypatch):
    model, batch = _gpt()
    capture_model(model, batch, cache_dir=tmp_path)
    wider, _ = _gpt(n_embd=64)
    assert not capture_model(wider, batch, cache_dir=tmp_path).reused
    model.eval()   # dropout off: another graph
    assert not capture_model(model, batch, cache_dir=tmp_path).reused
    model.train()
    shorter = {k: v[:, :-1] for k, v in batch.items()}   # another sequence length
    assert not capture_model(model, shorter, cache_dir=tmp_path).reused
    # the batch dimension is dynamic: another micro-batch size loads the same program
    more = {k: torch.cat([v, v]) for k, v in batch.items()}
    traced = capture_model(model, more, cache_dir=tmp_path)
    assert traced.reused
    torch.testing.assert_close(_loss_and_grads(traced, model, more, [1])[0], model(**more).detach())
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert not capture_model(model, batch, cache_dir=tmp_path).reused
    monkeypatch.undo()
    assert capture_model(model, batch, cache_dir=tmp_path).reused
    assert len(_entries(tmp_path)) == 5


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.relu(self.a(x))).squeeze(-1), y)


class _MlpTanh(_Mlp):   # the same parameters, another forward
    def forward(self, x, y):
        return F.mse_loss(self.b(torch.tanh(self.a(x))).squeeze(-1), y)


def test_settings_that_are_not_tensors_are_in_the_key(tmp_path):
    """The same parameters, another computation: attention heads, a norm's eps."""
    model, batch = _gpt()
    capture_model(model, batch, cache_dir=tmp_path)
    heads, _ = _gpt(n_head=2)
    traced = capture_model(heads, batch, cache_dir=tmp_path)
    assert not traced.reused
    torch.testing.assert_close(_loss_and_grads(traced, heads, batch, [])[0], heads(**batch).detach())
    eps, _ = _gpt()
    for m in eps.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 1e-3
    assert not capture_model(eps, batch, cache_dir=tmp_path).reused


def test_the_kept_file_holds_neither_weights_nor_the_sample(tmp_path):
    model, batch = _gpt()
    capture_model(model, batch, cache_dir=tmp_path)
    (entry,) = _entries(tmp_path)
    ep = torch.export.load(tmp_path / entry)
    assert ep.example_inputs is None
    assert all(t.is_meta for t in ep.state_dict.values())


def test_a_kept_program_that_does_not_fit_is_exported_again_and_replaced(tmp_path, caplog):
    model, batch = _gpt()
    other = _Mlp()
    mlp_batch = {"x": torch.randn(4, 8), "y": torch.randn(4)}
    capture_model(other, mlp_batch, cache_dir=tmp_path)
    (mlp_entry,) = _entries(tmp_path)
    key = capture_cache.cache_key(model, batch, {})
    (tmp_path / mlp_entry).rename(tmp_path / f"capture-{key}.pt2")   # another model's program under this key
    traced = capture_model(model, batch, cache_dir=tmp_path)
    assert not traced.reused and "does not fit this model" in caplog.text
    torch.testing.assert_close(_loss_and_grads(traced, model, batch, [])[0], model(**batch).detach())
    assert capture_model(model, batch, cache_dir=tmp_path).reused


def test_a_killed_writers_temporary_is_swept(tmp_path):
    import os
    stale, fresh = tmp_path / ".capture-old.pt2", tmp_path / ".capture-new.pt2"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (0, 0))
    model, batch = _gpt()
    capture_model(model, batch, cache_dir=tmp_path)
    assert not stale.exists() and fresh.exists()   # a writer may still be writing the fresh one


def test_a_changed_forward_with_the_same_parameters_is_a_miss(tmp_path):
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4)}
    relu, tanh = _Mlp(), _MlpTanh()
    tanh.load_state_dict(relu.state_dict())
    capture_model(relu, batch, cache_dir=tmp_path)
    traced = capture_model(tanh, batch, cache_dir=tmp_path)
    assert not traced.reused
    torch.testing.assert_close(_loss_and_grads(traced, tanh, batch, [])[0], tanh(**batch).detach())


def test_a_kept_file_that_does_not_load_is_exported_again_and_replaced(tmp_path, caplog):
    model, batch = _gpt()
    capture_model(model, batch, cache_dir=tmp_path)
    (entry,) = _entries(tmp_path)
    (tmp_path / entry).write_bytes(b"not a program")
    traced = capture_model(model, batch, cache_dir=tmp_path)
    assert not traced.reused and "does not load" in caplog.text
    assert capture_model(model, batch, cache_dir=tmp_path).reused


def test_buffers_a_forward_updates_are_the_models_own_after_a_load(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                      nn.Linear(4 * 6 * 6, 2))

        def forward(self, x, y):
            return F.cross_entropy(self.body(x), y)

    batch = {"x": torch.randn(4, 3, 8, 8), "y": torch.tensor([0, 1, 1, 0])}
    net = Net()
    capture_model(net, batch, cache_dir=tmp_path)
    traced = capture_model(net, batch, cache_dir=tmp_path)
    assert traced.reused
    bn = net.body[1]
    before = bn.running_mean.clone()
    _loss_and_grads(traced, net, batch, [])
    assert not torch.equal(bn.running_mean, before) and int(bn.num_batches_tracked) == 1


def test_a_hugging_face_model_given_as_it_is_is_kept_and_loaded(tmp_path):
    pytest.importorskip("transformers")
    from support import zoo
    model = zoo.build("gpt2").eval()   # unwrapped: its output holds the loss, the logits and its cache
    batch = zoo.global_batch("gpt2", 0)
    capture_model(model, batch, cache_dir=tmp_path)
    traced = capture_model(model, batch, cache_dir=tmp_path)
    assert traced.reused
    loss, _ = _loss_and_grads(traced, model, batch, [0])
    torch.testing.assert_close(loss, model(**batch).loss.detach())


def test_the_key_reads_no_weight_values():
    model, batch = _gpt()
    other, _ = _gpt(seed=7)
    assert capture_cache.cache_key(model, batch, {}) == capture_cache.cache_key(other, batch, {})


def test_a_calibrations_capture_is_the_one_the_first_worker_loads(tmp_path):
    """The calibration run keeps its export where the job's workers look: the worker that follows
    on the same VM loads it (at its own micro-batch size), and the model's fingerprint, which
    finds the calibration again, is the same from the kept program as from a fresh export."""
    from trainer.profiler.calibrate import Profiler
    from trainer.profiler.identity import model_fingerprint

    model, batch = _gpt()

    def get_batch(n, device=None):
        return {k: v[:n] for k, v in batch.items()}

    profiler = Profiler(model, get_batch, out_folder=tmp_path / "profiles", capture_cache=tmp_path / "cap")
    assert not profiler.traced.reused and len(_entries(tmp_path / "cap")) == 1
    worker = capture_model(model, get_batch(3), cache_dir=tmp_path / "cap")
    assert worker.reused and len(_entries(tmp_path / "cap")) == 1
    assert model_fingerprint(model, traced=worker) == profiler.fingerprint
    torch.testing.assert_close(_loss_and_grads(worker, model, batch, [1])[0], model(**batch).detach())
