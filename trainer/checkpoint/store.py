"""How checkpoints are written, committed, copied and pruned (not what goes into them).

A checkpoint is a directory ``varuna_ckpt_<iteration>`` under a ``global_store`` that every VM can
reach. Several workers write different files into it concurrently (each stage's replica 0 writes
its layers, see [Note: state per layer] in ARCHITECTURE.md); then rank 0 writes ``manifest.json`` last, listing every
file with its size and sha256. The manifest is the commit record:

    no manifest            the run that wrote it died (or is still writing): never loaded
    manifest, files match  complete
    manifest, mismatch     corrupt: never loaded

Every file appears under its final name all at once (temporary name, fsync, rename), so a
reader sees either nothing or a whole file. Hidden names (starting with ".") are reserved for
those temporaries and are never listed in a manifest.

Plan epochs fence checkpoints. A worker started by the daemon writes the plan epoch it runs
under into each manifest it commits, and rank 0 of a new epoch, once it has chosen the
checkpoint it resumes from, writes ``epochs/<epoch>.json`` saying so (`write_epoch_fence`).
From then on a checkpoint an *older* epoch commits past that one is an old incarnation's late
write (a worker cut off from the fleet, a staged upload still in flight): it is refused when
committed and, if it lands anyway, never loaded or counted as the newest (`superseded`).
Checkpoints written without an epoch (the local launcher) are never fenced.

The store is four modules, one job each: this one writes (files, the manifest, writers' records),
copies and prunes; trainer.checkpoint.reading names, lists, verifies and reads; trainer.checkpoint.fences
keeps the epoch fences; trainer.checkpoint.storage is the `CheckpointStorage` protocol over string
paths (plain paths use the local or mounted filesystem; ``register_storage("s3", ...)`` plugs in
another backend for paths like ``s3://bucket/job``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import posixpath
import re
from typing import Any

import torch

from trainer.checkpoint.fences import check_epoch, refuse_superseded
from trainer.checkpoint.reading import (
    CKPT_PREFIX,
    FORMAT,
    MANIFEST,
    FileEntry,
    broken,
    check_name,
    checkpoint_dir,
    iteration_of,
    list_checkpoints,
    read_manifest,
    verify,
)
from trainer.checkpoint.storage import (
    CHUNK,
    CheckpointStorage,
    HashingWriter,
    is_outage,
    names_in,
    storage_for,
    write_error,
)
from trainer.errors import CheckpointError

__all__ = ["write_tensors", "write_manifest", "latest_complete", "prune", "copy_to_store", "copy_file",
           "write_writer_record", "read_writer_records"]

log = logging.getLogger("varuna.checkpoint")


def _plain(obj: Any, where: str) -> Any:
    """A copy of ``obj`` holding only what ``torch.load(weights_only=True)`` accepts.

    Refusing other types here, at write time, is what lets every reader load with
    weights_only: a checkpoint that saved fine can always be loaded safely.
    """
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"{where}: tensor subclass {type(obj).__name__} cannot be checkpointed; "
                "save a plain tensor"
            )
        t = obj.detach()
        # torch.save writes a view's whole storage: a slice of a flat buffer would drag the
        # entire buffer into every layer's file.
        if t.layout == torch.strided and t.device.type != "meta":
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()
        return t
    if obj is None or type(obj) in (bool, int, float, str, bytes) or isinstance(obj, torch.dtype):
        return obj
    if type(obj) is torch.Size:
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; use str or int keys")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    raise TypeError(
        f"{where}: {type(obj).__module__}.{type(obj).__qualname__} cannot be checkpointed; "
        "convert it to tensors or plain Python values (int, float, str, bytes, list, tuple, dict)"
    )


# --------------------------------------------------------------------------------------------
# Writing


def write_tensors(ckpt_dir: str, name: str, obj: dict) -> FileEntry:
    """Save ``obj`` (a dict of tensors and plain Python values) as ``ckpt_dir/name``.

    Safe to call from several processes at once for different names; creates ``ckpt_dir``.
    Returns the entry that rank 0 later passes to `write_manifest`.
    """
    check_name(name)
    if type(obj) not in (dict, collections.OrderedDict):
        raise TypeError(f"write_tensors saves a dict, got {type(obj).__name__}")
    payload = _plain(obj, name)
    storage = storage_for(ckpt_dir)
    path = posixpath.join(ckpt_dir, name)
    w: HashingWriter | None = None
    try:
        storage.makedirs(ckpt_dir)
        with storage.open_atomic(path) as f:
            w = HashingWriter(f)
            torch.save(payload, w)
    except OSError as exc:
        raise write_error(path, exc) from exc
    except RuntimeError as exc:
        if w is None or w.failed is None:
            raise
        raise write_error(path, w.failed) from exc
    entry = FileEntry(name=name, size=w.size, sha256=w.sha.hexdigest())
    log.debug("wrote %s (%d bytes, sha256 %s)", path, entry.size, entry.sha256[:12])
    return entry


def _entry_json(e: FileEntry) -> dict:
    return {"name": e.name, "size": e.size, "sha256": e.sha256}


def _write_manifest_doc(storage: CheckpointStorage, ckpt_dir: str, doc: dict) -> None:
    path = posixpath.join(ckpt_dir, MANIFEST)
    data = (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
    try:
        # Files first, then the manifest: make the files' renames durable before the manifest
        # can be, so a crash never leaves a manifest naming files that vanished.
        storage.sync_dir(ckpt_dir)
        with storage.open_atomic(path) as f:
            f.write(data)
        storage.sync_dir(ckpt_dir)
    except OSError as exc:
        raise write_error(path, exc) from exc


# `LocalStorage.open_atomic`'s temporaries: ".<name>.<pid>.<8 hex>.tmp"
_TEMPORARY = re.compile(r"\..+\.\d+\.[0-9a-f]{8}\.tmp")


# A temporary nobody wrote for this long belongs to a writer that died mid-file.
_DEAD_WRITER_S = 120.0


def _sweep_temporaries(storage: CheckpointStorage, ckpt_dir: str) -> None:
    """Remove the temporaries of writers that died mid-file (a worker killed while it saved), so
    that a committed checkpoint holds only what its manifest lists. Only those idle for
    `_DEAD_WRITER_S`: a live writer may still hold one, as a replica saving the same stage from
    memory does when the other replica's files completed the checkpoint first (its rename then
    failed, "check that the store is mounted", on a healthy store). Kept where the storage cannot
    say how long a file was idle."""
    idle = getattr(storage, "idle_s", None)
    try:
        names = storage.listdir(ckpt_dir) if idle is not None else []
    except OSError:
        return
    for name in names:
        if _TEMPORARY.fullmatch(name):
            path = posixpath.join(ckpt_dir, name)
            with contextlib.suppress(OSError):
                if idle(path) >= _DEAD_WRITER_S:
                    storage.remove(path)
                    log.info("removed %s from %s: a writer died before it finished that file", name, ckpt_dir)


def write_manifest(
    ckpt_dir: str, entries: list[FileEntry], meta: dict, *, iteration: int | None = None,
    epoch: int | None = None,
) -> None:
    """Commit the checkpoint: list every file (as reported by all writers) and ``meta``.

    Call once, from one process, after every writer has returned its entries. ``iteration``
    defaults to the one in the directory name (``varuna_ckpt_<iteration>``). ``epoch``: the plan
    epoch it was written under; refused (CheckpointError) when a newer epoch has started from
    an older checkpoint (`superseded`).
    """
    parsed = iteration_of(ckpt_dir)
    if iteration is None:
        if parsed is None:
            raise ValueError(f"{ckpt_dir} is not named {CKPT_PREFIX}<iteration>; pass iteration=")
        iteration = parsed
    elif parsed is not None and parsed != iteration:
        raise ValueError(f"iteration={iteration} but the directory is {ckpt_dir}")
    by_name: dict[str, FileEntry] = {}
    for e in entries:
        if not isinstance(e, FileEntry):
            raise TypeError(f"write_manifest takes FileEntry values from write_tensors, got {e!r}")
        check_name(e.name)
        if e.name in by_name and by_name[e.name] != e:
            raise CheckpointError(
                f"two writers reported {e.name} in {ckpt_dir} with different contents",
                hint="exactly one worker (the stage's replica 0) must write each file",
            )
        by_name[e.name] = e
    storage = storage_for(ckpt_dir)
    # A stat per file is cheap and catches a manifest that would name a file that isn't there,
    # now, rather than at the next resume.
    for e in by_name.values():
        path = posixpath.join(ckpt_dir, e.name)
        try:
            actual = storage.size(path)
        except FileNotFoundError:
            actual = None
        except OSError as exc:
            raise write_error(path, exc) from exc
        if actual != e.size:
            found = "is missing" if actual is None else f"is {actual} bytes, not {e.size}"
            raise CheckpointError(
                f"cannot commit checkpoint {iteration}: {path} {found}",
                hint="a writer failed or another run writes the same checkpoint; write it again",
            )
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"checkpoint meta must be plain JSON (numbers, strings, lists, dicts): {exc}"
        ) from exc
    doc = {
        "format": FORMAT,
        "iteration": iteration,
        "files": [_entry_json(by_name[n]) for n in sorted(by_name)],
        "meta": meta,
        "complete": True,
    }
    if epoch is not None:
        check_epoch(epoch)
        doc["epoch"] = epoch
    refuse_superseded(posixpath.dirname(ckpt_dir.rstrip("/")), epoch, iteration)
    _sweep_temporaries(storage, ckpt_dir)
    _write_manifest_doc(storage, ckpt_dir, doc)
    log.info("committed checkpoint %d in %s (%d files)", iteration, ckpt_dir, len(by_name))


# --------------------------------------------------------------------------------------------
# Finding the newest, pruning, copying


def latest_complete(store: str, *, verify_checksums: bool = True) -> int | None:
    """The newest iteration in ``store`` whose checkpoint verifies; None when there is none.

    Broken ones are logged and skipped. With checksums this re-reads the checkpoints it tries.
    """
    for it in reversed(list_checkpoints(store)):
        try:
            verify(checkpoint_dir(store, it), checksums=verify_checksums)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %d: %s", it, exc)
            continue
        return it
    return None


def _delete(storage: CheckpointStorage, ckpt_dir: str) -> None:
    # Manifest first: if we die halfway the remains read as incomplete, never as complete.
    with contextlib.suppress(FileNotFoundError):
        storage.remove(posixpath.join(ckpt_dir, MANIFEST))
    storage.rmtree(ckpt_dir)


def prune(store: str, keep: int, *, verify_checksums: bool = True) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints; return the iterations removed.

    Incomplete (or corrupt) checkpoints older than the newest complete one are deleted too;
    newer ones are left alone, since another process may still be writing them. "Complete"
    means `verify` passes, so the checkpoints kept are the ones a resume would load. Only the
    checkpoints walked through until ``keep`` complete ones are found get verified.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(
            f"prune keeps the newest complete checkpoint: keep must be an int >= 1, got {keep!r}"
        )
    storage = storage_for(store)
    kept: list[int] = []
    doomed: list[int] = []
    for it in reversed(list_checkpoints(store)):
        if len(kept) >= keep:
            doomed.append(it)
            continue
        try:
            verify(checkpoint_dir(store, it), checksums=verify_checksums)
        except CheckpointError as exc:
            if kept:  # older than the newest complete: dead
                log.info("pruning broken checkpoint %d: %s", it, exc)
                doomed.append(it)
            continue
        kept.append(it)
    removed = []
    for it in sorted(doomed):
        try:
            _delete(storage, checkpoint_dir(store, it))
        except FileNotFoundError:
            pass  # pruned concurrently by someone else: the goal is reached anyway
        except OSError as exc:
            if is_outage(exc):
                raise write_error(checkpoint_dir(store, it), exc) from exc
            raise CheckpointError(
                f"could not delete checkpoint {it} in {store}: {exc}",
                hint="check permissions on the store; nothing newer was touched",
            ) from exc
        removed.append(it)
    if removed:
        log.info("pruned checkpoints %s from %s; kept %s", removed, store, sorted(kept))
    return removed


def copy_to_store(local_dir: str, store: str, iteration: int) -> str:
    """Copy a complete checkpoint from ``local_dir`` into ``store``; return its store path.

    Files are copied first, each checked against the local manifest while it streams (a
    corrupt local file is caught without a second read); the manifest goes last, so a reader
    of the store never sees a manifest before its files.
    """
    src = storage_for(local_dir)
    doc = read_manifest(src, local_dir)
    if doc["iteration"] != iteration:
        raise ValueError(f"{local_dir} holds checkpoint {doc['iteration']}, not {iteration}")
    dst = storage_for(store)
    dest = checkpoint_dir(store, iteration)
    refuse_superseded(store, doc.get("epoch"), iteration)
    if dst.exists(posixpath.join(dest, MANIFEST)):
        existing = read_manifest(dst, dest)
        if existing["files"] == doc["files"]:
            log.info("checkpoint %d is already in %s; not copying it again", iteration, store)
            return dest
        raise CheckpointError(
            f"checkpoint {iteration} already exists in {store} with different files",
            hint=f"delete {dest} first if it is stale, or save under another iteration",
        )
    try:
        for f in doc["files"]:
            copy_file(local_dir, dest, FileEntry(f["name"], f["size"], f["sha256"]))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"could not copy checkpoint {iteration} from {local_dir}: {exc.filename} is missing",
            hint="write the checkpoint again locally before copying it",
        ) from None
    _write_manifest_doc(dst, dest, {**doc, "iteration": iteration})
    log.info("copied checkpoint %d from %s to %s (%d files)",
             iteration, local_dir, dest, len(doc["files"]))
    return dest


def copy_file(src_dir: str, dst_dir: str, entry: FileEntry) -> None:
    """Copy one checkpoint file, checked against `entry` while it streams (no second read); it
    appears at the destination whole or not at all. Raises FileNotFoundError for a missing
    source, CheckpointError for a corrupt one or a failed write."""
    src, dst = storage_for(src_dir), storage_for(dst_dir)
    dst_path = posixpath.join(dst_dir, entry.name)
    try:
        dst.makedirs(dst_dir)
        with src.open_read(posixpath.join(src_dir, entry.name)) as r, dst.open_atomic(dst_path) as w:
            hw = HashingWriter(w)
            while chunk := r.read(CHUNK):
                hw.write(chunk)
            if hw.size != entry.size or hw.sha.hexdigest() != entry.sha256:
                # Raising inside the atomic write keeps the bad copy out of the store.
                raise broken(src_dir, f"corrupt: {entry.name} does not match what was written")
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise write_error(dst_path, exc) from exc


# --------------------------------------------------------------------------------------------
# Writers' records: how rank 0 learns, without a collective, that a staged checkpoint's files
# are all in place (see checkpointing.save with a tmpdir)

WRITERS = "writers"


def _writer_record_path(ckpt_dir: str, token: str, rank: int) -> str:
    return posixpath.join(ckpt_dir, WRITERS, f"{token}-rank{rank}.json")


def write_writer_record(ckpt_dir: str, token: str, rank: int, entries: list[FileEntry]) -> None:
    """Say that worker `rank` of the writing run `token` has put all its files in place."""
    if not re.fullmatch(r"[0-9a-f]{8,64}", token):
        raise ValueError(f"writer token must be hex, got {token!r}")
    storage = storage_for(ckpt_dir)
    path = _writer_record_path(ckpt_dir, token, rank)
    try:
        storage.makedirs(posixpath.dirname(path))
        with storage.open_atomic(path) as f:
            f.write(json.dumps({"rank": rank, "files": [_entry_json(e) for e in entries]}).encode())
    except OSError as exc:
        raise write_error(path, exc) from exc


def read_writer_records(ckpt_dir: str, token: str) -> dict[int, list[FileEntry]]:
    """The records of run `token` found so far (a record of another run is never counted)."""
    storage = storage_for(ckpt_dir)
    base = posixpath.join(ckpt_dir, WRITERS)
    found: dict[int, list[FileEntry]] = {}
    for name in names_in(storage, base):
        m = re.fullmatch(rf"{re.escape(token)}-rank(\d+)\.json", name)
        if not m:
            continue
        with storage.open_read(posixpath.join(base, name)) as f:
            doc = json.loads(f.read())
        found[int(m.group(1))] = [FileEntry(e["name"], int(e["size"]), e["sha256"]) for e in doc["files"]]
    return found
