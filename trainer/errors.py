"""One family of errors for the training engine; each carries what the user should do."""

from __future__ import annotations

import errno as _errno

__all__ = ["VarunaError", "ConfigError", "PartitionError", "CheckpointError", "StoreOutage", "WorkerError",
           "OUTAGE_ERRNOS"]


class VarunaError(Exception):
    """Root of every error the trainer raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)


class ConfigError(VarunaError, ValueError):
    """A setting or an environment variable is wrong."""


class PartitionError(VarunaError, ValueError):
    """The model cannot be cut into the requested stages as written."""


class CheckpointError(VarunaError):
    """A checkpoint is missing, incomplete or corrupt; it was not loaded."""


# The hint of a checkpoint that does not fit the model; the leader reads it in a failure's words
# (varunad.node.leader: such a job is told to give the job a store of its own).
ANOTHER_MODEL = "it was written by a different model"


# What a store that is full, over quota, read-only or failing says. None of them is about the
# checkpoint or the job: the same write succeeds once an operator frees space or remounts.
OUTAGE_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT, _errno.EROFS, _errno.EIO})


class StoreOutage(CheckpointError):
    """The checkpoint store refused a write for a reason of its own (full, over quota, read-only,
    an I/O error): a pause, not a job failure. Nothing was committed; the worker keeps its state
    in memory and writes again later. `step`: the checkpoint (or fence) it was writing, when known."""

    def __init__(self, path: str, err: int, detail: str, *, step: int | None = None) -> None:
        self.path, self.errno, self.detail, self.step = path, err, detail, step
        super().__init__(f"could not write {path}: {detail}",
                         hint="the checkpoint store is full, read-only or failing: free space or remount it; "
                              "training keeps its state and writes again when it can")

    def at_step(self, step: int) -> StoreOutage:
        """The same outage, saying which step's checkpoint it stopped."""
        return StoreOutage(self.path, self.errno, self.detail, step=step)

    def __reduce__(self):   # crosses torch.distributed's object collectives whole
        return (_outage, (self.path, self.errno, self.detail, self.step))


def _outage(path: str, err: int, detail: str, step: int | None) -> StoreOutage:
    return StoreOutage(path, err, detail, step=step)


class WorkerError(VarunaError):
    """A worker (or a peer it depends on) failed."""
