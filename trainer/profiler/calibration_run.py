"""The daemon's calibration run (VARUNA_PROFILE=path): the job's own script, started once, builds
its `Varuna` object and hands it the optimizer; the model is then profiled on the device its
workers will train on, the calibration written, and the script ended before any training.

The profile waits for `set_optimizer` because the optimizer's step is part of every step the
planner estimates: timed with a stand-in (AdamW) it was several times a plain SGD step's cost for
a job that trains with SGD, and the optimizer's state bytes were guessed instead of measured.

The engine never imports the profiler: it calls `trainer.engine.hooks.calibration_run`, which the
package root `trainer` (above both) sets to build a `CalibrationRun`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping

import torch
from torch import nn

from trainer.engine.memory import PeakMemory, process_bytes
from trainer.engine.precision import Precision
from trainer.graph.written import batch_statistics
from trainer.profiler.calibrate import Profiler
from trainer.worker_env import WorkerAssignment

__all__ = ["CalibrationRun", "profile_sizes"]

log = logging.getLogger("varuna")


def profile_sizes(batch_size: int, chunk_size: int) -> list[int]:
    """The micro-batch sizes to measure: powers of two up to the batch (capped by
    VARUNA_PROFILE_MAX_MICRO_BATCH, 64 by default), and the script's own chunk size."""
    limit = max(1, min(batch_size, int(os.environ.get("VARUNA_PROFILE_MAX_MICRO_BATCH", "64"))))
    return sorted({1 << k for k in range(limit.bit_length()) if 1 << k <= limit} | {min(chunk_size, limit)})


class CalibrationRun:
    """What a calibration run needs until the script hands over its optimizer."""

    def __init__(self, model: nn.Module, get_batch_fn: Callable[..., Mapping[str, torch.Tensor]],
                 assignment: WorkerAssignment, batch_size: int, chunk_size: int, precision: Precision,
                 device: torch.device) -> None:
        self.model, self.get_batch_fn, self.assignment = model, get_batch_fn, assignment
        self.batch_size = batch_size
        self.sizes = profile_sizes(batch_size, chunk_size)
        if assignment.plan.micro_batch_size is not None:   # fixed at submit: the one size the planner may use
            self.sizes = sorted({*self.sizes, min(assignment.plan.micro_batch_size, batch_size)})
        # the one size to calibrate where the micro-batch decides the model (BatchNorm), unless the job
        # fixed one at submit: the script's chunk_size, or the largest calibrated size below it
        # that splits the batch evenly (a ragged one may give no plan at all)
        self.fixed = assignment.plan.micro_batch_size is not None
        self.one_size = max((b for b in self.sizes if b <= chunk_size and batch_size % b == 0), default=1)
        self.precision, self.device = precision, device
        self.started = False

    def run(self, optimizer: torch.optim.Optimizer | None, *, dynamic_loss_scale: bool = False) -> None:
        """Profile (the optimizer's class and settings time the STEP; None: the profiler's
        default), write the calibration to VARUNA_PROFILE's path and end the script.
        `dynamic_loss_scale`: the script trains in fp16 with a loss scale that backs off on overflow."""
        self.started = True
        a = self.assignment
        if a.threads:
            torch.set_num_threads(a.threads)
        profiler = Profiler(self.model, self.get_batch_fn, device=self.device,
                            out_folder=os.path.dirname(os.path.abspath(a.profile)),
                            gpus_per_node=a.profile_slots, busy_slots=a.profile_machine_slots,
                            precision=self.precision, capture_cache=a.capture_cache)
        profiler.global_batch = self.batch_size
        if optimizer is not None:
            profiler.set_optimizer(optimizer)
        meter = PeakMemory(self.device)   # from the captured model: what a worker holds before it trains
        # a worker on a CPU holds a process like this one beside its stage's tensors: the same
        # script, libraries and data, and the capture's machinery (trainer.engine.memory)
        process = process_bytes(self.model) if self.device.type == "cpu" else 0
        sizes = self.sizes
        # What trains a model that depends on the micro-batch: calibrated at one size, the planner
        # chooses that one under every plan, so every plan (and every morph) trains the same model
        # (a size the job fixed at submit is measured with every other, as for any job)
        why = ""
        if not self.fixed and batch_statistics(profiler.traced.graph_module):
            why = "the model's BatchNorm makes what it trains depend on the micro-batch size"
        elif not self.fixed and dynamic_loss_scale:
            # a micro-batch's fp16 backward sums its rows' gradients in fp16: whether a step overflows
            # (and is skipped, and the scale backs off) depends on how many rows (a probe's Llama
            # was 0.24 off at step 14 between micro-batches 16 and 4; bf16 has no such cliff)
            why = ("fp16 with a dynamic loss scale skips the steps that overflow, and whether a step overflows "
                   "depends on the micro-batch size (bf16, or a fixed --chunk-size, leaves the planner free)")
        if why:
            sizes = [self.one_size]
            log.warning("calibrating micro-batch size %d only (from the script's chunk_size): %s", self.one_size,
                        why)
        calibration = profiler.profile_all(sizes)
        if process:
            calibration = dataclasses.replace(calibration, worker_bytes=calibration.worker_bytes + process)
        calibration.save(a.profile)
        # the whole model passes through host memory; the device holds one segment at a time
        log.warning("calibration memory: peak %.1f MB above the built model (%s), the model's weights %.1f MB, "
                    "a worker beyond its tensors %.1f MB", meter.growth_bytes() / 1e6,
                    "largest allocated" if self.device.type == "cuda" else "resident growth",
                    sum(p.numel() * p.element_size() for p in self.model.parameters()) / 1e6,
                    calibration.worker_bytes / 1e6)
        log.warning("calibration of %s (optimizer %s) written to %s; exiting (VARUNA_PROFILE run)",
                    profiler.fingerprint, type(optimizer).__name__ if optimizer is not None else "default",
                    a.profile)
        raise SystemExit(0)

    def check_done(self) -> None:
        """At exit: say why no calibration was written if the script never set its optimizer."""
        if not self.started:
            log.error("the script ended before Varuna.set_optimizer(): a calibration run (VARUNA_PROFILE) "
                      "profiles the model once the optimizer is set, so none was written to %s",
                      self.assignment.profile)
