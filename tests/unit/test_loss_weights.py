"""What a micro-batch's loss weighs (trainer.graph.loss_weights); the launched check against a
full-batch loop is the zoo's gpt2_sft in tests/integration/test_model_zoo.py."""

import pytest
import torch
import torch.nn.functional as F
from support import zoo
from torch import nn

from trainer import keyed_model, train_step
from trainer.errors import ConfigError
from trainer.graph.capture import capture_model
from trainer.graph.loss_weights import counter_for, counts, token_weights


def _hf(kind: str) -> nn.Module:
    import transformers as tf
    tf.logging.set_verbosity_error()
    bert = tf.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=16)
    return {"causal": lambda: zoo.build("gpt2"), "masked": lambda: tf.BertForMaskedLM(bert),
            "classes": lambda: tf.BertForSequenceClassification(bert)}[kind]()


def test_each_kind_of_hugging_face_loss_is_counted_as_its_loss_function_counts():
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    micro = {"input_ids": labels.clamp(min=0), "labels": labels}
    assert int(counter_for(_hf("causal"), "auto")(micro)) == 4   # shifted by one: position 0 predicts nothing
    assert int(counter_for(_hf("masked"), "auto")(micro)) == 5   # aligned with the logits
    classes = counter_for(_hf("classes"), "auto")
    assert classes is None or classes({"labels": torch.tensor([1, 0])}) is None   # one label per example
    assert counter_for(nn.Linear(2, 2), "auto") is None   # not Hugging Face: by examples
    assert counter_for(nn.Linear(2, 2), None) is None
    mine = counter_for(nn.Linear(2, 2), lambda m: (m["y"] >= 0).sum())
    assert counts(mine, [{"y": torch.tensor([1, -1])}, {"y": torch.tensor([1, 2])}]) == [1, 2]
    with pytest.raises(ConfigError, match="loss_count reads 'y'"):
        counts(mine, [{"x": torch.tensor([1])}])
    with pytest.raises(ConfigError, match="'auto', None or a callable"):
        counter_for(nn.Linear(2, 2), "tokens")
    assert token_weights([3, 1], 4) == [0.75, 0.25] and token_weights([0, 0], 0) == [0.0, 0.0]


def test_a_token_mean_loss_trains_the_same_model_at_every_micro_batch_size():
    """The plain-loop helper weighs micro-batches as the engine does: by tokens, the full batch's loss."""
    want, _ = zoo.reference("gpt2_sft", 2)
    for size in (1, 2, 8):
        model = zoo.build("gpt2_sft")
        opt = zoo.optimizer(model.parameters())
        keyed = keyed_model(model, zoo.sample_batch_fn("gpt2_sft")(2, "cpu"))
        got = []
        for step in range(2):
            opt.zero_grad()
            got.append(train_step(keyed, zoo.global_batch("gpt2_sft", step), step, micro_batch_size=size))
            opt.step()
        assert got == pytest.approx(want, rel=1e-5), size


def test_a_micro_batch_with_no_token_to_average_adds_nothing_not_nan():
    """Prompt-only or padded rows: a micro-batch whose labels are all -100 has a loss of 0/0. It
    weighs nothing, and the step's loss is the full batch's (an outside probe saw NaN)."""
    from trainer.engine.executor import StageExecutor
    from trainer.planning.schedule import Action, Kind

    batch = zoo.global_batch("gpt2_sft", 0)
    batch["labels"][:2] = -100   # the first micro-batch of 2 holds nothing to predict
    model = zoo.build("gpt2_sft")
    want = float(model(**batch).loss.detach())
    keyed = keyed_model(model, zoo.sample_batch_fn("gpt2_sft")(2, "cpu"))
    assert train_step(keyed, batch, 0, micro_batch_size=2) == pytest.approx(want, rel=1e-5)
    counted = counts(counter_for(model, "auto"), [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, 8, 2)])
    assert counted[0] == 0
    executor = StageExecutor(keyed, stage=0, stages=1, takes_activation=False, channel=None,
                             device=torch.device("cpu"), precision="fp32")
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    actions = [Action(0, kind, m) for m in range(4) for kind in (Kind.FORWARD, Kind.BACKWARD)]
    got = executor.run(actions, micro, token_weights(counted, sum(counted)))
    assert got == pytest.approx(want, rel=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in keyed.parameters() if p.grad is not None)


class _Tokens(nn.Module):
    """A language model's loss as scripts write it, in several forms."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.emb, self.head, self.form = nn.Embedding(11, 8), nn.Linear(8, 11), form

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(idx)).flatten(0, 1)
        flat = targets.flatten()
        if self.form == "ignore":
            return F.cross_entropy(logits, flat, ignore_index=-1) * 2.0
        if self.form == "sum":
            return F.cross_entropy(logits, flat.clamp(min=0), reduction="sum")
        if self.form == "nll":
            return F.nll_loss(F.log_softmax(logits, -1), flat, ignore_index=-1)
        if self.form == "assigned":   # padding marked in forward, as scripts write it
            t = targets.clone()
            t[t == -1] = -100
            return F.cross_entropy(logits, t.flatten())
        if self.form == "wrapped":   # dtype, sign and a tensor divisor do not change what it averages
            return -(-F.cross_entropy(logits, flat, ignore_index=-1).float().mean()) / torch.tensor(4.0)
        if self.form == "mse_sum":
            return F.mse_loss(logits, F.one_hot(flat.clamp(min=0), 11).float(), reduction="sum")
        if self.form == "vae":   # a summed reconstruction and a summed KL term, as PyTorch's VAE example
            probs = torch.sigmoid(logits)
            kld = -0.5 * torch.sum(1 + logits - logits.pow(2) - logits.exp())
            return F.binary_cross_entropy(probs, F.one_hot(flat.clamp(min=0), 11).float(), reduction="sum") + kld
        if self.form == "penalty":   # a sum of the weights alone would count once per micro-batch
            return F.cross_entropy(logits, flat.clamp(min=0), reduction="sum") + self.head.weight.pow(2).sum()
        if self.form == "drawn":   # targets masked at random in forward: counted with another draw
            keep = torch.rand(flat.shape) < 0.5
            return F.cross_entropy(logits, torch.where(keep, flat, -1), ignore_index=-1)
        if self.form == "masked":   # a masked mean written by hand
            mask = (flat != -1).float()
            per = F.cross_entropy(logits, flat.clamp(min=0), reduction="none")
            return (per * mask).sum() / mask.sum().clamp(min=1.0)
        if self.form == "none":
            return F.cross_entropy(logits, flat, ignore_index=-1, reduction="none").mean()
        if self.form == "weighted":
            return F.cross_entropy(logits, flat, weight=torch.ones(11), ignore_index=-1)
        return F.cross_entropy(logits, flat, ignore_index=-1) + 1e-3 * self.head.weight.pow(2).sum()   # "aux"


def _padded(n=8):
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 11, (n, 6), generator=g)
    ends = torch.randint(1, 7, (n, 1), generator=g)
    return {"idx": idx, "targets": torch.where(torch.arange(6) < ends, torch.roll(idx, -1, 1), -1)}


@pytest.mark.parametrize("form", ["ignore", "sum", "nll", "assigned", "wrapped", "mse_sum", "vae", "masked"])
def test_a_scripts_own_token_loss_is_read_from_its_graph_and_trains_as_the_full_batch(form):
    """A hand-written GPT padding its targets with -1 was weighed by examples (a probe: 2.6e-2 off
    the plain loop at 2x2), and a summed loss came out a quarter of the batch's in micro-batches
    of 2 of 8, with its gradients a quarter too."""
    batch = _padded()
    model = _Tokens(form)
    model(**batch).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_loss = model(**batch).detach().item()
    keyed = keyed_model(model, {k: v[:2] for k, v in batch.items()})
    batch["targets"][1] = -1   # a row of no target: a micro-batch of 1 holds nothing to average
    model.zero_grad()
    model(**batch).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_loss = model(**batch).detach().item()
    assert keyed.varuna_loss_count is not None
    for size in (1, 2, 3):
        model.zero_grad()
        assert train_step(keyed, batch, 0, micro_batch_size=size) == pytest.approx(want_loss, rel=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["none", "weighted", "aux", "penalty", "drawn"])
def test_a_loss_the_graph_does_not_show_as_one_token_mean_stays_weighed_by_examples(form, caplog):
    with caplog.at_level("WARNING", logger="varuna"):
        keyed = keyed_model(_Tokens(form), {k: v[:2] for k, v in _padded().items()})
    assert keyed.varuna_loss_count is None
    # a cross-entropy over tokens inside it is named, with the loss_count= to pass
    assert ("holds a cross-entropy averaged over its targets" in caplog.text) == (form in ("weighted", "aux", "drawn")), \
        caplog.text


def test_a_target_count_read_on_the_meta_device_runs_on_the_batchs():
    """A model built on the meta device (weights=) with its padding made in forward failed at the
    first step: the count ran torch.full(device=meta) on the CPU batch."""
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

        def forward(self, idx):
            t = torch.cat([idx[:, 1:], torch.full((idx.shape[0], 1), -1, device=idx.device)], 1)
            return F.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), t.flatten(), ignore_index=-1)

    with torch.device("meta"):
        model = Padded()
    graph = capture_model(model, {"idx": torch.zeros(2, 5, dtype=torch.long, device="meta")}).graph_module
    counter = counter_for(model, "auto", graph)
    assert int(counter({"idx": torch.ones(3, 5, dtype=torch.long)})) == 12   # 4 targets a row, the 5th padding


def test_hugging_face_models_that_say_no_loss_type_are_read_from_their_graph(caplog):
    """XLNet (labels aligned with the logits) and BertForPreTraining (a token mean plus a
    next-sentence mean) say no loss type: both were counted as a causal LM's shifted labels."""
    import transformers as tf

    xlnet = tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=16, d_model=8, n_layer=1, n_head=2, d_inner=8))
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    micro = {"input_ids": labels.clamp(min=0), "labels": labels}
    assert int(counter_for(xlnet, "auto", capture_model(xlnet, micro).graph_module)(micro)) == 5
    bert = tf.BertForPreTraining(tf.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=8, vocab_size=16))
    micro = {**micro, "next_sentence_label": torch.tensor([0, 1])}
    with caplog.at_level("WARNING", logger="varuna"):
        assert counter_for(bert, "auto", capture_model(bert, micro).graph_module) is None
    assert "holds a cross-entropy averaged over its targets" in caplog.text


def test_a_wrapped_hugging_face_lm_is_counted_from_its_graph_as_its_own_loss_counts():
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.lm = inner

        def forward(self, input_ids, labels):
            return self.lm(input_ids=input_ids, labels=labels).loss

    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    micro = {"input_ids": labels.clamp(min=0), "labels": labels}
    model = Wrapper(_hf("causal"))
    counter = counter_for(model, "auto", capture_model(model, micro).graph_module)
    assert int(counter(micro)) == 4   # shifted by one, as its own loss function counts
