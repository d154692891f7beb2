"""Pipeline + data-parallel training engine (the Varuna API).

    from trainer import CutPoint, Varuna, GlobalBatches

Names are imported on first use: the daemon imports trainer.planning.planner and trainer.planning.simulator,
which need no torch, and must not pay for (or depend on) torch to do so.
"""

import importlib

from trainer.engine import hooks as _hooks

__all__ = ["CutPoint", "Varuna", "GlobalBatches", "Profiler", "VarunaError", "ConfigError", "PartitionError",
           "CheckpointError", "WorkerError", "keyed_model", "keyed_randomness", "train_step"]

_HOME = {
    "CutPoint": "trainer.graph.cutpoint",
    "Varuna": "trainer.engine.varuna",
    "GlobalBatches": "trainer.data",
    "Profiler": "trainer.profiler",
    "VarunaError": "trainer.errors",
    "ConfigError": "trainer.errors",
    "PartitionError": "trainer.errors",
    "CheckpointError": "trainer.errors",
    "WorkerError": "trainer.errors",
    "keyed_model": "trainer.graph.reference",
    "keyed_randomness": "trainer.graph.keyed_rng",
    "train_step": "trainer.graph.reference",
}


def _calibration_run(*args, **kwargs):
    # The profiler sits above the engine, which calls its calibration run through a hook; the root,
    # above both, wires them. Looked up on call, like the names of _HOME: only a VARUNA_PROFILE run
    # pays for the profiler.
    return importlib.import_module("trainer.profiler.calibration_run").CalibrationRun(*args, **kwargs)


_hooks.calibration_run = _calibration_run


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
