"""One family of errors for the training engine; each carries what the user should do."""

from __future__ import annotations

__all__ = ["VarunaError", "ConfigError", "PartitionError", "CheckpointError", "WorkerError"]


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


class WorkerError(VarunaError):
    """A worker (or a peer it depends on) failed."""
