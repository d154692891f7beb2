"""How the supervisor ends its workers: a stop with a grace period, the rescue signal for a broken
epoch, SIGKILL at the deadline, and the fence when this daemon lost etcd for longer than its lease.

A stop request gives the workers a grace period (``stop_grace`` with a checkpoint,
``abort_grace`` without: a worker blocked on a dead peer never reaches a step boundary), then
their process groups are SIGKILLed. A stop without a checkpoint means the epoch is broken: each
worker that has trained a step gets the rescue signal (``RESCUE_SIGNAL``), abandons its step and
saves what it holds from memory (trainer.checkpoint.rescue); one that says it is doing so
(``WorkerRescuing``) is given ``stop_grace`` instead, and a new epoch's workers start only once it
is done.

``WorkerStopping`` is a part of ``varunad.node.supervisor.Supervisor``: it acts on its table of
live workers, their control line (``varunad.node.control_channel.WorkerLine``), its settings and
its reporter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from protocol.messages import CheckpointNow, StopWorkers, WorkerRescuing, encode
from trainer.engine.control import RESCUE_SIGNAL

if TYPE_CHECKING:
    from varunad.node.supervisor import _SupervisedWorker

__all__ = ["WorkerStopping"]

log = logging.getLogger("varunad.node.supervisor")   # the supervisor's log: its lines keep their logger name


class WorkerStopping:
    def stop(self, job: str | None, epoch: int | None, *, checkpoint: bool, reason: str,
             grace: float | None = None) -> int:
        """Ask the workers (of ``job``/``epoch``, or all) to stop; SIGKILL those alive after the grace
        (by default stop_grace with a checkpoint, abort_grace without; 0 kills them now)."""
        targets = [w for w in self.alive() if (job is None or w.job == job) and (epoch is None or w.epoch <= epoch)]
        calibrating = [w for w in targets if w.profile_path is not None]
        if calibrating:
            # a calibration run has nothing to save and ignores a stop: waited for, it held a
            # preempted VM's daemon for the whole grace (a probe: `down` had to SIGKILL it)
            for w in calibrating:
                w.killed_by_daemon = True
                if w.proc is not None:
                    w.proc.kill_group()
            log.info("%s: killed %d calibration run(s) (%s)", self.name, len(calibrating), reason)
            targets = [w for w in targets if w.profile_path is None]
        if grace is None:
            grace = self.config.stop_grace if checkpoint else self.config.abort_grace
        if grace <= 0:
            self._rescue_or_kill(targets, reason)
            return len(targets) + len(calibrating)
        for w in targets:
            msg = StopWorkers(job=w.job, epoch=w.epoch, reason=str(reason)[:1000], checkpoint=checkpoint)
            w.stop_request = encode(msg)
            self.line.deliver(w, msg)
            if not checkpoint:
                self._signal_rescue(w)
            if w.rescuing is not None:
                continue   # its timer is stop_grace already (_on_rescuing)
            if w.kill_task is None or checkpoint is False:
                if w.kill_task is not None:
                    w.kill_task.cancel()
                w.kill_task = asyncio.get_running_loop().create_task(self._kill_after(w, grace))
        if targets:
            log.info("%s: asked %d worker(s) to stop (%s; checkpoint=%s, SIGKILL after %.0fs)", self.name,
                     len(targets), reason, checkpoint, grace)
        return len(targets) + len(calibrating)

    def _rescue_or_kill(self, targets: list[_SupervisedWorker], reason: str) -> None:
        """A broken epoch: a worker that trained a step may hold state newer than the store's, so it
        gets the rescue signal and ``abort_grace`` (``stop_grace`` once it says it is saving);
        one that never reported a step has nothing to save and is SIGKILLed now."""
        rescued = 0
        for w in targets:
            if self._signal_rescue(w):
                rescued += 1
                if w.kill_task is None:
                    w.kill_task = asyncio.get_running_loop().create_task(
                        self._kill_after(w, self.config.abort_grace))
                continue
            w.killed_by_daemon = True
            if w.proc is not None:
                w.proc.kill_group()
        if targets:
            log.info("%s: %d worker(s) of a broken epoch (%s): %d asked to save their state from memory, "
                     "the others killed", self.name, len(targets), reason, rescued)

    def _signal_rescue(self, w: _SupervisedWorker) -> bool:
        """Send the rescue signal to a worker that has trained a step (only it has state to save)."""
        if w.proc is None or (w.step < 0 and w.rescuing is None):
            return False
        w.proc.signal(RESCUE_SIGNAL)
        return True

    def _on_rescuing(self, w: _SupervisedWorker, msg: WorkerRescuing) -> None:
        w.rescuing = msg.step
        log.info("%s: rank %d of %s epoch %d is saving step %d from memory (SIGKILL in %.0fs at the latest)",
                 self.name, w.rank, w.job, w.epoch, msg.step, self.config.stop_grace)
        if w.kill_task is not None:
            w.kill_task.cancel()
        w.kill_task = asyncio.get_running_loop().create_task(self._kill_after(w, self.config.stop_grace))

    async def _rescues_done(self) -> None:
        """Wait for the workers saving a broken epoch's state (bounded: they are SIGKILLed at their
        deadline): the new epoch must find their checkpoint whole when it chooses where to resume."""
        saving = [w for w in self.alive() if w.rescuing is not None]
        if not saving:
            return
        log.info("%s: waiting for %d worker(s) saving step %s from memory before starting the new epoch",
                 self.name, len(saving), sorted({w.rescuing for w in saving}))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.stop_grace + 1.0
        while any(w.alive for w in saving) and loop.time() < deadline:
            self._exited.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self._exited.wait()

    def checkpoint_now(self, job: str, epoch: int, reason: str) -> None:
        for w in self.alive():
            if w.job == job and w.epoch == epoch:
                self.line.deliver(w, CheckpointNow(job=job, epoch=epoch, reason=str(reason)[:1000]))

    async def _kill_after(self, w: _SupervisedWorker, grace: float) -> None:
        await asyncio.sleep(grace)
        if w.alive and w.proc is not None:
            log.warning("%s: rank %d of %s epoch %d did not stop within %.0fs; SIGKILL", self.name, w.rank, w.job,
                        w.epoch, grace)
            w.killed_by_daemon = True
            w.proc.kill_group()

    def progressing(self, limit: float) -> bool:
        """Whether a live worker reported a step recently: within twice its last step interval
        (at least ``limit``/3, at most ``limit`` seconds), or within ``limit`` when that step was
        one the job checkpoints after (the write stands training still for longer than a step)."""
        now = time.time()
        every = getattr(self, "checkpoint_every", 0)
        for w in self.alive():
            p = self.reporter.progress.get(w.rank)
            if p is None:
                continue
            writing = every > 0 and (p.step + 1) % every == 0
            window = limit if writing else min(limit, max(limit / 3, 2 * self._step_interval.get(w.rank, 0.0)))
            if now - p.at <= window:
                return True
        return False

    def fence(self, reason: str) -> list[_SupervisedWorker]:
        """This daemon lost etcd for longer than its lease: its workers can be in no valid epoch
        any more (the fleet may have planned without them). Kill them now, and drop the progress
        not yet written: it belongs to an epoch that may be over."""
        killed = self.kill_now()
        self.spares.close()   # a fenced VM runs nothing of the fleet's, not even an idle spare
        self.reporter.forget_progress()
        if killed:
            log.warning("%s: killed %d worker(s): %s", self.name, len(killed), reason)
        return killed

    def kill_now(self) -> list[_SupervisedWorker]:
        """SIGKILL every live worker's process group; returns them."""
        alive = self.alive()
        for w in alive:
            w.killed_by_daemon = True
            if w.proc is not None:
                w.proc.kill_group()
        return alive

    async def kill_all(self, reason: str) -> None:
        """SIGKILL every live worker now and wait for them to be reaped."""
        alive = self.kill_now()
        if alive:
            log.warning("%s: killed %d worker(s): %s", self.name, len(alive), reason)
            await self.wait_all_exited(10.0)
