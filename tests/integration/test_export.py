"""A job's checkpoint out as the user's own model: trained at P = 2 by real worker processes
(tests/workers/train_export.py, the local launcher, gloo and ZeroMQ), exported, and loaded into a
fresh model of the user's class with load_state_dict(strict=True) (and, for a Hugging Face
model, from_pretrained), where every value is the one the workers held after training.

Two models nobody shaped for the export: a hand-written one with a tied embedding and head, a
BatchNorm, a persistent and a non-persistent buffer, and transformers' GPT2LMHeadModel (head tied
to the token embedding) inside the module a script wraps it in."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from support import TESTS
from support.store_faults import MountRefused, tmpfs_store
from support.workers import load_worker

from trainer.checkpoint import reading
from trainer.checkpoint.export import CONFIG, INDEX, SINGLE, export_checkpoint
from trainer.errors import CheckpointError
from trainer.launch import launch

WORKER = TESTS / "workers" / "train_export.py"
STEPS, CHECKPOINTS = 4, (2, 4)
# which of the engine's names holds each tied key of the user's state_dict
TIED = {"tagger": {"head.weight": "embed.weight"},
        "gpt2": {"lm.lm_head.weight": "lm.transformer.wte.weight"}}


W = load_worker("train_export")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One P = 2 launch per model, shared: its store and the tensors its workers ended with."""
    root = tmp_path_factory.mktemp("export")
    done: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(kind: str):
        if kind not in done:
            store, out = root / kind / "store", root / kind / "out"
            result = launch(WORKER, ["--model", kind, "--store", str(store), "--out", str(out), "--steps", str(STEPS),
                                     "--checkpoint-at", ",".join(map(str, CHECKPOINTS))],
                            stages=2, replicas=1, threads=1, timeout=240)
            assert result.ok, f"launch failed ({result.reason}):\n" + "\n".join(result.errors)
            held: dict[str, torch.Tensor] = {}
            for f in sorted(out.glob("rank*.pt")):
                held.update(torch.load(f, weights_only=True))
            done[kind] = store, held
        return done[kind]

    return get


def read_export(out: Path) -> dict[str, torch.Tensor]:
    """The exported state_dict, read with safetensors alone as a user elsewhere would."""
    from safetensors.torch import load_file

    if (out / INDEX).exists():
        weight_map = json.loads((out / INDEX).read_text())["weight_map"]
        state = {}
        for shard in sorted(set(weight_map.values())):
            part = load_file(out / shard)
            assert {k for k, v in weight_map.items() if v == shard} == set(part), shard
            state.update(part)
        return state
    return load_file(out / SINGLE)


def check_trained(model: torch.nn.Module, held: dict[str, torch.Tensor], kind: str, prefix: str = "") -> None:
    """Every entry of `model`'s state_dict is bit for bit what the workers held, and training moved it."""
    initial = W.build(kind, 96).state_dict()
    moved = 0
    for key, value in model.state_dict().items():
        name = TIED[kind].get(prefix + key, prefix + key)
        assert torch.equal(value, held[name]), key
        moved += not torch.equal(value, initial[prefix + key])
    assert moved > len(initial) // 2, "the export holds the initial weights, not the trained ones"


@pytest.mark.slow
def test_hand_written_model_loads_the_trained_weights_strictly(trained, tmp_path):
    store, held = trained("tagger")
    done = export_checkpoint(str(store), tmp_path / "out")
    assert done.step == CHECKPOINTS[-1] and not done.pretrained and not done.config and done.missing == ()
    manifest = reading.verify(reading.checkpoint_dir(str(store), done.step))
    # one shard per checkpoint layer file: never more than one layer of the model at a time
    assert len([f for f in done.files if f.endswith(".safetensors")]) == len(set(manifest["meta"]["index"].values()))
    assert done.largest_read < sum(f["size"] for f in manifest["files"])
    state = read_export(tmp_path / "out")
    assert "offsets" not in state and "head.weight" in state and "norm.running_mean" in state
    # never used by forward: as the model began (a plain loop leaves them so), and strict loading works
    assert torch.equal(state["other_task.weight"], W.build("tagger", 96).other_task.weight)
    model = W.Tagger(96)
    model.load_state_dict(state, strict=True)
    check_trained(model, held, "tagger")
    assert model.norm.num_batches_tracked.item() > 0


@pytest.mark.slow
def test_step_picks_an_older_checkpoint_and_only_complete_ones_are_exported(trained, tmp_path):
    store, _ = trained("tagger")
    done = export_checkpoint(str(store), tmp_path / "two", step=CHECKPOINTS[0])
    state = read_export(tmp_path / "two")
    saved = reading.read_tensors(reading.checkpoint_dir(str(store), CHECKPOINTS[0]), "layer_000.pt")["params"]
    assert done.step == CHECKPOINTS[0] and torch.equal(state["embed.weight"], saved["embed.weight"])
    assert torch.equal(state["head.weight"], saved["embed.weight"])
    newest = read_export_of(store, tmp_path / "four")
    assert not torch.equal(state["embed.weight"], newest["embed.weight"])

    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    (broken / f"varuna_ckpt_{CHECKPOINTS[-1]}" / reading.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete: no manifest"):
        export_checkpoint(str(broken), tmp_path / "x", step=CHECKPOINTS[-1])
    assert export_checkpoint(str(broken), tmp_path / "y").step == CHECKPOINTS[0]   # the newest complete one
    with pytest.raises(CheckpointError, match=r"no checkpoint 3 .* it has \[2, 4\]"):
        export_checkpoint(str(broken), tmp_path / "z", step=3)
    layer = broken / f"varuna_ckpt_{CHECKPOINTS[0]}" / "layer_001.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt: layer_001.pt sha256 .* differs from the manifest"):
        export_checkpoint(str(broken), tmp_path / "w", step=CHECKPOINTS[0])
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*\(2 there, none complete"):
        export_checkpoint(str(broken), tmp_path / "w")
    assert not (tmp_path / "w").exists()
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_checkpoint(str(store), tmp_path / "two")


@pytest.mark.slow
def test_an_export_onto_a_full_disk_says_so_and_leaves_nothing_behind(trained, tmp_path):
    """A disk too small for the export: safetensors' own error was a traceback, the half-written
    shard stayed, and the next try was refused for the directory not being empty."""
    store, _ = trained("tagger")
    first = reading.read_tensors(reading.checkpoint_dir(str(store), CHECKPOINTS[-1]), "layer_000.pt")["params"]
    room = sum(t.numel() * t.element_size() for t in first.values()) // 2   # less than the first shard
    disk = tmp_path / "small"
    try:
        mounted = tmpfs_store(disk, size=f"{max(room, 4096)}")
        mounted.__enter__()
    except MountRefused as exc:
        pytest.skip(str(exc))
    try:
        out = disk / "out"
        with pytest.raises(CheckpointError, match=r"writing the export into .*out failed: No space left on device; "
                                                  r"what it had written was removed") as caught:
            export_checkpoint(str(store), out)
        assert "MiB there; free some, or export elsewhere" in caught.value.hint
        assert list(disk.iterdir()) == []   # neither a partial shard nor the directory it made
        done = export_checkpoint(str(store), tmp_path / "roomy")   # elsewhere it goes through
        assert torch.equal(read_export(Path(done.out))["embed.weight"], first["embed.weight"])
    finally:
        mounted.__exit__(None, None, None)


def read_export_of(store: Path, out: Path) -> dict[str, torch.Tensor]:
    export_checkpoint(str(store), out)
    return read_export(out)


@pytest.mark.slow
def test_a_checkpoint_without_the_names_is_refused_with_what_to_do(trained, tmp_path):
    store, _ = trained("tagger")
    old = tmp_path / "old"
    shutil.copytree(store, old)
    path = old / f"varuna_ckpt_{CHECKPOINTS[-1]}" / reading.MANIFEST
    doc = json.loads(path.read_text())
    del doc["meta"]["model"]   # as a release before export wrote it
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="does not record the model's parameter names") as err:
        export_checkpoint(str(old), tmp_path / "out")
    assert "export the next checkpoint" in err.value.hint


@pytest.mark.slow
def test_a_transformers_model_is_ready_for_from_pretrained(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    store, held = trained("gpt2")
    done = export_checkpoint(str(store), tmp_path / "hf")
    assert done.module == "lm." and done.pretrained and done.config and done.model_class.endswith("GPT2LMHeadModel")
    config = json.loads((tmp_path / "hf" / CONFIG).read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 3
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight   # tied again
    check_trained(loaded, held, "gpt2", prefix="lm.")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(auto) is transformers.GPT2LMHeadModel
    fresh = transformers.GPT2LMHeadModel(W.gpt2_config(96))
    fresh.load_state_dict(read_export(tmp_path / "hf"), strict=True)
    check_trained(fresh, held, "gpt2", prefix="lm.")
    # the script's own module, wrapper included
    whole = export_checkpoint(str(store), tmp_path / "whole", module="")
    assert not whole.pretrained and not whole.config and whole.module == ""
    wrapper = W.build("gpt2", 96)
    wrapper.load_state_dict(read_export(tmp_path / "whole"), strict=True)
    check_trained(wrapper, held, "gpt2")
    with pytest.raises(CheckpointError, match="no parameters or buffers under 'decoder'"):
        export_checkpoint(str(store), tmp_path / "none", module="decoder")


@pytest.mark.slow
def test_varunactl_export_finds_the_store_of_a_job_in_etcd(trained, tmp_path, etcd, etcd_root):
    from varunad.control.jobs import JobSpec, JobState
    from varunad.ctl import cli
    from varunad.store.etcd import EtcdStore
    from varunad.store.keys import Keys

    store, held = trained("tagger")
    keys = Keys(etcd_root)

    async def put(job: str, **state) -> None:
        spec = JobSpec(job=job, script="t.py", batch_size=8, steps=STEPS, checkpoint_every=2,
                       bundle_digest="0" * 64, bundle_bytes=1)
        async with EtcdStore(etcd.endpoint) as client:
            await client.put(keys.job(job), spec.encode())
            if state:
                await client.put(keys.state(job), JobState(job=job, **state).encode())

    asyncio.run(put("ran", state="done", store=str(store)))
    asyncio.run(put("queued"))
    asyncio.run(put("broken", state="failed", reason="the calibration run of broken on vm1 failed: ImportError"))

    def ctl(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = cli.main(["--etcd", etcd.endpoint, "--root", etcd_root, *argv])
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = ctl("export", "ran", "--step", "2", "--out", str(tmp_path / "a"))
    assert rc == 0, err
    assert f"exported  checkpoint 2 of {store}" in out and "load_state_dict(state, strict=True)" in out
    model = W.Tagger(96)
    model.load_state_dict(read_export(tmp_path / "a"), strict=True)
    saved = reading.read_tensors(reading.checkpoint_dir(str(store), 2), "layer_003.pt")
    assert torch.equal(model.norm.running_var, saved["buffers"]["norm.running_var"])

    rc, out, err = ctl("export", "queued", "--out", str(tmp_path / "b"))
    assert rc == 1 and "pass --store DIR" in err and not (tmp_path / "b").exists()
    # a job that failed before its first plan has nothing to export, whatever --store says
    rc, out, err = ctl("export", "broken", "--out", str(tmp_path / "b"))
    assert rc == 1 and "is failed and never trained a step" in err and "ImportError" in err, err
    rc, out, err = ctl("export", "nosuch", "--out", str(tmp_path / "b"))
    assert rc == 1 and "no job named nosuch" in err
    # with --store, etcd is not asked (nothing answers at port 9)
    rc, out, _ = ctl("--etcd", "127.0.0.1:9", "export", "--store", str(store), "--json", "--out", str(tmp_path / "c"))
    assert rc == 0 and json.loads(out)["step"] == CHECKPOINTS[-1]
    model.load_state_dict(read_export(tmp_path / "c"), strict=True)
    check_trained(model, held, "tagger")


