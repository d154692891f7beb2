"""Planning: pipeline schedules as data, calibrations, the simulator that replays a schedule, the
planner that picks P x D, micro-batch, cuts and placement for a fleet, and the plan it returns.

Pure Python and numpy: no torch, no I/O beyond reading a calibration file. This is the one part of
trainer that the control plane (varunad.control) imports, and tests/unit/test_imports.py checks that
importing it does not import torch.

May import: trainer.errors, numpy, the standard library. Nothing else of trainer, nothing of varunad.
"""
