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


def test_a_hugging_face_model_inside_the_scripts_module_is_named_when_its_tokens_are_not_counted(caplog):
    """Wrapped, a causal LM's token mean was weighed by examples without a word (probe: Llama in
    a user's module, weights 0.5 off between micro-batches of 2 and 4)."""
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.lm = inner

    with caplog.at_level("WARNING", logger="varuna"):
        assert counter_for(Wrapper(_hf("causal")), "auto") is None
    assert "Wrapper wraps the Hugging Face GPT2LMHeadModel (as 'lm')" in caplog.text
    assert "loss_count=lambda m: (m['labels'][:, 1:] != -100).sum()" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="varuna"):
        counter_for(Wrapper(_hf("classes")), "auto")   # a loss over examples: nothing to say
        counter_for(Wrapper(_hf("causal")), None)      # the script chose examples
        counter_for(nn.Linear(2, 2), "auto")
    assert caplog.text == ""


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


@pytest.mark.parametrize("form", ["ignore", "sum", "nll"])
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
    assert keyed.varuna_loss_count is not None
    for size in (1, 2, 3):
        model.zero_grad()
        assert train_step(keyed, batch, 0, micro_batch_size=size) == pytest.approx(want_loss, rel=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["none", "weighted", "aux"])
def test_a_loss_the_graph_does_not_show_as_one_token_mean_stays_weighed_by_examples(form):
    keyed = keyed_model(_Tokens(form), {k: v[:2] for k, v in _padded().items()})
    assert keyed.varuna_loss_count is None


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
