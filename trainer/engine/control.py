"""A worker's line to the daemon that started it: progress out, checkpoint/stop requests in.

Requests are only *noted* here. They take effect at a step boundary that every worker of the
job agrees on: the flags ride in the step's one exchange of statistics, summed alike on every
worker (see trainer.engine.agreement: StepAgreement._optimizer_step), so all P x D workers
checkpoint or stop after the same step, or none does. SIGTERM (a spot VM's preemption notice,
or systemd stopping the unit) counts as "checkpoint, then stop".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
from collections.abc import Callable

import zmq

from protocol.errors import ProtocolError
from protocol.messages import (
    CheckpointNow,
    StopWorkers,
    WorkerCheckpointed,
    WorkerProgress,
    WorkerRescuing,
    WorkerStoreOutage,
    decode,
    encode,
)
from trainer.engine.zmq_exit import terminate

__all__ = ["ControlClient", "StopRequested", "StepAbandoned", "RESCUE_SIGNAL", "STOPPED_EXIT_CODE", "TOKEN_ENV",
           "control_identity"]

log = logging.getLogger("varuna.control")

# EX_TEMPFAIL: the worker stopped because it was asked to, not because it failed.
STOPPED_EXIT_CODE = 75

# The daemon's "your epoch is broken: abandon the step, save what you hold, leave".
RESCUE_SIGNAL = signal.SIGUSR1

# The secret the daemon drew for this worker (varunad.node.control_channel): part of its identity on
# the control socket, so that no other local process can speak for it.
TOKEN_ENV = "VARUNA_CONTROL_TOKEN"


def control_identity(rank: int, token: str = "") -> bytes:
    return (f"rank-{rank}-{token}" if token else f"rank-{rank}").encode()


class StopRequested(SystemExit):
    """Raised by Varuna.step after the agreed stop; exits the script with STOPPED_EXIT_CODE."""

    def __init__(self, step: int) -> None:
        super().__init__(STOPPED_EXIT_CODE)
        self.step = step


class StepsDone(SystemExit):
    """Raised by Varuna.step called past the job's last step: the job's steps are trained and its
    last checkpoint written, so the script ends with status 0 here rather than training on (a
    probe's script looped to its own count, 290 steps past its job's, which then failed for want
    of a checkpoint of its last step)."""

    def __init__(self, step: int) -> None:
        super().__init__(0)
        self.step = step


class StepAbandoned(Exception):
    """Raised in the step in progress when the daemon signals that the epoch is broken."""


class ControlClient:
    def __init__(self, endpoint: str | None, *, job: str, epoch: int, rank: int) -> None:
        self.job, self.epoch, self.rank = job, epoch, rank
        self.checkpoint_requested = False
        self.stop_requested = False
        self.rescue_requested = False
        self.abandonable = False   # set by the engine while the step holds nothing half-applied
        # set by the engine once it holds a model: called on a rescue that comes between steps,
        # where the state is whole (a script evaluating or loading data for longer than the
        # daemon's abort grace was SIGKILLed with its newer state unsaved)
        self.idle_rescue: Callable[[], None] | None = None
        self.in_step = False
        self._sock = None
        self._ctx = None
        if endpoint:
            # a context of its own, terminated at close (trainer.engine.zmq_exit): what the worker
            # said last (its final checkpoint) reaches the daemon when the process exits right after
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, control_identity(rank, os.environ.get(TOKEN_ENV, "")))
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.connect(endpoint)
        self._install_handlers(under_daemon=bool(endpoint))

    def _install_handlers(self, *, under_daemon: bool) -> None:
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            # Only a daemon sends the rescue signal; elsewhere a script's own SIGUSR1 (a batch
            # system's "time is nearly up") stays the script's.
            if under_daemon:
                theirs = signal.getsignal(RESCUE_SIGNAL)
                if callable(theirs) and not isinstance(getattr(theirs, "__self__", None), ControlClient):
                    log.warning("rank %d: under varunad %s is the daemon's rescue signal; the script's own "
                                "handler of it will not run", self.rank, RESCUE_SIGNAL.name)
                signal.signal(RESCUE_SIGNAL, self._on_rescue)
        except ValueError:   # not the main thread: the embedding program handles signals
            pass

    def _on_rescue(self, signum, frame) -> None:
        self.rescue_requested = True
        if self.abandonable:
            self.abandonable = False   # raised once: the rescue itself must not be interrupted
            raise StepAbandoned("the daemon ends this epoch (a peer was lost, or the job is cancelled or "
                                "re-planned): this worker saves the step it holds and stops")
        if not self.in_step and self.idle_rescue is not None:
            rescue, self.idle_rescue = self.idle_rescue, None   # once: it must not be interrupted either
            rescue()

    def _on_sigterm(self, signum, frame) -> None:
        log.warning("rank %d: SIGTERM: will checkpoint and stop at the next step boundary", self.rank)
        self.checkpoint_requested = self.stop_requested = True

    def poll(self) -> None:
        """Take in every request waiting on the socket (never blocks)."""
        if self._sock is None:
            return
        while self._sock.poll(0):
            data = self._sock.recv()
            try:
                msg = decode(data)
            except ProtocolError as exc:
                log.warning("rank %d dropped a malformed control message: %s", self.rank, exc)
                continue
            if getattr(msg, "job", None) != self.job or getattr(msg, "epoch", None) != self.epoch:
                log.info("rank %d ignored %s for job %s epoch %s", self.rank, type(msg).__name__,
                         getattr(msg, "job", "?"), getattr(msg, "epoch", "?"))
                continue
            if isinstance(msg, CheckpointNow):
                self.checkpoint_requested = True
            elif isinstance(msg, StopWorkers):
                self.stop_requested = True
                self.checkpoint_requested |= msg.checkpoint
            else:
                log.warning("rank %d ignored unexpected %s", self.rank, type(msg).__name__)

    def clear(self) -> None:
        self.checkpoint_requested = False

    def progress(self, step: int, loss: float, samples_per_s: float, busy_fraction: float,
                 peak_bytes: int = 0, compute_s: float = 0.0) -> None:
        # A non-finite loss is reported as it is: the step was taken (skipped by agreement), and a
        # job whose every step diverged once reported none, so the leader restarted it as stuck.
        # A zero-length timing (inf, nan) is a measurement missing: 0, which every reader reads so.
        def rate(x: float) -> float:
            return max(0.0, x) if math.isfinite(x) else 0.0
        self._send(WorkerProgress(job=self.job, epoch=self.epoch, rank=self.rank, step=step, loss=float(loss),
                                  samples_per_s=rate(samples_per_s), busy_fraction=min(1.0, rate(busy_fraction)),
                                  peak_bytes=max(0, peak_bytes), compute_s=rate(compute_s)))

    def checkpointed(self, step: int, path: str, stalled_s: float) -> None:
        self._send(WorkerCheckpointed(job=self.job, epoch=self.epoch, rank=self.rank, step=step, path=path,
                                      stalled_s=max(0.0, stalled_s)))

    def store_outage(self, since: int, error: str) -> None:
        """Tell the daemon the store refuses this worker's writes since the checkpoint of `since`."""
        self._send(WorkerStoreOutage(job=self.job, epoch=self.epoch, rank=self.rank, step=since, failing=True,
                                     error=error[-4096:]))

    def store_recovered(self, since: int) -> None:
        """The store took a write again (the outage that began at `since` is over)."""
        self._send(WorkerStoreOutage(job=self.job, epoch=self.epoch, rank=self.rank, step=since, failing=False,
                                     error=""))

    def rescuing(self, step: int) -> None:
        """Tell the daemon this worker is saving `step` from memory: it waits for that before SIGKILL."""
        self._send(WorkerRescuing(job=self.job, epoch=self.epoch, rank=self.rank, step=step))

    def _send(self, msg) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:   # the daemon is gone or slow; progress is best effort
            log.debug("rank %d: control socket full, dropped %s", self.rank, type(msg).__name__)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            terminate(self._ctx)   # waits for the closed sockets' queues, each within its linger
            # Nothing is rescued any more. The interpreter's finalisation puts a Python-handled
            # signal back to its default, which for this one ends the process: a worker that
            # exits with its own status (a script's error) while the daemon stops the epoch
            # would die "killed by SIGUSR1" instead, and its error would lose its exit code.
            with contextlib.suppress(ValueError):   # not the main thread
                if signal.getsignal(RESCUE_SIGNAL) == self._on_rescue:
                    signal.signal(RESCUE_SIGNAL, signal.SIG_IGN)
