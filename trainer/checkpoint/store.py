"""How checkpoints are written, verified, found and pruned (not what goes into them).

A checkpoint is a directory ``varuna_ckpt_<iteration>`` under a ``global_store`` that every VM can
reach. Several workers write different files into it concurrently (each stage's replica 0 writes
its layers, see idea 2 of DESIGN.md); then rank 0 writes ``manifest.json`` last, listing every
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

Storage sits behind `CheckpointStorage`, a small protocol over string paths. Plain paths use the
local (or mounted shared) filesystem; ``register_storage("s3", ...)`` plugs in another backend for
paths like ``s3://bucket/job``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import posixpath
import re
import shutil
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import torch

from trainer.errors import CheckpointError

__all__ = [
    "CKPT_PREFIX",
    "MANIFEST",
    "FORMAT",
    "FileEntry",
    "CheckpointStorage",
    "LocalStorage",
    "register_storage",
    "checkpoint_dir",
    "write_tensors",
    "write_manifest",
    "verify",
    "read_tensors",
    "list_checkpoints",
    "latest_complete",
    "prune",
    "copy_to_store",
    "copy_file",
    "write_writer_record",
    "read_writer_records",
    "write_epoch_fence",
    "read_epoch_fences",
    "superseded",
    "refuse_superseded",
]

CKPT_PREFIX = "varuna_ckpt_"
MANIFEST = "manifest.json"
FORMAT = 1

log = logging.getLogger("varuna.checkpoint")

# Canonical decimal only, so that checkpoint_dir(store, n) and this pattern agree one to one.
_DIR_RE = re.compile(rf"^{re.escape(CKPT_PREFIX)}(0|[1-9][0-9]*)$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 4 << 20
_MOUNT_HINT = "check that the store is mounted and reachable from this VM"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as its writer saw it: name inside the directory, bytes, sha256."""

    name: str
    size: int
    sha256: str


# --------------------------------------------------------------------------------------------
# Storage


class CheckpointStorage(Protocol):
    """Where checkpoint files live, addressed by '/'-separated string paths.

    Contract, which everything above relies on:

    Atomic writes
        ``open_atomic(path)`` yields a binary writer; the content appears under ``path`` all at
        once when the block exits normally and never appears if it raises (local: temporary
        name, fsync, rename; object store: one PUT or a completed multipart upload).
        ``sync_dir(path)`` makes the writes already committed under ``path`` durable (a no-op
        where commits are durable by themselves).
    Reads
        ``open_read`` returns a seekable binary file; ``size``, ``open_read`` and ``listdir``
        raise FileNotFoundError for a missing path, OSError for anything else.
    Namespace
        ``makedirs`` is idempotent and safe to race; ``isdir``/``exists`` never raise for a
        missing path; ``remove`` deletes one file, ``rmtree`` a directory and all under it.
    """

    def makedirs(self, path: str) -> None: ...
    def open_atomic(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def sync_dir(self, path: str) -> None: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def size(self, path: str) -> int: ...
    def listdir(self, path: str) -> list[str]: ...
    def isdir(self, path: str) -> bool: ...
    def exists(self, path: str) -> bool: ...
    def remove(self, path: str) -> None: ...
    def rmtree(self, path: str) -> None: ...


class LocalStorage:
    """A local directory or a shared POSIX mount (NFS, Lustre, a FUSE bucket)."""

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[BinaryIO]:
        # Unique per writer so concurrent writers never share a temporary; hidden so that
        # listings and manifests never mistake it for a checkpoint file.
        head, tail = os.path.split(path)
        tmp = os.path.join(head, f".{tail}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "xb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as exc:
            # Some network filesystems refuse fsync on a directory; their renames are
            # synchronous on the server anyway.
            if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
                raise
        finally:
            os.close(fd)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path)


_LOCAL = LocalStorage()
_BACKENDS: dict[str, CheckpointStorage] = {}


def register_storage(scheme: str, storage: CheckpointStorage) -> None:
    """Serve paths ``<scheme>://...`` from ``storage`` (e.g. an object store client)."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) or scheme == "file":
        raise ValueError(f"bad storage scheme {scheme!r}: use lowercase letters like 's3'")
    _BACKENDS[scheme] = storage


def _storage_for(path: str) -> CheckpointStorage:
    scheme, sep, _ = path.partition("://")
    if not sep:
        return _LOCAL
    if scheme in _BACKENDS:
        return _BACKENDS[scheme]
    raise CheckpointError(
        f"no checkpoint storage for {scheme}:// paths ({path})",
        hint=f"call trainer.checkpoint.store.register_storage({scheme!r}, ...) first, "
        "or use a mounted path",
    )


# --------------------------------------------------------------------------------------------
# Names and small helpers


def checkpoint_dir(store: str, iteration: int) -> str:
    """The directory of checkpoint ``iteration`` under ``store``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be an int >= 0, got {iteration!r}")
    return posixpath.join(store, f"{CKPT_PREFIX}{iteration}")


def _iteration_of(ckpt_dir: str) -> int | None:
    m = _DIR_RE.match(posixpath.basename(ckpt_dir.rstrip("/")))
    return int(m.group(1)) if m else None


def _name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a file of a checkpoint, or None. Names are flat on purpose: a
    single path component cannot escape the directory, on a filesystem or in a bucket."""
    if not isinstance(name, str) or not name:
        return "is empty or not a string"
    if "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        return "is not a plain file name (it would escape the checkpoint directory)"
    if name.startswith("."):
        return "starts with '.', which is reserved for temporary files"
    if name == MANIFEST:
        return "is reserved for the manifest"
    return None


def _check_name(name: str) -> None:
    problem = _name_problem(name)
    if problem:
        raise ValueError(f"checkpoint file name {name!r} {problem}; use a name like 'layer_003.pt'")


class _HashingWriter:
    """Forwards writes to ``f`` while hashing them, so checksums cost no second read."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        self._f.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


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


def _write_error(path: str, exc: OSError) -> CheckpointError:
    return CheckpointError(
        f"could not write {path}: {exc}",
        hint="check that the store is mounted, writable and has free space",
    )


# --------------------------------------------------------------------------------------------
# Writing


def write_tensors(ckpt_dir: str, name: str, obj: dict) -> FileEntry:
    """Save ``obj`` (a dict of tensors and plain Python values) as ``ckpt_dir/name``.

    Safe to call from several processes at once for different names; creates ``ckpt_dir``.
    Returns the entry that rank 0 later passes to `write_manifest`.
    """
    _check_name(name)
    if type(obj) not in (dict, collections.OrderedDict):
        raise TypeError(f"write_tensors saves a dict, got {type(obj).__name__}")
    payload = _plain(obj, name)
    storage = _storage_for(ckpt_dir)
    path = posixpath.join(ckpt_dir, name)
    try:
        storage.makedirs(ckpt_dir)
        with storage.open_atomic(path) as f:
            w = _HashingWriter(f)
            torch.save(payload, w)
    except OSError as exc:
        raise _write_error(path, exc) from exc
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
        raise _write_error(path, exc) from exc


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
    parsed = _iteration_of(ckpt_dir)
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
        _check_name(e.name)
        if e.name in by_name and by_name[e.name] != e:
            raise CheckpointError(
                f"two writers reported {e.name} in {ckpt_dir} with different contents",
                hint="exactly one worker (the stage's replica 0) must write each file",
            )
        by_name[e.name] = e
    storage = _storage_for(ckpt_dir)
    # A stat per file is cheap and catches a manifest that would name a file that isn't there,
    # now, rather than at the next resume.
    for e in by_name.values():
        path = posixpath.join(ckpt_dir, e.name)
        try:
            actual = storage.size(path)
        except FileNotFoundError:
            actual = None
        except OSError as exc:
            raise _write_error(path, exc) from exc
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
        _check_epoch(epoch)
        doc["epoch"] = epoch
    refuse_superseded(posixpath.dirname(ckpt_dir.rstrip("/")), epoch, iteration)
    _write_manifest_doc(storage, ckpt_dir, doc)
    log.info("committed checkpoint %d in %s (%d files)", iteration, ckpt_dir, len(by_name))


# --------------------------------------------------------------------------------------------
# Reading and verifying


def _resume_hint(ckpt_dir: str) -> str:
    """Point at the newest older checkpoint that at least has a manifest (cheap to find)."""
    it = _iteration_of(ckpt_dir)
    if it is None:
        return "write the checkpoint again"
    store = posixpath.dirname(ckpt_dir.rstrip("/"))
    try:
        storage = _storage_for(ckpt_dir)
        older = [i for i in list_checkpoints(store) if i < it]
        with_manifest = [
            i for i in older if storage.exists(posixpath.join(checkpoint_dir(store, i), MANIFEST))
        ]
    except (CheckpointError, OSError):  # a hint must never hide the real error
        with_manifest = None
    if with_manifest:
        i = with_manifest[-1]
        return (
            f"resume from an older one, e.g. load_checkpoint({store!r}, {i}); "
            f"latest_complete({store!r}) finds the newest that verifies"
        )
    if with_manifest is None:
        return f"resume from an older one; latest_complete({store!r}) finds one that verifies"
    return f"no older checkpoint in {store} has a manifest; start the run from scratch"


def _broken(ckpt_dir: str, what: str) -> CheckpointError:
    it = _iteration_of(ckpt_dir)
    store = posixpath.dirname(ckpt_dir.rstrip("/"))
    label = f"checkpoint {it} in {store}" if it is not None else f"checkpoint {ckpt_dir}"
    return CheckpointError(f"{label} is {what}", hint=_resume_hint(ckpt_dir))


def _read_manifest(storage: CheckpointStorage, ckpt_dir: str) -> dict:
    """Parse and check the manifest's shape; raise CheckpointError saying what is wrong."""
    if not storage.isdir(ckpt_dir):
        raise CheckpointError(
            f"no checkpoint at {ckpt_dir}",
            hint="check the store path; list_checkpoints(store) shows what is there",
        )
    try:
        with storage.open_read(posixpath.join(ckpt_dir, MANIFEST)) as f:
            raw = f.read()
    except FileNotFoundError:
        raise _broken(ckpt_dir, "incomplete: no manifest, the writer probably died") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _broken(ckpt_dir, f"incomplete: its manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _broken(ckpt_dir, "corrupt: its manifest is not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has manifest format {doc.get('format')!r}; "
            f"this version reads {FORMAT}",
            hint="load it with the varunad version that wrote it",
        )
    if doc.get("complete") is not True:
        raise _broken(ckpt_dir, "incomplete: its manifest is not marked complete")
    epoch = doc.get("epoch")
    if epoch is not None and (type(epoch) is not int or epoch < 0):
        raise _broken(ckpt_dir, f"corrupt: manifest epoch {epoch!r} is not an int >= 0")
    it = doc.get("iteration")
    if type(it) is not int or it < 0:
        raise _broken(ckpt_dir, f"corrupt: manifest iteration {it!r} is not an int >= 0")
    named = _iteration_of(ckpt_dir)
    if named is not None and named != it:
        raise _broken(ckpt_dir, f"corrupt: its manifest says iteration {it} (misplaced copy?)")
    files = doc.get("files")
    if not isinstance(files, list) or not isinstance(doc.get("meta"), dict):
        raise _broken(ckpt_dir, "corrupt: manifest 'files' is not a list or 'meta' not an object")
    seen: set[str] = set()
    for f in files:
        ok = (
            isinstance(f, dict)
            and type(f.get("size")) is int
            and f["size"] >= 0
            and isinstance(f.get("sha256"), str)
            and _SHA_RE.match(f["sha256"])
        )
        if not ok:
            raise _broken(ckpt_dir, f"corrupt: bad manifest entry {f!r}")
        problem = _name_problem(f.get("name"))
        if problem:
            raise _broken(ckpt_dir, f"corrupt: manifest file name {f.get('name')!r} {problem}")
        if f["name"] in seen:
            raise _broken(ckpt_dir, f"corrupt: manifest lists {f['name']} twice")
        seen.add(f["name"])
    return doc


def _sha256_of(storage: CheckpointStorage, path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with storage.open_read(path) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def verify(ckpt_dir: str, *, checksums: bool = True) -> dict:
    """Return the manifest of a complete checkpoint, or raise CheckpointError saying why not.

    With ``checksums`` (the default) every listed file is re-read and hashed; without, only
    presence and sizes are checked (a truncated file is still caught).
    """
    storage = _storage_for(ckpt_dir)
    doc = _read_manifest(storage, ckpt_dir)
    fence = superseded(posixpath.dirname(ckpt_dir.rstrip("/")), doc.get("epoch"), doc["iteration"])
    if fence is not None:
        raise _broken(ckpt_dir, _superseded_why(doc.get("epoch"), *fence))
    for f in doc["files"]:
        path = posixpath.join(ckpt_dir, f["name"])
        try:
            size = storage.size(path)
            if size != f["size"]:
                raise _broken(ckpt_dir, f"corrupt: {f['name']} is {size} bytes, "
                                        f"the manifest says {f['size']} (truncated?)")
            if checksums:
                digest = _sha256_of(storage, path)
                if digest != f["sha256"]:
                    raise _broken(ckpt_dir, f"corrupt: {f['name']} sha256 {digest[:12]}... "
                                            f"differs from the manifest's {f['sha256'][:12]}...")
        except FileNotFoundError:
            raise _broken(ckpt_dir, f"corrupt: {f['name']} is in the manifest but missing") from None
        except OSError as exc:
            raise CheckpointError(f"could not read {path}: {exc}", hint=_MOUNT_HINT) from exc
    return doc


def read_tensors(ckpt_dir: str, name: str, *, map_location: Any = "cpu") -> dict:
    """Load one file written by `write_tensors`. Never unpickles code (weights_only)."""
    _check_name(name)
    storage = _storage_for(ckpt_dir)
    path = posixpath.join(ckpt_dir, name)
    try:
        with storage.open_read(path) as f:
            # write_tensors always writes torch's zip format; anything else is damage (and
            # telling the two apart here keeps the refusal below about pickled objects only).
            if not zipfile.is_zipfile(f):
                raise _broken(ckpt_dir, f"corrupt: {name} is not a torch zip file")
            f.seek(0)
            obj = torch.load(f, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise _broken(ckpt_dir, f"missing {name}") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain values "
            "(or a damaged pickle); refusing to unpickle it",
            hint="write checkpoints with write_tensors; never load files from an untrusted store",
        ) from exc
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise _broken(ckpt_dir, f"corrupt: {name} cannot be read ({exc})") from exc
    if not isinstance(obj, dict):
        raise _broken(ckpt_dir, f"corrupt: {name} holds a {type(obj).__name__}, not a dict")
    return obj


# --------------------------------------------------------------------------------------------
# Finding, pruning, copying


def _names(storage: CheckpointStorage, path: str) -> list[str]:
    """The entries of directory `path`; none when it does not exist."""
    try:
        return storage.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"could not list {path}: {exc}", hint=_MOUNT_HINT) from exc


def list_checkpoints(store: str) -> list[int]:
    """Iterations with a checkpoint directory in ``store`` (complete or not), ascending."""
    storage = _storage_for(store)
    names = _names(storage, store)
    found = []
    for n in names:
        m = _DIR_RE.match(n)
        if m and storage.isdir(posixpath.join(store, n)):
            found.append(int(m.group(1)))
    return sorted(found)


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
    storage = _storage_for(store)
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
    src = _storage_for(local_dir)
    doc = _read_manifest(src, local_dir)
    if doc["iteration"] != iteration:
        raise ValueError(f"{local_dir} holds checkpoint {doc['iteration']}, not {iteration}")
    dst = _storage_for(store)
    dest = checkpoint_dir(store, iteration)
    refuse_superseded(store, doc.get("epoch"), iteration)
    if dst.exists(posixpath.join(dest, MANIFEST)):
        existing = _read_manifest(dst, dest)
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
    src, dst = _storage_for(src_dir), _storage_for(dst_dir)
    dst_path = posixpath.join(dst_dir, entry.name)
    try:
        dst.makedirs(dst_dir)
        with src.open_read(posixpath.join(src_dir, entry.name)) as r, dst.open_atomic(dst_path) as w:
            hw = _HashingWriter(w)
            while chunk := r.read(_CHUNK):
                hw.write(chunk)
            if hw.size != entry.size or hw.sha.hexdigest() != entry.sha256:
                # Raising inside the atomic write keeps the bad copy out of the store.
                raise _broken(src_dir, f"corrupt: {entry.name} does not match what was written")
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _write_error(dst_path, exc) from exc


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
    storage = _storage_for(ckpt_dir)
    path = _writer_record_path(ckpt_dir, token, rank)
    try:
        storage.makedirs(posixpath.dirname(path))
        with storage.open_atomic(path) as f:
            f.write(json.dumps({"rank": rank, "files": [_entry_json(e) for e in entries]}).encode())
    except OSError as exc:
        raise _write_error(path, exc) from exc


def read_writer_records(ckpt_dir: str, token: str) -> dict[int, list[FileEntry]]:
    """The records of run `token` found so far (a record of another run is never counted)."""
    storage = _storage_for(ckpt_dir)
    base = posixpath.join(ckpt_dir, WRITERS)
    found: dict[int, list[FileEntry]] = {}
    for name in _names(storage, base):
        m = re.fullmatch(rf"{re.escape(token)}-rank(\d+)\.json", name)
        if not m:
            continue
        with storage.open_read(posixpath.join(base, name)) as f:
            doc = json.loads(f.read())
        found[int(m.group(1))] = [FileEntry(e["name"], int(e["size"]), e["sha256"]) for e in doc["files"]]
    return found


# --------------------------------------------------------------------------------------------
# Epoch fences: an old incarnation's late checkpoint is never loaded (see the module doc)

EPOCHS = "epochs"


def _check_epoch(epoch: object) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"a plan epoch is an int >= 0, got {epoch!r}")


def write_epoch_fence(store: str, epoch: int, resumed_from: int | None) -> None:
    """Record that plan `epoch` starts from checkpoint `resumed_from` (None: from scratch), so
    that a checkpoint an older epoch commits past it is never loaded. Rank 0 of the epoch
    calls it once, after choosing the checkpoint and before loading it."""
    _check_epoch(epoch)
    if resumed_from is not None and (isinstance(resumed_from, bool) or not isinstance(resumed_from, int)
                                     or resumed_from < 0):
        raise ValueError(f"resumed_from is a checkpoint iteration or None, got {resumed_from!r}")
    storage = _storage_for(store)
    path = posixpath.join(store, EPOCHS, f"{epoch}.json")
    try:
        storage.makedirs(posixpath.join(store, EPOCHS))
        with storage.open_atomic(path) as f:
            f.write(json.dumps({"epoch": epoch, "resumed_from": resumed_from}).encode())
    except OSError as exc:
        raise _write_error(path, exc) from exc


def read_epoch_fences(store: str, *, newer_than: int = -1) -> dict[int, int]:
    """epoch -> the checkpoint it resumed from (-1: from scratch), for every fence in `store` of
    an epoch above `newer_than`. A fence that cannot be read is logged and left out."""
    storage = _storage_for(store)
    base = posixpath.join(store, EPOCHS)
    fences: dict[int, int] = {}
    for name in _names(storage, base):
        m = re.fullmatch(r"(0|[1-9][0-9]*)\.json", name)
        if not m or int(m.group(1)) <= newer_than:
            continue
        try:
            with storage.open_read(posixpath.join(base, name)) as f:
                doc = json.loads(f.read())
            resumed = doc["resumed_from"]
            if doc["epoch"] != int(m.group(1)) or not (resumed is None or (type(resumed) is int and resumed >= 0)):
                raise ValueError(f"not a fence: {doc!r}")
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring epoch fence %s: %s", posixpath.join(base, name), exc)
            continue
        fences[int(m.group(1))] = -1 if resumed is None else resumed
    return fences


def superseded(store: str, epoch: int | None, iteration: int,
               fences: dict[int, int] | None = None) -> tuple[int, int] | None:
    """The fence (newer epoch, the checkpoint it resumed from) that makes checkpoint `iteration`
    of `epoch` an old incarnation's late write; None when it stands (or has no epoch)."""
    if epoch is None:
        return None
    if fences is None:
        fences = read_epoch_fences(store, newer_than=epoch)
    for newer in sorted(fences):
        if newer > epoch and iteration > fences[newer]:
            return newer, fences[newer]
    return None


def _superseded_why(epoch: int | None, newer: int, resumed_from: int) -> str:
    start = f"checkpoint {resumed_from}" if resumed_from >= 0 else "scratch"
    return (f"superseded: written under plan epoch {epoch}, after epoch {newer} had started from {start} "
            "(a late write of an old incarnation)")


def refuse_superseded(store: str, epoch: int | None, iteration: int) -> None:
    """Raise CheckpointError if checkpoint `iteration` of `epoch` must not be written (`superseded`)."""
    fence = superseded(store, epoch, iteration)
    if fence is not None:
        raise CheckpointError(f"not writing checkpoint {iteration} to {store}: {_superseded_why(epoch, *fence)}",
                              hint="a newer plan epoch runs this job; this worker's epoch is over (if etcd was "
                                   f"reset, so epochs count from 1 again, delete {posixpath.join(store, EPOCHS)})")
