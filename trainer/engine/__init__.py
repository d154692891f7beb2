"""The engine: one worker's view of a P x D job (`Varuna`, with its process groups, step agreement
and checkpoints: groups, agreement, checkpoints), the executor that interprets a stage's
schedule table, activations between stages (comm), gradient reduction across replicas
(data_parallel), mixed precision, the worker's control line to its daemon, its own compute time
per step (compute_clock), Chrome traces, and
how a worker sets itself up (setup: assignment, device, tensor placement, stream security).

May import: trainer.planning (the schedule table), trainer.graph, trainer.checkpoint, trainer.net,
trainer.worker_env, trainer.errors, protocol, torch. Never the profiler
(a calibration run reaches it through `hooks`, set by the package root) nor varunad.
"""
