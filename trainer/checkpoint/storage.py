"""Where checkpoint files live: the `CheckpointStorage` protocol over '/'-separated string paths,
its local (or mounted) filesystem implementation, the registry of other backends by URL scheme,
and the small I/O helpers every part of the store shares (hashing while writing, listing a
directory that may not exist, the errors a failed write or list raises).

May import: trainer.errors and the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from trainer.errors import OUTAGE_ERRNOS, CheckpointError, StoreOutage

__all__ = ["CheckpointStorage", "LocalStorage", "register_storage", "storage_for", "names_in", "write_error",
           "is_outage", "HashingWriter", "MOUNT_HINT", "CHUNK"]

CHUNK = 4 << 20
MOUNT_HINT = "check that the store is mounted and reachable from this VM"



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

    def idle_s(self, path: str) -> float:
        """Seconds since `path` was last written (optional: the temporaries' sweep needs it)."""
        return time.time() - os.stat(path).st_mtime

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


def storage_for(path: str) -> CheckpointStorage:
    scheme, sep, _ = path.partition("://")
    if not sep:
        return _LOCAL
    if scheme in _BACKENDS:
        return _BACKENDS[scheme]
    raise CheckpointError(
        f"no checkpoint storage for {scheme}:// paths ({path})",
        hint=f"call trainer.checkpoint.storage.register_storage({scheme!r}, ...) first, "
        "or use a mounted path",
    )


def names_in(storage: CheckpointStorage, path: str) -> list[str]:
    """The entries of directory `path`; none when it does not exist."""
    try:
        return storage.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if is_outage(exc):
            raise StoreOutage(path, exc.errno, exc.strerror or str(exc)) from exc
        raise CheckpointError(f"could not list {path}: {exc}", hint=MOUNT_HINT) from exc


class HashingWriter:
    """Forwards writes to ``f`` while hashing them, so checksums cost no second read."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        # torch.save turns an OSError of the file it writes into a RuntimeError ("unexpected
        # pos"), losing the errno: the first one is kept here for the caller to raise instead.
        self.failed: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        try:
            self._f.write(view)
        except OSError as exc:
            self.failed = self.failed or exc
            raise
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` is the store's own trouble (full, over quota, read-only, I/O error)."""
    return isinstance(exc, OSError) and exc.errno in OUTAGE_ERRNOS


def write_error(path: str, exc: OSError) -> CheckpointError:
    """The error a failed write raises: a `StoreOutage` when the store itself refused it."""
    if is_outage(exc):
        return StoreOutage(path, exc.errno, exc.strerror or str(exc))
    return CheckpointError(
        f"could not write {path}: {exc}",
        hint="check that the store is mounted, writable and has free space",
    )
