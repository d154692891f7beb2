"""A job's checkpoint out as the user's own model: trained at P = 2 by real worker processes
(tests/workers/train_export.py, the local launcher, gloo and ZeroMQ), exported, and loaded into a
fresh model of the user's class with load_state_dict(strict=True) (and, for a Hugging Face
model, from_pretrained), where every value is the one the workers held after training.

Two models nobody shaped for the export: a hand-written one with a tied embedding and head, a
BatchNorm, a persistent and a non-persistent buffer, and transformers' GPT2LMHeadModel (head tied
to the token embedding) inside the module a script wraps it in.

The in-process tests of tests/integration/test_export.py (tests/README.md).
"""

from __future__ import annotations

import json

import pytest
from support.workers import load_worker

from trainer.checkpoint.model_record import ModelRecord, record_model

# which of the engine's names holds each tied key of the user's state_dict


W = load_worker("train_export")


def test_the_record_names_the_state_dict_keys_of_tied_and_wrapped_models():
    transformers = pytest.importorskip("transformers")
    model = W.build("gpt2", 96)
    canonical: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(t), name)
    record = record_model(model, canonical)
    assert record.pretrained_prefix == "lm." and record.pretrained_class.endswith("GPT2LMHeadModel")
    assert record.state_dict["lm.lm_head.weight"] == "lm.transformer.wte.weight"
    assert list(record.names_under("lm.")) == list(model.lm.state_dict())
    assert ModelRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert record.config["model_type"] == "gpt2"
    assert isinstance(model.lm, transformers.PreTrainedModel)

    tagger = W.Tagger(96)
    canonical = {}
    for name, t in [*tagger.named_parameters(), *tagger.named_buffers()]:
        canonical.setdefault(id(t), name)
    plain = record_model(tagger, canonical)
    assert plain.pretrained_prefix is None and plain.config is None
    assert "offsets" not in plain.state_dict and plain.state_dict["head.weight"] == "embed.weight"
    with pytest.raises(ValueError, match="pretrained_prefix"):
        ModelRecord(state_dict={}, model_class="m.M", pretrained_prefix="lm", pretrained_class="x.Y")
    with pytest.raises(ValueError, match="not an object"):
        ModelRecord.from_dict(["state_dict"])
