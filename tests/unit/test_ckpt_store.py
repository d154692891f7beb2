"""trainer.checkpoint.store, reading, fences, storage: atomic files, manifests as commit records, finding, pruning, copying."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
import tempfile
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.checkpoint import fences, reading, storage
from trainer.checkpoint import store as cs
from trainer.checkpoint.reading import MANIFEST, FileEntry, checkpoint_dir, list_checkpoints, read_tensors, verify
from trainer.checkpoint.store import copy_to_store, latest_complete, prune, write_manifest, write_tensors
from trainer.errors import CheckpointError


def _save(store, it, files=None, *, manifest=True, epoch=None):
    """A checkpoint with a few small files (written in plan `epoch`); returns its directory."""
    d = checkpoint_dir(str(store), it)
    files = files or {
        "layer_000.pt": {"w": torch.full((4,), float(it))},
        "layer_001.pt": {"step": it},
    }
    entries = [write_tensors(d, name, obj) for name, obj in files.items()]
    if manifest:
        write_manifest(d, entries, {"P": 2, "D": 1, "step": it}, epoch=epoch)
    return d


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------- writing and reading


def test_round_trip_dtypes_scalars_and_nested(tmp_path):
    d = checkpoint_dir(str(tmp_path), 7)
    tensors = {
        str(dt): (torch.arange(6) % 3).to(dt).reshape(2, 3)
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                   torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64)
    }
    obj = {
        "tensors": tensors,
        "lr": 3e-4, "step": 12, "fp16": True, "name": "adam", "none": None, "raw": b"\x00\xff",
        "nested": {
            "betas": [0.9, 0.999],
            "rng": (torch.get_rng_state(), 5),
            3: {"deep": [1, {"x": "y"}]},
        },
        "dtype": torch.bfloat16,
    }
    entry = write_tensors(d, "layer_003.pt", obj)
    path = os.path.join(d, "layer_003.pt")
    assert entry == FileEntry("layer_003.pt", os.path.getsize(path), _sha(path))
    back = read_tensors(d, "layer_003.pt")
    for k, t in tensors.items():
        assert back["tensors"][k].dtype == t.dtype and torch.equal(back["tensors"][k], t)
    plain = {k: v for k, v in obj.items() if k not in ("tensors", "nested")}
    assert {k: v for k, v in back.items() if k not in ("tensors", "nested")} == plain
    nested = back["nested"]
    assert nested["betas"] == [0.9, 0.999] and nested[3] == {"deep": [1, {"x": "y"}]}
    assert torch.equal(nested["rng"][0], obj["nested"]["rng"][0]) and nested["rng"][1] == 5
    assert sorted(os.listdir(d)) == ["layer_003.pt"]  # no temporaries left behind


_plain_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=12,
)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _plain_values, max_size=4))
def test_plain_values_round_trip(obj):
    with tempfile.TemporaryDirectory() as tmp:
        write_tensors(tmp, "x.pt", obj)
        assert read_tensors(tmp, "x.pt") == obj


def test_a_view_is_saved_without_its_whole_storage(tmp_path):
    flat = torch.zeros(1_000_000)
    entry = write_tensors(str(tmp_path), "slice.pt", {"w": flat[10:20]})
    assert entry.size < 10_000  # not the 4 MB buffer
    assert torch.equal(read_tensors(str(tmp_path), "slice.pt")["w"], torch.zeros(10))


@pytest.mark.parametrize("bad", [{"a": np.zeros(2)}, {"a": {1.5: 2}}, {"a": [object()]}])
def test_write_refuses_what_weights_only_could_not_load(tmp_path, bad):
    with pytest.raises(TypeError, match=r"layer\.pt\['a'\]"):
        write_tensors(str(tmp_path), "layer.pt", bad)
    assert not os.path.exists(tmp_path / "layer.pt")


@pytest.mark.parametrize("name", ["../x.pt", "a/b.pt", ".hidden", MANIFEST, ""])
def test_write_refuses_names_outside_the_directory_or_reserved(tmp_path, name):
    with pytest.raises(ValueError, match="checkpoint file name"):
        write_tensors(str(tmp_path / "c"), name, {"a": 1})


def test_failed_atomic_write_leaves_nothing(tmp_path):
    target = str(tmp_path / "f.bin")
    with pytest.raises(RuntimeError):
        with storage.LocalStorage().open_atomic(target) as f:
            f.write(b"half")
            raise RuntimeError("writer died")
    assert os.listdir(tmp_path) == []


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_read_refuses_pickled_python_objects(tmp_path):
    marker = str(tmp_path / "pwned")
    torch.save({"x": _Evil(marker)}, str(tmp_path / "evil.pt"))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        read_tensors(str(tmp_path), "evil.pt")
    assert not os.path.exists(marker)


def test_read_reports_missing_and_garbage_files(tmp_path):
    d = _save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="missing nope.pt"):
        read_tensors(d, "nope.pt")
    with open(os.path.join(d, "junk.pt"), "wb") as f:
        f.write(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="corrupt: junk.pt is not a torch zip file"):
        read_tensors(d, "junk.pt")


# ---------------------------------------------------------------- manifest and verify


def test_manifest_lists_every_file_and_meta(tmp_path):
    d = _save(tmp_path, 20)
    doc = verify(d)
    assert doc["format"] == 1 and doc["iteration"] == 20 and doc["complete"] is True
    assert doc["meta"] == {"P": 2, "D": 1, "step": 20}
    assert [f["name"] for f in doc["files"]] == ["layer_000.pt", "layer_001.pt"]
    assert all(f["sha256"] == _sha(os.path.join(d, f["name"])) for f in doc["files"])


def test_a_commit_removes_the_temporary_of_a_writer_that_died_mid_file_and_not_a_live_ones(tmp_path):
    """A live writer's temporary stays: two replicas saving one stage from memory write the same
    file, and the commit that the other's copy completed deleted the one still being written (a
    probe: its rename failed with "check that the store is mounted" on a healthy store)."""
    d = checkpoint_dir(str(tmp_path), 6)
    entries = [write_tensors(d, "layer_000.pt", {"w": torch.ones(3)})]
    dead = os.path.join(d, ".layer_001.pt.4242.0123abcd.tmp")   # as LocalStorage.open_atomic names one
    with open(dead, "wb") as f:
        f.write(b"half a file")
    long_ago = time.time() - 600
    os.utime(dead, (long_ago, long_ago))
    (tmp_path / "varuna_ckpt_6" / "notes.txt").write_text("the user's")   # not ours: stays

    data = (tmp_path / "varuna_ckpt_6" / "layer_000.pt").read_bytes()
    with storage.LocalStorage().open_atomic(os.path.join(d, "layer_000.pt")) as f:   # the other replica's copy, mid-file
        f.write(data[:10])
        write_manifest(d, entries, {})
        f.write(data[10:])
    assert sorted(os.listdir(d)) == sorted([MANIFEST, "layer_000.pt", "notes.txt"])
    verify(d)
    assert not os.path.exists(dead)


def test_missing_manifest_is_incomplete_and_points_at_an_older_one(tmp_path):
    _save(tmp_path, 30)
    d = _save(tmp_path, 40, manifest=False)
    with pytest.raises(CheckpointError, match="incomplete: no manifest") as ei:
        verify(d)
    assert "checkpoint 40" in str(ei.value) and ", 30)" in str(ei.value)


def test_unparsable_manifest_is_incomplete(tmp_path):
    d = _save(tmp_path, 5)
    with open(os.path.join(d, MANIFEST), "w") as f:
        f.write('{"format": 1, "files": [')
    with pytest.raises(CheckpointError, match="incomplete: its manifest is not valid JSON"):
        verify(d)


def test_truncated_file_is_named(tmp_path):
    d = _save(tmp_path, 5)
    path = os.path.join(d, "layer_001.pt")
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match=r"corrupt: layer_001\.pt is \d+ bytes.*truncated"):
        verify(d, checksums=False)


def test_no_complete_checkpoint_says_what_is_wrong_with_the_newest(tmp_path):
    from trainer.checkpoint.contents import _why_none

    assert _why_none(str(tmp_path), True) == ""   # an empty store: nothing to explain
    d = _save(tmp_path, 5)
    os.truncate(os.path.join(d, "layer_001.pt"), 3)
    why = _why_none(str(tmp_path), True)
    assert why.startswith(" (1 there, none complete; the newest, 5: ") and "layer_001.pt is 3 bytes" in why


def test_flipped_byte_fails_the_checksum(tmp_path):
    d = _save(tmp_path, 5)
    path = os.path.join(d, "layer_000.pt")
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    verify(d, checksums=False)  # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match=r"corrupt: layer_000\.pt sha256"):
        verify(d)


def test_listed_file_missing(tmp_path):
    d = _save(tmp_path, 5)
    os.unlink(os.path.join(d, "layer_000.pt"))
    with pytest.raises(CheckpointError, match="layer_000.pt is in the manifest but missing"):
        verify(d)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        verify(checkpoint_dir(str(tmp_path), 9))


@pytest.mark.parametrize("name", ["../../etc/passwd", "/abs", ".hidden"])
def test_manifest_name_escaping_the_directory(tmp_path, name):
    d = _save(tmp_path, 5)
    with open(os.path.join(d, MANIFEST)) as f:
        doc = json.load(f)
    doc["files"][0]["name"] = name
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump(doc, f)
    with pytest.raises(CheckpointError, match="corrupt: manifest file name"):
        verify(d)


def test_manifest_for_another_iteration_is_refused(tmp_path):
    d = _save(tmp_path, 5)
    os.rename(d, checkpoint_dir(str(tmp_path), 6))
    with pytest.raises(CheckpointError, match="says iteration 5"):
        verify(checkpoint_dir(str(tmp_path), 6))


def test_unlisted_temp_file_is_ignored(tmp_path):
    d = _save(tmp_path, 5)
    with open(os.path.join(d, ".layer_002.pt.1234.abcd.tmp"), "wb") as f:
        f.write(b"half-written by a dead writer")
    assert verify(d)["iteration"] == 5
    assert latest_complete(str(tmp_path)) == 5


def test_write_manifest_refuses_missing_or_conflicting_entries(tmp_path):
    d = checkpoint_dir(str(tmp_path), 1)
    e = write_tensors(d, "a.pt", {"x": 1})
    with pytest.raises(CheckpointError, match="b.pt is missing"):
        write_manifest(d, [e, FileEntry("b.pt", 10, "0" * 64)], {})
    with pytest.raises(CheckpointError, match="two writers reported a.pt"):
        write_manifest(d, [e, FileEntry("a.pt", e.size, "1" * 64)], {})
    write_manifest(d, [e, e], {})  # the same report twice is harmless
    assert [f["name"] for f in verify(d)["files"]] == ["a.pt"]


# ---------------------------------------------------------------- finding, pruning, copying


def test_list_checkpoints_ignores_other_names(tmp_path):
    for it in (10, 2, 30):
        _save(tmp_path, it, manifest=it != 30)
    os.mkdir(tmp_path / "varuna_ckpt_007")
    os.mkdir(tmp_path / "varuna_ckpt_x")
    (tmp_path / "varuna_ckpt_5").write_text("a file, not a checkpoint")
    assert list_checkpoints(str(tmp_path)) == [2, 10, 30]
    assert list_checkpoints(str(tmp_path / "nowhere")) == []


def test_latest_complete_skips_newer_broken_ones(tmp_path, caplog):
    _save(tmp_path, 10)
    _save(tmp_path, 20, manifest=False)  # writer died
    d = _save(tmp_path, 30)
    with open(os.path.join(d, "layer_000.pt"), "r+b") as f:
        f.seek(64)
        f.write(b"\xde\xad")
    assert latest_complete(str(tmp_path)) == 10
    assert "skipping checkpoint 30" in caplog.text and "skipping checkpoint 20" in caplog.text
    assert latest_complete(str(tmp_path), verify_checksums=False) == 30
    assert latest_complete(str(tmp_path / "empty")) is None


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for it in (10, 20, 30, 40):
        _save(tmp_path, it)
    _save(tmp_path, 25, manifest=False)  # dead, older than the newest complete
    _save(tmp_path, 50, manifest=False)  # maybe still being written
    assert prune(str(tmp_path), keep=2) == [10, 20, 25]
    assert list_checkpoints(str(tmp_path)) == [30, 40, 50]
    assert prune(str(tmp_path), keep=2) == []
    with pytest.raises(ValueError, match="keep must be"):
        prune(str(tmp_path), keep=0)


def test_prune_never_deletes_the_newest_complete(tmp_path):
    _save(tmp_path, 10)
    d = _save(tmp_path, 20)
    os.truncate(os.path.join(d, "layer_000.pt"), 5)  # 20 has a manifest but is corrupt
    assert prune(str(tmp_path), keep=1) == []  # 10 is what a resume would load
    assert latest_complete(str(tmp_path)) == 10
    _save(tmp_path, 30)
    assert prune(str(tmp_path), keep=1) == [10, 20]
    assert list_checkpoints(str(tmp_path)) == [30]


def test_prune_with_nothing_complete_deletes_nothing(tmp_path):
    _save(tmp_path, 10, manifest=False)
    assert prune(str(tmp_path), keep=1) == []
    assert list_checkpoints(str(tmp_path)) == [10]


def test_copy_to_store_then_verify(tmp_path):
    local = str(tmp_path / "local" / "ckpt")
    entries = [
        write_tensors(local, "a.pt", {"x": torch.ones(3)}),
        write_tensors(local, "b.pt", {"y": 2}),
    ]
    write_manifest(local, entries, {"P": 1}, iteration=60)
    store = str(tmp_path / "store")
    dest = copy_to_store(local, store, 60)
    assert dest == checkpoint_dir(store, 60)
    assert verify(dest)["meta"] == {"P": 1} and latest_complete(store) == 60
    assert torch.equal(read_tensors(dest, "a.pt")["x"], torch.ones(3))
    assert copy_to_store(local, store, 60) == dest  # a retry after success is a no-op
    with pytest.raises(ValueError, match="holds checkpoint 60"):
        copy_to_store(local, store, 61)


def test_copy_of_a_corrupt_local_checkpoint_never_commits(tmp_path):
    local = _save(tmp_path / "local", 70)
    with open(os.path.join(local, "layer_001.pt"), "r+b") as f:
        f.seek(40)
        f.write(b"\x00\x01\x02")
    store = str(tmp_path / "store")
    with pytest.raises(CheckpointError, match="layer_001.pt does not match"):
        copy_to_store(local, store, 70)
    dest = checkpoint_dir(store, 70)
    assert not os.path.exists(os.path.join(dest, MANIFEST))
    assert not os.path.exists(os.path.join(dest, "layer_001.pt"))
    assert latest_complete(store) is None


class _MemStorage:
    """An object store in a dict: keys are paths, 'directories' are prefixes."""

    def __init__(self):
        self.blobs: dict[str, bytes] = {}

    def makedirs(self, path):
        pass

    @contextlib.contextmanager
    def open_atomic(self, path):
        buf = io.BytesIO()
        yield buf
        self.blobs[path] = buf.getvalue()

    def sync_dir(self, path):
        pass

    def open_read(self, path):
        if path not in self.blobs:
            raise FileNotFoundError(path)
        return io.BytesIO(self.blobs[path])

    def size(self, path):
        if path not in self.blobs:
            raise FileNotFoundError(path)
        return len(self.blobs[path])

    def listdir(self, path):
        names = {k[len(path) + 1:].split("/")[0] for k in self.blobs if k.startswith(path + "/")}
        if not names:
            raise FileNotFoundError(path)
        return sorted(names)

    def isdir(self, path):
        return any(k.startswith(path + "/") for k in self.blobs)

    def exists(self, path):
        return path in self.blobs or self.isdir(path)

    def remove(self, path):
        del self.blobs[path]

    def rmtree(self, path):
        for k in [k for k in self.blobs if k.startswith(path + "/")]:
            del self.blobs[k]


def test_a_registered_object_store_serves_every_operation(tmp_path, monkeypatch):
    mem = _MemStorage()
    monkeypatch.setitem(storage._BACKENDS, "mem", mem)
    store = "mem://bucket/job"
    _save(store, 1)
    local = _save(tmp_path, 2)
    copy_to_store(local, store, 2)
    assert list_checkpoints(store) == [1, 2] and latest_complete(store) == 2
    assert read_tensors(checkpoint_dir(store, 2), "layer_001.pt") == {"step": 2}
    assert prune(store, keep=1) == [1]
    assert all(k.startswith("mem://bucket/job/varuna_ckpt_2/") for k in mem.blobs)
    assert not any(posixpath.basename(k).startswith(".") for k in mem.blobs)
    with pytest.raises(CheckpointError, match="register_storage"):
        list_checkpoints("s4://nobody/registered/this")


class _FailingDeletes(_MemStorage):
    def rmtree(self, path):
        raise PermissionError(path)


def test_a_half_pruned_checkpoint_reads_as_incomplete(monkeypatch):
    mem = _FailingDeletes()
    monkeypatch.setitem(storage._BACKENDS, "mem", mem)
    store = "mem://bucket/job"
    for it in (1, 2):
        _save(store, it)
    with pytest.raises(CheckpointError, match="could not delete checkpoint 1"):
        prune(store, keep=1)
    # The manifest went first, so the remains can never be mistaken for a complete checkpoint.
    with pytest.raises(CheckpointError, match="incomplete: no manifest"):
        verify(checkpoint_dir(store, 1))
    assert latest_complete(store) == 2


# --- staged checkpoints: the writers' records and the background commit ------------------------------

def _staged(tmp_path, rank: int, it: int = 7) -> tuple[str, list]:
    stage = reading.checkpoint_dir(str(tmp_path / "staging" / f"rank{rank}"), it)
    return stage, [cs.write_tensors(stage, f"layer_{rank:03d}.pt", {"w": torch.full((4,), float(rank))})]


def test_staged_upload_commits_once_every_writer_has_its_files_in(tmp_path):
    from trainer.checkpoint.contents import Upload
    store = str(tmp_path / "store")
    final = reading.checkpoint_dir(store, 7)
    stage0, files0 = _staged(tmp_path, 0)
    stage1, files1 = _staged(tmp_path, 1)
    cs.write_writer_record(final, "ab" * 8, 1, [])   # an earlier run's record: not counted
    meta = {"P": 2, "D": 1}
    up0 = Upload(stage0, final, files0, iteration=7, token="cd" * 8, rank=0, world=2, meta=meta, timeout_s=60)
    assert not up0.wait(0.5)   # rank 0 copied its file, and waits for rank 1's
    assert not os.path.exists(posixpath.join(final, reading.MANIFEST)) and cs.latest_complete(store) is None
    up1 = Upload(stage1, final, files1, iteration=7, token="cd" * 8, rank=1, world=2, meta=None)
    assert up1.wait(30) and up0.wait(30) and up0.error is None and up1.error is None
    assert cs.latest_complete(store) == 7
    assert [f["name"] for f in reading.verify(final)["files"]] == ["layer_000.pt", "layer_001.pt"]
    assert not os.path.exists(stage0) and not os.path.exists(stage1)   # local copies removed


def test_staged_upload_without_all_writers_stays_incomplete(tmp_path):
    from trainer.checkpoint.contents import Upload
    store = str(tmp_path / "store")
    stage0, files0 = _staged(tmp_path, 0)
    up = Upload(stage0, reading.checkpoint_dir(store, 7), files0, iteration=7, token="ef" * 8, rank=0, world=2,
                meta={}, timeout_s=0.3)
    assert up.wait(30)
    assert isinstance(up.error, CheckpointError) and "ranks [1] did not finish" in str(up.error)
    assert cs.latest_complete(store) is None
    with pytest.raises(CheckpointError, match="no manifest"):
        reading.verify(reading.checkpoint_dir(store, 7))


def test_writer_records_refuse_a_token_that_could_escape(tmp_path):
    with pytest.raises(ValueError, match="hex"):
        cs.write_writer_record(str(tmp_path / "c"), "../x", 0, [])


# --- epoch fences: an old incarnation's late checkpoint -------------------------------------------

def test_a_checkpoint_an_older_epoch_commits_past_a_newer_epochs_start_is_never_loaded(tmp_path):
    store = str(tmp_path)
    _save(store, 10, epoch=5)
    # Epoch 5's VM was cut off; epoch 7 starts on the others from checkpoint 10 and fences the
    # store. Meanwhile the cut-off incarnation had committed checkpoint 12 (staged, late).
    _save(store, 12, epoch=5)
    fences.write_epoch_fence(store, 7, 10)
    assert latest_complete(store) == 10
    with pytest.raises(CheckpointError, match="superseded: written under plan epoch 5, after epoch 7 had started "
                                              "from checkpoint 10"):
        verify(checkpoint_dir(store, 12))
    # what it tries to commit from now on is refused
    with pytest.raises(CheckpointError, match="not writing checkpoint 14"):
        _save(store, 14, epoch=5)
    assert not os.path.exists(os.path.join(checkpoint_dir(store, 14), MANIFEST))
    # epoch 7's own checkpoints stand, and epoch 5's up to the one epoch 7 resumed from
    _save(store, 11, epoch=7)
    assert latest_complete(store) == 11
    assert verify(checkpoint_dir(store, 10))["epoch"] == 5
    # a later epoch that started from scratch fences every older epoch's checkpoint
    fences.write_epoch_fence(store, 9, None)
    assert latest_complete(store) is None
    # checkpoints written without an epoch (the local launcher) are never fenced
    _save(store, 30)
    assert latest_complete(store) == 30


def test_a_staged_upload_of_a_superseded_epoch_copies_nothing(tmp_path):
    from trainer.checkpoint.contents import Upload
    store = str(tmp_path / "store")
    fences.write_epoch_fence(store, 8, 3)
    stage0, files0 = _staged(tmp_path, 0)
    up = Upload(stage0, reading.checkpoint_dir(store, 7), files0, iteration=7, token="ab" * 8, rank=0, world=1,
                meta={}, epoch=6)
    assert up.wait(30)
    assert isinstance(up.error, CheckpointError) and "superseded" in str(up.error)
    assert list_checkpoints(store) == []
    # the same upload in the epoch that fenced the store commits
    stage0, files0 = _staged(tmp_path, 0)
    up = Upload(stage0, reading.checkpoint_dir(store, 7), files0, iteration=7, token="ab" * 8, rank=0, world=1,
                meta={}, epoch=8)
    assert up.wait(30) and up.error is None
    assert cs.latest_complete(store) == 7 and reading.verify(reading.checkpoint_dir(store, 7))["epoch"] == 8


def test_a_malformed_epoch_fence_or_manifest_epoch_is_named(tmp_path, caplog):
    store = str(tmp_path)
    os.makedirs(os.path.join(store, fences.EPOCHS))
    with open(os.path.join(store, fences.EPOCHS, "9.json"), "w") as f:
        f.write("{not json")
    d = _save(store, 4, epoch=3)
    assert fences.read_epoch_fences(store) == {} and "ignoring epoch fence" in caplog.text
    assert latest_complete(store) == 4
    doc = json.loads(open(os.path.join(d, MANIFEST)).read())
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump({**doc, "epoch": "3"}, f)
    with pytest.raises(CheckpointError, match="manifest epoch '3'"):
        verify(d)
    with pytest.raises(ValueError, match="plan epoch"):
        fences.write_epoch_fence(store, -1, None)
