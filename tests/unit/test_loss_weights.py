"""What a micro-batch's loss weighs (trainer.graph.loss_weights); the launched check against a
full-batch loop is the zoo's gpt2_sft in tests/integration/test_model_zoo.py."""

import pytest
import torch
from support import zoo
from torch import nn

from trainer import keyed_model, train_step
from trainer.errors import ConfigError
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
