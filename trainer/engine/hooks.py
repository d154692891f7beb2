"""What the engine calls but does not own: the calibration run (VARUNA_PROFILE) lives in
trainer.profiler, above the engine, so the engine reads it from here instead of importing it.
The package root `trainer`, which sits above every part, sets it when it is imported (and Python
imports it before any of its modules), so a script's `Varuna` always finds it. No torch here:
the root is imported by the control plane too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CalibrationRunHook", "calibration_run"]


class CalibrationRunHook(Protocol):
    """A calibration run in progress: `run(optimizer, dynamic_loss_scale=)` profiles and ends the
    script (SystemExit); `check_done()`, at exit, says why nothing was written if `run` never started."""

    def run(self, optimizer: Any, *, dynamic_loss_scale: bool = False) -> None: ...

    def check_done(self) -> None: ...


# (model, get_batch_fn, assignment, batch_size, chunk_size, precision, device) -> the run
calibration_run: Callable[..., CalibrationRunHook] | None = None
