"""Plan epochs fence checkpoints: rank 0 of a new epoch records (``<store>/epochs/<epoch>.json``)
the checkpoint it resumed from, and a checkpoint an *older* epoch commits past that one, an old
incarnation's late write, is refused when committed and never loaded (`superseded`). Checkpoints
written without an epoch (the local launcher) are never fenced. See trainer.checkpoint.store.

May import: trainer.checkpoint.storage, trainer.errors, the standard library.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re

from trainer.checkpoint.storage import names_in, storage_for, write_error
from trainer.errors import CheckpointError, StoreOutage

__all__ = ["EPOCHS", "is_count", "write_epoch_fence", "read_epoch_fences", "superseded", "superseded_why",
           "refuse_superseded", "check_epoch"]

log = logging.getLogger("varuna.checkpoint")


EPOCHS = "epochs"


def is_count(x: object) -> bool:
    """An int >= 0 (JSON's true/false are not)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_epoch(epoch: object) -> None:
    if not is_count(epoch):
        raise ValueError(f"a plan epoch is an int >= 0, got {epoch!r}")


def write_epoch_fence(store: str, epoch: int, resumed_from: int | None) -> None:
    """Record that plan `epoch` starts from checkpoint `resumed_from` (None: from scratch), so
    that a checkpoint an older epoch commits past it is never loaded. Rank 0 of the epoch
    calls it once, after choosing the checkpoint and before loading it."""
    check_epoch(epoch)
    if resumed_from is not None and not is_count(resumed_from):
        raise ValueError(f"resumed_from is a checkpoint iteration or None, got {resumed_from!r}")
    storage = storage_for(store)
    path = posixpath.join(store, EPOCHS, f"{epoch}.json")
    try:
        storage.makedirs(posixpath.join(store, EPOCHS))
        with storage.open_atomic(path) as f:
            f.write(json.dumps({"epoch": epoch, "resumed_from": resumed_from}).encode())
    except OSError as exc:
        err = write_error(path, exc)
        raise (err.at_step(resumed_from or 0) if isinstance(err, StoreOutage) else err) from exc


def read_epoch_fences(store: str, *, newer_than: int = -1) -> dict[int, int]:
    """epoch -> the checkpoint it resumed from (-1: from scratch), for every fence in `store` of
    an epoch above `newer_than`. A fence that cannot be read is logged and left out."""
    storage = storage_for(store)
    base = posixpath.join(store, EPOCHS)
    fences: dict[int, int] = {}
    for name in names_in(storage, base):
        m = re.fullmatch(r"(0|[1-9][0-9]*)\.json", name)
        if not m or int(m.group(1)) <= newer_than:
            continue
        try:
            with storage.open_read(posixpath.join(base, name)) as f:
                doc = json.loads(f.read())
            resumed = doc["resumed_from"]
            if doc["epoch"] != int(m.group(1)) or not (resumed is None or is_count(resumed)):
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


def superseded_why(epoch: int | None, newer: int, resumed_from: int) -> str:
    start = f"checkpoint {resumed_from}" if resumed_from >= 0 else "scratch"
    return (f"superseded: written under plan epoch {epoch}, after epoch {newer} had started from {start} "
            "(a late write of an old incarnation)")


def refuse_superseded(store: str, epoch: int | None, iteration: int) -> None:
    """Raise CheckpointError if checkpoint `iteration` of `epoch` must not be written (`superseded`)."""
    fence = superseded(store, epoch, iteration)
    if fence is not None:
        raise CheckpointError(f"not writing checkpoint {iteration} to {store}: {superseded_why(epoch, *fence)}",
                              hint="a newer plan epoch runs this job; this worker's epoch is over (if etcd was "
                                   f"reset, so epochs count from 1 again, delete {posixpath.join(store, EPOCHS)})")
