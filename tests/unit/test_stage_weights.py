"""Reading a stage's weights into a model built on the meta device (trainer.engine.weights), in
one process: only the stage's tensors are read, under whichever name the files hold a tied one,
non-persistent buffers are recomputed, and what cannot be done says what to change.
The launched runs that train from such weights are in tests/integration/test_meta_weights.py."""

import sys

import pytest
import torch
from support import TESTS
from torch import nn

from trainer.engine import setup
from trainer.engine.weights import WeightsFile, load_stage, tensor_names
from trainer.errors import ConfigError
from trainer.graph.partition import capture_model, dry_run, slice_stages

sys.path.insert(0, str(TESTS / "workers"))
from meta_models import build, data  # noqa: E402

save_file = pytest.importorskip("safetensors.torch").save_file


def _stage(model, stage: int, stages: int = 2):
    traced = capture_model(model, {"input_ids": data(4).to("meta")})
    cuts = [len(traced.markers) // 2] if stages == 2 else []
    mine = slice_stages(traced, cuts)[stage]
    return mine, setup.named_tensors(model, traced.canonical, mine)


def test_a_stage_reads_only_its_tensors_and_a_tied_head_under_the_embedding_name(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = build("gpt2")
    saved.lm.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.device("meta"):
        model = build("gpt2")
    mine, named = _stage(model, 1)
    source = WeightsFile(tmp_path)
    assert "lm_head.weight" not in source.keys()   # written once, as the embedding
    loaded = load_stage(model, named, source, torch.device("cpu"), holders=(mine.module,))
    expected = {n[len("lm."):] for n in named}
    expected = {"transformer.wte.weight" if n == "lm_head.weight" else n for n in expected}
    assert sorted(source.read_keys) == sorted(expected)
    reference = dict(saved.named_parameters())
    for name, t in loaded.items():
        assert not t.is_meta and torch.equal(t, reference[name]), name
    # the stage's graph computes with the loaded tensors, not with the meta ones
    held = {id(t) for t in [*mine.module.parameters(), *mine.module.buffers()]}
    assert {id(t) for t in loaded.values()} <= held
    assert not any(t.is_meta for t in mine.module.parameters())


def test_non_persistent_buffers_are_recomputed(tmp_path):
    torch.manual_seed(0)
    saved = build("mixer")
    path = tmp_path / "mixer.safetensors"
    save_file(saved.state_dict(), str(path))
    with torch.device("meta"):
        model = build("mixer")
    named = setup.all_tensors(model)
    loaded = load_stage(model, named, path, torch.device("cpu"))
    assert torch.equal(loaded["average.mask"], saved.average.mask)   # rebuilt from CausalMask(seq_len)
    assert model.average.mask is loaded["average.mask"]


def test_transformers_rotary_frequencies_are_recomputed(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = build("llama")
    saved.lm.save_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = build("llama")
    loaded = load_stage(model, setup.all_tensors(model), tmp_path, torch.device("cpu"))
    for name, buf in saved.named_buffers():
        assert torch.equal(loaded[name], buf), name


def test_tensor_names_give_every_name_of_a_tied_tensor():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = build("gpt2")
    names = tensor_names(model)
    assert names["lm.transformer.wte.weight"] == ("lm.transformer.wte.weight", "lm.lm_head.weight")
    assert "lm.lm_head.weight" not in names


class _Unkept(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.register_buffer("ramp", torch.arange(n, dtype=torch.float32), persistent=False)


def test_what_cannot_be_loaded_says_what_to_change(tmp_path):
    with torch.device("meta"):
        model = build("mixer")
    with pytest.raises(ConfigError, match="no weights") as exc:
        load_stage(model, setup.all_tensors(model), None, torch.device("cpu"))
    assert "weights=" in exc.value.hint
    with pytest.raises(ConfigError, match="do not exist"):
        load_stage(model, setup.all_tensors(model), tmp_path / "nothing.safetensors", torch.device("cpu"))
    with pytest.raises(ConfigError, match="neither model.safetensors"):
        load_stage(model, setup.all_tensors(model), tmp_path, torch.device("cpu"))
    partial = {k: v for k, v in build("mixer").state_dict().items() if k != "head.weight"}
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ConfigError, match="head.weight"):
        load_stage(model, setup.all_tensors(model), tmp_path / "partial.safetensors", torch.device("cpu"))
    with torch.device("meta"):
        unkept = _Unkept(3)
    save_file({"w": torch.ones(3)}, str(tmp_path / "unkept.safetensors"))
    with pytest.raises(ConfigError, match="'ramp'.*does not keep") as exc:
        load_stage(unkept, setup.all_tensors(unkept), tmp_path / "unkept.safetensors", torch.device("cpu"))
    assert "persistent=True" in exc.value.hint


def test_a_meta_model_is_cut_by_its_segments_work():
    with torch.device("meta"):
        model = build("mixer")
    traced = capture_model(model, {"input_ids": data(4).to("meta")})
    costs = dry_run(traced, {"input_ids": data(4)})
    assert len(costs) == len(traced.markers) + 1 and all(c > 0 for c in costs)
    # the last segment holds the vocabulary head: more work than a block
    assert costs[-1] > costs[1]


class _AutocastRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cpu", enabled=False):   # a subgraph of its own in the capture
            pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        return (self.lin(x) + pos).pow(2).mean()


def test_a_graph_captured_on_meta_runs_on_the_stage_device_subgraphs_too():
    from torch import fx

    from trainer.graph.placement import retarget_graph

    def meta_devices(gm):
        return [mod for mod in gm.modules() if isinstance(mod, fx.GraphModule) for n in mod.graph.nodes
                for v in [*n.args, *n.kwargs.values()] if isinstance(v, torch.device) and v.type == "meta"]

    with torch.device("meta"):
        model = _AutocastRegion()
    gm = capture_model(model, {"x": torch.randn(4, 4, device="meta")}).graph_module
    assert any(mod is not gm for mod in meta_devices(gm))
    assert retarget_graph(gm, torch.device("meta"), torch.device("cpu")) > 0
    assert meta_devices(gm) == []


def test_a_model_built_on_the_cpu_gets_its_values_from_the_weights_in_place(tmp_path):
    torch.manual_seed(1)
    saved = build("mixer")
    save_file(saved.state_dict(), str(tmp_path / "w.safetensors"))
    torch.manual_seed(2)
    model = build("mixer")
    named = setup.all_tensors(model)
    loaded = load_stage(model, named, tmp_path / "w.safetensors", torch.device("cpu"))
    assert all(loaded[n] is t for n, t in named.items())   # the same tensors, new values
    for name, t in saved.state_dict().items():
        assert torch.equal(loaded[name], t), name
    # a buffer built on the CPU keeps its value when the files do not hold it: nothing to recompute
    unkept = _Unkept(3)
    save_file({"w": torch.full((3,), 2.0)}, str(tmp_path / "unkept.safetensors"))
    loaded = load_stage(unkept, setup.all_tensors(unkept), tmp_path / "unkept.safetensors", torch.device("cpu"))
    assert torch.equal(loaded["ramp"], torch.arange(3.0)) and torch.equal(loaded["w"], torch.full((3,), 2.0))
