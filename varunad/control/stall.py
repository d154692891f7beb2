"""A running epoch that stopped stepping: one of its workers is stuck.

A worker stopped (SIGSTOP, a VM's hypervisor pausing one process), deadlocked in its data loader,
or waiting on a GPU that hangs keeps its process and its daemon's lease, so neither a lost member
nor a failed worker says anything; its peers would wait out their own timeouts (ten minutes) and
a job of one worker would wait forever. The leader watches the epoch's newest step instead: when
no worker has finished a step for ``stall_timeout`` seconds, or ``STALL_FACTOR`` times the longest
wait between two steps it saw in the epoch if that is longer (a model whose steps take minutes,
a checkpoint step), the epoch is stuck and is stopped as a failed one (it counts as a restart).

Only steps count: the first step is the start timeout's (``decide``), and workers that hold their
state while the checkpoint store refuses it are paused, not stuck (``store_failing``). What a
script does between two steps (an evaluation on every rank) looks the same from here, so the
daemon's default (``--stall-timeout`` 1800 s) sits well above the workers' own peer timeouts
(600 s), which end most hangs first; the leader's watch is the backstop that also covers a job of
one worker, which has no peer to time out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STALL_FACTOR", "StepWatch"]

STALL_FACTOR = 10.0


@dataclass
class StepWatch:
    """The newest step this leader saw an epoch's workers finish, and since when."""

    epoch: int = -1
    step: int = -1
    since: float = 0.0     # when `step` was first seen
    checked: float = 0.0   # when the progress records were last read
    longest: float = 0.0   # the longest wait between two steps seen in this epoch

    def see(self, epoch: int, step: int, now: float) -> None:
        """The progress records read at ``now`` say ``epoch``'s newest step is ``step``."""
        if epoch != self.epoch:
            self.epoch, self.step, self.since, self.longest = epoch, step, now, 0.0
        elif step > self.step:
            if self.step >= 0:
                self.longest = max(self.longest, now - self.since)
            self.step, self.since = step, now
        self.checked = now

    def hold(self, now: float) -> None:
        """The workers are paused by the checkpoint store, not stuck: the wait starts again at ``now``."""
        self.since = now

    def stuck(self, epoch: int, stall_timeout: float) -> str | None:
        """Why ``epoch`` counts as stuck, or None. Measured between reads of the progress records,
        so a leader busy elsewhere for a while never takes its own absence for the workers'.
        ``stall_timeout`` 0: never."""
        if not stall_timeout or epoch != self.epoch or self.step < 0:
            return None
        limit = max(stall_timeout, STALL_FACTOR * self.longest)
        waited = self.checked - self.since
        if waited <= limit:
            return None
        return (f"no worker of epoch {epoch} finished a step in {waited:.0f}s (the last was step {self.step}; "
                f"the longest wait between two steps before was {self.longest:.1f}s): a worker is stuck "
                "(stopped, deadlocked, or waiting for something that never comes)")
