"""How a checkpoint is named, found and read: the directory and file names of a store, the
manifest (the commit record: see trainer.checkpoint.store) and its checks, `verify` (is this
checkpoint complete and intact?), `list_checkpoints` and `read_tensors`. Nothing here writes.

May import: trainer.checkpoint.storage, trainer.checkpoint.fences, trainer.errors, torch.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import posixpath
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.fences import is_count, superseded, superseded_why
from trainer.checkpoint.storage import CHUNK, MOUNT_HINT, CheckpointStorage, names_in, storage_for
from trainer.errors import CheckpointError

__all__ = ["CKPT_PREFIX", "MANIFEST", "FORMAT", "FileEntry", "rescue_meta_file", "checkpoint_dir", "iteration_of", "check_name",
           "list_checkpoints", "read_manifest", "broken", "verify", "read_tensors"]

CKPT_PREFIX = "varuna_ckpt_"
MANIFEST = "manifest.json"
FORMAT = 1
_RESCUE_META = re.compile(r"meta-rank\d+\.pt")


def rescue_meta_file(rank: int) -> str:
    """The meta file a survivor of rank `rank` writes in a save from memory (trainer.checkpoint.rescue);
    an ordinary checkpoint has one meta file for all."""
    return f"meta-rank{rank}.pt"


# Canonical decimal only, so that checkpoint_dir(store, n) and this pattern agree one to one.
_DIR_RE = re.compile(rf"^{re.escape(CKPT_PREFIX)}(0|[1-9][0-9]*)$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as its writer saw it: name inside the directory, bytes, sha256."""

    name: str
    size: int
    sha256: str


# --------------------------------------------------------------------------------------------
# Names and small helpers


def checkpoint_dir(store: str, iteration: int) -> str:
    """The directory of checkpoint ``iteration`` under ``store``."""
    if not is_count(iteration):
        raise ValueError(f"checkpoint iteration must be an int >= 0, got {iteration!r}")
    return posixpath.join(store, f"{CKPT_PREFIX}{iteration}")


def iteration_of(ckpt_dir: str) -> int | None:
    m = _DIR_RE.match(posixpath.basename(ckpt_dir.rstrip("/")))
    return int(m.group(1)) if m else None


def name_problem(name: object) -> str | None:
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


def check_name(name: str) -> None:
    problem = name_problem(name)
    if problem:
        raise ValueError(f"checkpoint file name {name!r} {problem}; use a name like 'layer_003.pt'")


def list_checkpoints(store: str) -> list[int]:
    """Iterations with a checkpoint directory in ``store`` (complete or not), ascending."""
    storage = storage_for(store)
    names = names_in(storage, store)
    found = []
    for n in names:
        m = _DIR_RE.match(n)
        if m and storage.isdir(posixpath.join(store, n)):
            found.append(int(m.group(1)))
    return sorted(found)


# --------------------------------------------------------------------------------------------
# Reading and verifying


def _resume_hint(ckpt_dir: str) -> str:
    """Point at the newest older checkpoint that at least has a manifest (cheap to find)."""
    it = iteration_of(ckpt_dir)
    if it is None:
        return "write the checkpoint again"
    store = posixpath.dirname(ckpt_dir.rstrip("/"))
    try:
        storage = storage_for(ckpt_dir)
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


def broken(ckpt_dir: str, what: str) -> CheckpointError:
    it = iteration_of(ckpt_dir)
    store = posixpath.dirname(ckpt_dir.rstrip("/"))
    label = f"checkpoint {it} in {store}" if it is not None else f"checkpoint {ckpt_dir}"
    return CheckpointError(f"{label} is {what}", hint=_resume_hint(ckpt_dir))


def _why_no_manifest(storage: CheckpointStorage, ckpt_dir: str) -> str:
    """A survivors' save from memory that lacked a stage is no writer's death: it stays without a
    manifest by design (the next epoch resumes from an older checkpoint)."""
    try:
        rescued = any(_RESCUE_META.fullmatch(n) for n in names_in(storage, ckpt_dir))
    except CheckpointError:   # what the store says of the listing is not this checkpoint's story
        rescued = False
    if rescued:
        return "incomplete: the survivors saved it from memory, but no survivor held every stage"
    return "incomplete: no manifest (its writer died, or the store refused its writes)"


def read_manifest(storage: CheckpointStorage, ckpt_dir: str) -> dict:
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
        raise broken(ckpt_dir, _why_no_manifest(storage, ckpt_dir)) from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise broken(ckpt_dir, f"incomplete: its manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise broken(ckpt_dir, "corrupt: its manifest is not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has manifest format {doc.get('format')!r}; "
            f"this version reads {FORMAT}",
            hint="load it with the varunad version that wrote it",
        )
    if doc.get("complete") is not True:
        raise broken(ckpt_dir, "incomplete: its manifest is not marked complete")
    epoch = doc.get("epoch")
    if epoch is not None and (type(epoch) is not int or epoch < 0):
        raise broken(ckpt_dir, f"corrupt: manifest epoch {epoch!r} is not an int >= 0")
    it = doc.get("iteration")
    if type(it) is not int or it < 0:
        raise broken(ckpt_dir, f"corrupt: manifest iteration {it!r} is not an int >= 0")
    named = iteration_of(ckpt_dir)
    if named is not None and named != it:
        raise broken(ckpt_dir, f"corrupt: its manifest says iteration {it} (misplaced copy?)")
    files = doc.get("files")
    if not isinstance(files, list) or not isinstance(doc.get("meta"), dict):
        raise broken(ckpt_dir, "corrupt: manifest 'files' is not a list or 'meta' not an object")
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
            raise broken(ckpt_dir, f"corrupt: bad manifest entry {f!r}")
        problem = name_problem(f.get("name"))
        if problem:
            raise broken(ckpt_dir, f"corrupt: manifest file name {f.get('name')!r} {problem}")
        if f["name"] in seen:
            raise broken(ckpt_dir, f"corrupt: manifest lists {f['name']} twice")
        seen.add(f["name"])
    return doc


def _sha256_of(storage: CheckpointStorage, path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
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
    storage = storage_for(ckpt_dir)
    doc = read_manifest(storage, ckpt_dir)
    fence = superseded(posixpath.dirname(ckpt_dir.rstrip("/")), doc.get("epoch"), doc["iteration"])
    if fence is not None:
        raise broken(ckpt_dir, superseded_why(doc.get("epoch"), *fence))
    for f in doc["files"]:
        path = posixpath.join(ckpt_dir, f["name"])
        try:
            size = storage.size(path)
            if size != f["size"]:
                raise broken(ckpt_dir, f"corrupt: {f['name']} is {size} bytes, "
                                        f"the manifest says {f['size']} (truncated?)")
            if checksums:
                digest = _sha256_of(storage, path)
                if digest != f["sha256"]:
                    raise broken(ckpt_dir, f"corrupt: {f['name']} sha256 {digest[:12]}... "
                                            f"differs from the manifest's {f['sha256'][:12]}...")
        except FileNotFoundError:
            raise broken(ckpt_dir, f"corrupt: {f['name']} is in the manifest but missing") from None
        except OSError as exc:
            raise CheckpointError(f"could not read {path}: {exc}", hint=MOUNT_HINT) from exc
    return doc


def read_tensors(ckpt_dir: str, name: str, *, map_location: Any = "cpu") -> dict:
    """Load one file written by `write_tensors`. Never unpickles code (weights_only)."""
    check_name(name)
    storage = storage_for(ckpt_dir)
    path = posixpath.join(ckpt_dir, name)
    try:
        with storage.open_read(path) as f:
            # write_tensors always writes torch's zip format; anything else is damage (and
            # telling the two apart here keeps the refusal below about pickled objects only).
            if not zipfile.is_zipfile(f):
                raise broken(ckpt_dir, f"corrupt: {name} is not a torch zip file")
            f.seek(0)
            obj = torch.load(f, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise broken(ckpt_dir, f"missing {name}") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain values "
            "(or a damaged pickle); refusing to unpickle it",
            hint="write checkpoints with write_tensors; never load files from an untrusted store",
        ) from exc
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise broken(ckpt_dir, f"corrupt: {name} cannot be read ({exc})") from exc
    if not isinstance(obj, dict):
        raise broken(ckpt_dir, f"corrupt: {name} holds a {type(obj).__name__}, not a dict")
    return obj
