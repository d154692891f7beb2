"""varunad.control.resume: the leader reads, from the store's manifests, where a new epoch resumes
and, for a fallback to the store, which stages had no live replica on which VMs. Manifests here
are written by the real checkpoint store (the workers' code), read by the torch-free control plane.
"""

from __future__ import annotations

import os

import pytest

from trainer.checkpoint import reading
from trainer.checkpoint import store as ckpt_store
from trainer.errors import CheckpointError
from trainer.planning.parallel import ParallelPlan
from varunad.control.plans import PlanDoc, PlanSlot
from varunad.control.resume import resume_source


def _plan() -> PlanDoc:
    """2 x 2: stage 0 on vm1 and vm3, stage 1 on vm2 and vm4."""
    slots = [PlanSlot(rank=r, member=f"vm{r + 1}", slot=0, endpoint=f"tcp://10.0.0.{r + 1}:6000") for r in range(4)]
    return PlanDoc(kind="run", reason="t", job="j", plan=ParallelPlan(P=2, D=2, micro_batch_size=2, cuts=(3,)),
                   slots=tuple(slots), dist_url="tcp://10.0.0.1:29500")


def _commit(store: str, step: int, **meta) -> None:
    d = reading.checkpoint_dir(store, step)
    entry = ckpt_store.write_tensors(d, "layer_000.pt", {"params": {}})
    ckpt_store.write_manifest(d, [entry], {"P": 2, "D": 2, **meta}, iteration=step)


def test_the_survivors_checkpoint_is_named_replicas(tmp_path):
    store = str(tmp_path)
    _commit(store, 20)
    _commit(store, 27, source="replicas")
    found = resume_source(store, _plan(), ["vm4"])
    assert (found.source, found.step, found.why) == ("replicas", 27, "")
    assert found.words == "from replicas at step 27"


def test_a_fallback_names_the_stage_that_lost_every_replica(tmp_path):
    store = str(tmp_path)
    _commit(store, 20)
    os.makedirs(reading.checkpoint_dir(store, 27))   # a rescue that stayed incomplete: no manifest
    found = resume_source(store, _plan(), ["vm2", "vm4"])
    assert (found.source, found.step) == ("checkpoint", 20)
    assert found.why == "stage 1 had no live replica (vm2, vm4)"
    assert found.words == "from checkpoint 20 (stage 1 had no live replica (vm2, vm4))"
    # one replica of each stage lost: no stage is orphaned, so the reason is that the survivors
    # did not save one step between them; nothing lost (a notice), no reason at all
    assert resume_source(store, _plan(), ["vm1", "vm4"]).why == "the survivors held no common step newer than it"
    assert resume_source(store, _plan(), []).why == ""


def test_no_checkpoint_yet_is_from_scratch_and_an_object_store_is_not_read(tmp_path):
    found = resume_source(str(tmp_path), _plan(), ["vm2", "vm4"])
    assert (found.source, found.step) == ("scratch", 0) and "stage 1" in found.why
    assert resume_source("s3://bucket/job", _plan(), ["vm2"]).source == ""
    # a damaged manifest is skipped, as the workers skip it
    _commit(str(tmp_path), 5)
    _commit(str(tmp_path), 9, source="replicas")
    with open(os.path.join(reading.checkpoint_dir(str(tmp_path), 9), "manifest.json"), "w") as f:
        f.write("{not json")
    assert resume_source(str(tmp_path), _plan(), []).step == 5


def test_a_checkpoint_whose_file_is_truncated_or_missing_is_not_named_as_the_source(tmp_path):
    """A probe halved a layer file of checkpoint 8 by hand: the workers skipped it and resumed
    from 4, while the morph's record said checkpoint 8 and status showed the step go back."""
    store = str(tmp_path)
    for step in (4, 8, 12):
        _commit(store, step)
    layer = os.path.join(reading.checkpoint_dir(store, 12), "layer_000.pt")
    os.remove(layer)
    layer = os.path.join(reading.checkpoint_dir(store, 8), "layer_000.pt")
    with open(layer, "r+b") as f:
        f.truncate(os.path.getsize(layer) // 2)
    found = resume_source(store, _plan(), [])
    assert (found.source, found.step) == ("checkpoint", 4)
    # the workers' own reading agrees on each of the three
    reading.verify(reading.checkpoint_dir(store, 4), checksums=False)
    for step in (8, 12):
        with pytest.raises(CheckpointError):
            reading.verify(reading.checkpoint_dir(store, step), checksums=False)


def test_a_checkpoint_carries_the_losses_before_it_and_the_epoch_that_trained_them(tmp_path):
    """A probe killed the daemon holding rank 0 right after checkpoint 20: the losses of steps
    17-19 were in its memory only, and the next epoch resumed past them."""
    import collections
    from types import SimpleNamespace

    from trainer.checkpoint.contents import LOSSES, manifest_meta

    worker = SimpleNamespace(plan=ParallelPlan(P=1, D=1), cuts=[], layout=SimpleNamespace(files={}),
                             assignment=SimpleNamespace(epoch=7), iteration=3,
                             recent_losses=collections.deque([(1, 0.5), (2, 0.25)]))
    meta = manifest_meta(worker)
    assert meta[LOSSES] == {"epoch": 7, "steps": [[1, 0.5], [2, 0.25]]}
    assert LOSSES not in manifest_meta(SimpleNamespace(**{**vars(worker), "assignment": SimpleNamespace(epoch=0)}))
    store = str(tmp_path)
    _commit(store, 3, losses=meta[LOSSES])
    found = resume_source(store, _plan(), ["vm1"])
    assert (found.step, found.losses, found.losses_epoch) == (3, ((1, 0.5), (2, 0.25)), 7)
    _commit(store, 5, losses={"epoch": 7, "steps": [[1.5, 0.5], [9, 1.0], ["x", 1]]})   # not a worker's: none
    assert resume_source(store, _plan(), ["vm1"]).losses == ()


def test_a_diverged_steps_nan_loss_goes_into_the_checkpoint_and_comes_back(tmp_path):
    """A job whose loss went NaN (its steps skipped by agreement) failed its every checkpoint: the
    manifest is strict JSON, and the NaN among the recent losses made its write raise TypeError."""
    import collections
    import math
    from types import SimpleNamespace

    from trainer.checkpoint.contents import LOSSES, manifest_meta

    worker = SimpleNamespace(plan=ParallelPlan(P=1, D=1), cuts=[], layout=SimpleNamespace(files={}),
                             assignment=SimpleNamespace(epoch=7), iteration=4,
                             recent_losses=collections.deque([(1, 0.5), (2, math.nan), (3, math.inf)]))
    store = str(tmp_path)
    _commit(store, 4, losses=manifest_meta(worker)[LOSSES])
    (one, a), (two, b), (three, c) = resume_source(store, _plan(), ["vm1"]).losses
    assert (one, a, two, three) == (1, 0.5, 2, 3) and math.isnan(b) and math.isnan(c)


def test_a_failed_jobs_hint_promises_its_checkpoints_only_where_the_store_holds_one(tmp_path):
    """A probe's jobs that failed before any checkpoint were told "with --store ... it resumes from
    this one's checkpoints"; their stores held none."""
    from varunad.node.leader import _resume_hint

    store = str(tmp_path)
    assert _resume_hint(store) == " (its store holds no complete checkpoint: a new job starts from scratch)"
    _commit(store, 4)
    assert _resume_hint(store) == f" (with --store {store} it resumes from this one's checkpoints (newest: step 4))"
    assert _resume_hint("s3://bucket/j") == " (with --store s3://bucket/j it resumes from this one's checkpoints)"
    assert _resume_hint(None) == ""
    # a storage probe's job given a GPT's store failed to load it, and was told to use that store again
    error = "CheckpointError: checkpoint 4 has no ['conv.weight'] (it was written by a different model)"
    assert _resume_hint(store, error) == (f" (its store {store} holds another model's checkpoints: give the job a "
                                          "--store of its own)")
