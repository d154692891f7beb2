"""Pipeline + data-parallel training engine (the Varuna API).

    from trainer import CutPoint, Varuna, GlobalBatches
"""

from trainer.cutpoint import CutPoint
from trainer.data import GlobalBatches
from trainer.errors import CheckpointError, ConfigError, PartitionError, VarunaError, WorkerError
from trainer.varuna import Varuna

__all__ = ["CutPoint", "Varuna", "GlobalBatches", "VarunaError", "ConfigError", "PartitionError",
           "CheckpointError", "WorkerError"]
