"""Slicing a model into stages: the slices compute the whole model, misuse gets a clear error."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint
from trainer.errors import ConfigError, PartitionError
from trainer.graph.layout import build_layout
from trainer.graph.partition import ACTIVATION, balance, capture_model, dry_run, slice_stages
from trainer.models.cnn import CNN, CNNConfig
from trainer.models.gpt import GPT, GPTConfig


def gpt_batch(cfg, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g)
    return {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}


def run_slices(slices, batch):
    x = None
    for sl in slices:
        kwargs = {k: batch[k] for k in sl.input_names}
        if sl.takes_activation:
            kwargs[ACTIVATION] = x
        x = sl.module(**kwargs)
    return x


@pytest.mark.parametrize("cuts", [[], [1], [0, 2], [0, 1, 2, 3]])
def test_slices_compute_the_whole_model(cuts):
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0)
    batch = gpt_batch(cfg)
    expected = model(**batch)
    slices = slice_stages(capture_model(model, batch), cuts)
    assert len(slices) == len(cuts) + 1
    torch.testing.assert_close(run_slices(slices, batch), expected)


def test_stages_own_disjoint_layers_and_share_the_tied_embedding():
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0)
    traced = capture_model(model, gpt_batch(cfg))
    slices = slice_stages(traced, [1, 3])
    owned = [set(s.owned) for s in slices]
    assert "wte.weight" in owned[0] and "wte.weight" in owned[-1]
    assert not (owned[0] - {"wte.weight"}) & owned[-1]
    assert set().union(*owned) == {n for n, _ in model.named_parameters()}
    assert slices[0].input_names == ("input_ids",) and not slices[0].takes_activation
    assert slices[-1].input_names == ("targets",) and slices[-1].takes_activation
    layout = build_layout(traced, slices, aliases={n: n for n, _ in model.named_parameters()})
    assert layout.tied == (("wte.weight",),)
    assert layout.owners["wte.weight"] == (0, 2)


def test_a_cut_plan_does_not_change_layer_files():
    """Checkpoint files are named by layer, so every plan writes the same names."""
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0)
    traced = capture_model(model, gpt_batch(cfg))
    files = [build_layout(traced, slice_stages(traced, cuts)).files for cuts in ([], [1], [0, 2])]
    assert files[0] == files[1] == files[2]
    assert len(set(files[0].values())) == len(traced.markers) + 1   # one file per layer


def test_model_without_cutpoints_is_cut_between_sequential_blocks():
    cfg = CNNConfig.preset("tiny")
    model = CNN(cfg)
    batch = {"images": torch.randn(2, cfg.in_channels, cfg.image_size, cfg.image_size),
             "labels": torch.tensor([0, 1])}
    traced = capture_model(model, batch)
    assert traced.auto and traced.marker_names
    assert all(name.endswith(":out") for name in traced.marker_names)
    slices = slice_stages(traced, [0])
    torch.testing.assert_close(run_slices(slices, batch), model(**batch))


def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1], 2) == [1]
    assert balance([4, 1, 1, 1, 1], 2) == [0]
    assert balance([1, 1, 1, 1, 1, 1], 3) == [1, 3]
    assert balance([3, 1, 1, 1], 4) == [0, 1, 2]
    # any P up to the number of cut points + 1, not only divisors
    assert len(balance([1] * 5, 3)) == 2


def test_too_many_stages_says_how_many_are_possible():
    with pytest.raises(PartitionError, match="at most 5 stages"):
        balance([1.0] * 5, 6)


def test_dry_run_times_every_segment():
    cfg = GPTConfig.preset("tiny")
    traced = capture_model(GPT(cfg, seed=0), gpt_batch(cfg))
    costs = dry_run(traced, gpt_batch(cfg), repeats=1)
    assert len(costs) == len(traced.markers) + 1 and all(c > 0 for c in costs)


X = {"x": torch.randn(3, 4)}


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.cut = nn.Linear(4, 4), CutPoint()

    def forward(self, x):
        return self.cut(self.cut(self.lin(x))).sum()


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.cut, self.b = nn.Linear(4, 4), CutPoint(), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return (self.b(self.cut(h)) + h).sum()


class _NotBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.cut = nn.Linear(4, 4), CutPoint()

    def forward(self, x):
        return self.cut(self.a(x).sum(0)).sum()


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:
            return y.sum()
        return -y.sum()


def test_cutpoint_called_twice_is_refused():
    with pytest.raises(PartitionError, match="called twice"):
        capture_model(_Twice(), X)


def test_skip_connection_across_a_cut_is_refused():
    with pytest.raises(PartitionError, match="skip connection"):
        slice_stages(capture_model(_Skip(), X), [0])


def test_cutpoint_input_must_be_batch_first():
    with pytest.raises(PartitionError, match="first dimension is the batch"):
        dry_run(capture_model(_NotBatchFirst(), X), X, repeats=1)


def test_untraceable_model_says_why():
    with pytest.raises(PartitionError, match="cannot capture") as err:
        capture_model(_DataDependent(), X)
    message = str(err.value)
    assert "control flow depends on a tensor's value" in message
    assert "test_partition.py" in message and "if y.sum() > 0" in message   # where, in the user's code
    assert "torch.where" in message                                       # what to change


def test_hugging_face_layerdrop_is_refused_with_the_config_setting_to_change(capfd):
    """A probe's OPT with layerdrop 0.2: the advice was to rewrite transformers' code with torch.where,
    after 300 lines of partial graphs torch printed to stderr."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.OPTConfig(vocab_size=50, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                                 max_position_embeddings=16, word_embed_proj_dim=16, layerdrop=0.2, use_cache=False)
    model = transformers.OPTForCausalLM(cfg).train()
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(PartitionError, match="cannot capture") as err:
        capture_model(model, {"input_ids": ids, "labels": ids})
    message = str(err.value)
    assert "LayerDrop skips layers at random" in message and "modeling_opt.py" in message
    assert "set the model's LayerDrop to 0 in its config" in message
    assert "def forward(" not in capfd.readouterr().err


def test_what_forward_writes_to_stderr_while_captured_still_reaches_stderr(capfd):
    class Chatty(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            print("in forward", file=sys.stderr)
            return self.lin(x).sum()

    capture_model(Chatty(), {"x": torch.randn(2, 4)})
    assert "in forward" in capfd.readouterr().err


def test_unknown_shared_weight_name_is_refused():
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0)
    traced = capture_model(model, gpt_batch(cfg))
    aliases = {n: n for n, _ in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(ConfigError, match="lm_head.wieght"):
        build_layout(traced, slice_stages(traced, [1]), [("wte.weight", "lm_head.wieght")], aliases)


def test_distinct_parameters_named_in_shared_weights_are_tied():
    class TwoEmbeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.cut, self.out = nn.Embedding(8, 4), CutPoint(), nn.Linear(4, 8, bias=False)

        def forward(self, ids, targets):
            return F.cross_entropy(self.out(self.cut(self.emb(ids))), targets)

    model = TwoEmbeddings()
    traced = capture_model(model, {"ids": torch.tensor([1, 2]), "targets": torch.tensor([2, 3])})
    aliases = {n: n for n, _ in model.named_parameters()}
    layout = build_layout(traced, slice_stages(traced, [0]), [("emb.weight", "out.weight")], aliases)
    assert layout.tied == (("emb.weight", "out.weight"),)


def test_buffer_updates_run_once_in_the_stage_of_their_layer():
    """BatchNorm's running statistics (updated inside the op) and num_batches_tracked (an
    in-place add nothing reads) are kept by the capture and run in the stage that owns them."""
    body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x, y):
            return F.cross_entropy(self.body(x), y)

    batch = {"x": torch.randn(4, 3, 8, 8), "y": torch.tensor([0, 1, 1, 0])}
    traced = capture_model(Net(), batch)
    slices = slice_stages(traced, [1])      # BatchNorm in stage 0, the head in stage 1
    assert "body.1.num_batches_tracked" in slices[0].owned_buffers
    assert not slices[1].owned_buffers
    bn = body[1]
    expected = bn.running_mean * 0.9 + 0.1 * body[0](batch["x"]).mean((0, 2, 3))
    run_slices(slices, batch)
    torch.testing.assert_close(bn.running_mean, expected.detach())
    assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_hugging_face_model_given_as_it_is_trains_on_its_own_loss(name):
    """No wrapper: forward returns a ModelOutput (loss, logits, and for a causal LM its key-value
    cache, on by default); the capture keeps the loss and passes use_cache=False."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                                 bos_token_id=0, eos_token_id=0))
        assert model.config.use_cache
    else:
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                 intermediate_size=64, vocab_size=64, max_position_embeddings=16))
    model.eval()
    ids = torch.randint(1, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    traced = capture_model(model, batch)
    assert traced.input_names == ("input_ids", "labels")
    expected = model(**batch).loss
    for cuts in ([], [0]):
        torch.testing.assert_close(run_slices(slice_stages(traced, cuts), batch), expected)


def test_a_dict_output_without_a_loss_still_says_to_return_the_loss():
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return {"hidden": h, "logits": self.b(h)}

    with pytest.raises(PartitionError, match="must return the loss as a single scalar"):
        capture_model(Logits(), {"x": torch.randn(3, 4)})


def test_cut_points_inside_a_forward_under_autocast_are_named_as_the_reason_it_cannot_be_cut(caplog):
    """torch.export keeps a region under torch.autocast as one op: the cut points in it are lost,
    and the capture says so, with the fix, before a pipeline fails for want of cut points."""

    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.b(self.cut(self.a(x))).float().pow(2).mean()

    with caplog.at_level("WARNING", logger="varuna"):
        traced = capture_model(Autocast(), {"x": torch.randn(3, 4)})
    assert traced.markers == ()
    assert any("1 cut point(s) lie inside wrap_with_autocast" in r.getMessage() and "precision='bf16'" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_batch_keys_forward_does_not_name_are_left_out_even_past_its_kwargs():
    """A batch holding an example's id beside a Hugging Face model's inputs: forward takes it only
    through **kwargs, which torch.export cannot give a dynamic batch dimension, and step() never
    passes it. Left out of the capture; a forward that names nothing is told how to take its inputs."""

    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x, y, **kwargs):
            return F.mse_loss(self.lin(x).squeeze(-1), y)

    batch = {"x": torch.randn(4, 3), "y": torch.randn(4), "example_id": torch.arange(4)}
    traced = capture_model(Kw(), batch)
    assert traced.input_names == ("x", "y")

    class OnlyKw(nn.Module):
        def forward(self, **batch):
            return batch["x"].sum()

    with pytest.raises(ConfigError, match=r"takes the batch only through \*\*kwargs"):
        capture_model(OnlyKw(), batch)


def test_a_skip_across_automatic_cuts_says_nobody_placed_them_and_what_to_do():
    """T5 at P=2 was refused with "move the CutPoint" though its user placed none."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            h0 = self.embed(x)
            h = h0
            for block in self.blocks:
                h = block(h) + h0   # every block reads the embedding: more than one tensor crosses a cut
            return h.pow(2).mean()

    traced = capture_model(Residual(), X)
    assert traced.auto
    with pytest.raises(PartitionError, match=r"placed automatically.*CutPoint\(\)s where one tensor.*\(P=1\)"):
        slice_stages(traced, [0])


class _NanoBlock(nn.Module):
    """A block as nanoGPT-style code writes it: the MLP is a four-long nn.Sequential."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.0))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class _NanoLM(nn.Module):
    def __init__(self, d=8, layers=3, vocab=11):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d),
                                              h=nn.ModuleList(_NanoBlock(d) for _ in range(layers))))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_automatic_cuts_fall_between_the_blocks_not_inside_a_longer_mlp():
    """A 3-layer model whose MLP is a 4-long Sequential was cut inside the first block's MLP."""
    from trainer.graph.capture import auto_blocks

    model = _NanoLM()
    assert auto_blocks(model) == ("transformer.h.0", "transformer.h.1")
    # an outer (body, head) pair offers one cut with nearly every weight on one side: the blocks win
    wrapped = nn.Sequential(model, nn.Identity())
    assert auto_blocks(wrapped) == ("0.transformer.h.0", "0.transformer.h.1")
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    batch = {"idx": idx, "targets": torch.roll(idx, -1, 1)}
    traced = capture_model(model, batch)
    assert traced.marker_names == ["transformer.h.0:out", "transformer.h.1:out"]
    torch.testing.assert_close(run_slices(slice_stages(traced, [0, 1]), batch), model(**batch))


def test_the_users_model_after_its_other_stages_were_freed_says_so_when_called():
    """nanoGPT's estimate_loss calls model(X, Y): at P > 1 it failed deep in a layer on the freed
    tensors ("'weight' must be 2-D")."""
    from trainer.engine.setup import free_other_stages

    cfg = GPTConfig.preset("tiny")
    model, batch = GPT(cfg, seed=0), gpt_batch(cfg)
    traced = capture_model(model, batch)
    everything = set(traced.canonical.values())
    free_other_stages(model, traced.canonical, everything)   # P = 1: nothing freed, the model runs
    model(**batch)
    assert model.state_dict().keys()
    first = {name for name, _ in model.named_parameters() if name.startswith("wte")}
    free_other_stages(model, traced.canonical, first)
    with pytest.raises(ConfigError, match=r"split into pipeline stages.*varuna.evaluate"):
        model(**batch)
    # torch.save(model.state_dict()) and save_pretrained wrote the freed tensors as empty ones, and
    # the file failed only when loaded (a probe's GPT-2 at P = 2)
    with pytest.raises(ConfigError, match=r"state_dict would hold the other stages' weights as empty.*varunactl export"):
        model.state_dict()
