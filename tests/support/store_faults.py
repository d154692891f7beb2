"""Faults of the ring's checkpoint store for the chaos suite (issue 27): the store full (with and
without a lost VM) and read-only, each for a while, then back. None of them may fail the job or use
up a restart: training goes on, the writes the job needs wait for the store, and `varunactl status`
says "checkpoints failing since step N: <reason>" meanwhile.

A full store is a small tmpfs mounted as the ring's shared store before the daemons start (the
scenario's ``store`` context) and filled by another writer; a read-only one is a read-only bind
mount over the store. Both need root in a mount namespace that allows them (a CI container does).
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["STORE_SCENARIOS", "MountRefused", "tmpfs_store", "read_only"]

FILLER = ".chaos-filler"   # hidden: never mistaken for a checkpoint by a listing


class MountRefused(RuntimeError):
    """This machine does not let the suite mount (not root, or no mount namespace of its own)."""


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise MountRefused(f"mount {' '.join(args)} failed: {proc.stderr.strip()}; the store scenarios need root "
                           "and a mount namespace that allows tmpfs and bind mounts")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def tmpfs_store(store: Path, size: str = "64m") -> Iterator[Path]:
    """The ring's shared store as a tmpfs of `size`, so that another writer can fill it."""
    store.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(store))
    try:
        yield store
    finally:
        _umount(store)


@contextlib.contextmanager
def read_only(store: Path) -> Iterator[Path]:
    """`store` seen read-only (EROFS) through a bind mount over itself; root ignores a chmod."""
    _mount("--bind", str(store), str(store))
    try:
        _mount("-o", "remount,ro,bind", str(store))
        yield store
    finally:
        _umount(store)


def fill(store: Path, leave: int = 0) -> Path:
    """Write to `store` until it is full (ENOSPC), then give `leave` bytes back (room for a file or
    two of a checkpoint, never a whole one); the file that fills it, to delete when done."""
    path = store / FILLER
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while len(chunk) >= 4096:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk = chunk[:len(chunk) // 2]
        f.truncate(max(0, f.tell() - leave))
    return path


def _wait_failing(run: Any, why: str, **extra: Any) -> dict[str, Any]:
    """The status once it says checkpoints are failing for `why` (and matches `extra`)."""
    return run.ring.poll(lambda: (s := run.status()).get("store_failing") and why in s["store_failing"]
                         and all(s.get(k) != v for k, v in extra.items()) and s,
                         timeout=120, what=f"`varunactl status` saying checkpoints fail ({why})")


def _held(run: Any, seen: dict[str, Any], newest_before: int | None) -> None:
    """What must hold while the store refuses writes, recorded as the scenario's checks."""
    from trainer.checkpoint.store import latest_complete

    text = seen["store_failing"]
    run.checks.append(lambda st: None if text.startswith("checkpoints failing since step ") else
                      f"status said {text!r}, not 'checkpoints failing since step N: <reason>'")
    run.checks.append(lambda st: None if st.get("restarts") == 0 else
                      f"the outage used up restarts: {st.get('restarts')} ({st.get('error')})")
    now = latest_complete(str(run.ring.store_dir / run.job), verify_checksums=False)
    run.checks.append(lambda st: None if now == newest_before else
                      f"a checkpoint was committed while the store refused writes: {newest_before} -> {now}")
    state = seen["state"]
    run.checks.append(lambda st: None if state in ("running", "morphing") else f"the job was {state} in the outage")


def store_full(run: Any) -> None:
    """Another writer fills the store; training goes on to the job's last step, whose checkpoint
    waits for space; then the filler is deleted."""
    from trainer.checkpoint.store import latest_complete

    store = run.ring.store_dir
    before = latest_complete(str(store / run.job), verify_checksums=False)
    filler = fill(store)
    _wait_failing(run, "No space left on device")
    # every step trained while the checkpoints fail; the last one's checkpoint is held in memory
    run.ring.poll(lambda: (s := run.status())["step"] >= s["steps"], timeout=120,
                  what="the job's last step with the store full")
    time.sleep(3.0)   # a few retries of the final checkpoint
    _held(run, run.status(), before)
    filler.unlink()


def store_full_lost_vm(run: Any) -> None:
    """The store full, then a VM lost: the new epoch's fence waits for space (its workers hold no
    state yet), so the job resumes from the store's newest checkpoint once space comes back."""
    from trainer.checkpoint.store import latest_complete

    store = run.ring.store_dir
    before = latest_complete(str(store / run.job), verify_checksums=False)
    filler = fill(store)
    failing = _wait_failing(run, "No space left on device")
    leader = run.leader()
    victim = next(m for m in run.plan_members() if m != leader)
    run.hit.add(victim)
    run.ring.daemons[victim].kill9()
    seen = _wait_failing(run, "No space left on device", epoch=failing["epoch"])
    time.sleep(3.0)   # the fence retried a few times
    _held(run, run.status() | {"store_failing": seen["store_failing"]}, before)
    filler.unlink()


def store_read_only(run: Any) -> None:
    """The store remounted read-only for a while, then writable again."""
    from trainer.checkpoint.store import latest_complete

    store = run.ring.store_dir
    before = latest_complete(str(store / run.job), verify_checksums=False)
    with read_only(store):
        _wait_failing(run, "Read-only file system")
        run.ring.poll(lambda: (s := run.status())["step"] >= s["steps"], timeout=120,
                      what="the job's last step with the store read-only")
        time.sleep(3.0)   # a few retries of the final checkpoint
        _held(run, run.status(), before)


# Merged into chaos_harness.SCENARIOS. `store`: a context around the whole run for the ring's store.
STORE_SCENARIOS: dict[str, dict[str, Any]] = {
    # checkpoints 8 and 12 refused, the final one (14) held until space comes back: no step redone
    "store-full": dict(fault=store_full, keep_epoch=True, store=tmpfs_store),
    # the survivors cannot save their state either: the new epoch resumes from the store's newest
    # (4), so the steps since it are redone, at most the ones trained before the VM was lost
    "store-full-lost-vm": dict(fault=store_full_lost_vm, store=tmpfs_store, max_redone=3 * 4),
    "store-read-only": dict(fault=store_read_only, keep_epoch=True),
}
