"""Which buffers a captured graph writes, and the evaluation copy of a stage's graph
(trainer.graph.written, trainer.graph.evaluation). The launched check against an eager loop is
test_batchnorm_statistics_and_evaluation_match_the_plain_loop in tests/integration/test_correctness.py."""

import torch
from support.batchnorm_net import BatchNormNet, batch
from torch import nn

from trainer.graph.capture import capture_model
from trainer.graph.evaluation import evaluation_module
from trainer.graph.written import BufferSnapshot, written_buffers


def _captured():
    model = BatchNormNet().train()
    return model, capture_model(model, batch(0)).graph_module


def test_the_running_statistics_the_count_and_a_buffer_added_to_are_written():
    _, gm = _captured()
    names = set(written_buffers(gm))
    for i in range(3):
        assert {f"blocks.{i}.1.running_mean", f"blocks.{i}.1.running_var",
                f"blocks.{i}.1.num_batches_tracked"} <= names
    assert "seen" in names
    assert not any("weight" in n or "bias" in n for n in names)   # parameters are read, not written
    assert written_buffers(nn.Linear(2, 2)) == ()                  # no graph: nothing known


def test_the_evaluation_copy_computes_what_model_eval_does_and_writes_nothing():
    model, gm = _captured()
    for _ in range(2):   # running statistics away from their initial values
        gm(**batch(1))
    before = {n: t.clone() for n, t in gm.named_buffers()}
    with torch.no_grad():
        got = evaluation_module(gm)(**batch(2))
        for name, value in gm.named_buffers():
            torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
        model.load_state_dict(dict(gm.named_buffers()), strict=False)
        want = model.eval()(**batch(2))
        train_mode = gm(**batch(2))
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, train_mode)   # the batch's own statistics give another loss
    assert evaluation_module(nn.Linear(2, 2)).__class__ is nn.Linear   # no graph: run as it is


def test_a_snapshot_runs_with_copies_and_leaves_the_module_tensors_untouched():
    _, gm = _captured()
    names = written_buffers(gm)
    snap = BufferSnapshot(gm, names)
    own = {n: t for n, t in gm.named_buffers() if n in names}
    versions = {n: t._version for n, t in own.items()}
    with snap.in_place_of_current():
        gm(**batch(1))
        assert all(dict(gm.named_buffers())[n] is not own[n] for n in names)
    assert all(dict(gm.named_buffers())[n] is own[n] and own[n]._version == versions[n] for n in names)
    gm(**batch(1))
    snap.restore()
    for n in names:
        torch.testing.assert_close(own[n], snap._saved[names.index(n)])


def test_the_capture_says_batchnorm_makes_the_model_depend_on_the_micro_batch_size(caplog):
    with caplog.at_level("WARNING", logger="varuna"):
        _captured()
    said = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("capture: 3 BatchNorm layer(s)") and "--chunk-size" in said[0], said
