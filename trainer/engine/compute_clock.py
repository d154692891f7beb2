"""How long a stage computed in one step: its own forward, backward and recompute time, without
the time it stood waiting for a peer (a pipeline receive) or spent in the stage-wide handlers (the
gradient all-reduce and the optimizer step, both of which wait for the slowest replica).

The daemons' leader compares this figure across slots (`varunad.control.speeds`): a slot that
computes slower than the others of its kind is a straggler, and waiting time must not make its
healthy peers look slow too. On a GPU the host runs ahead of the kernels, so a handler first waits
for this stage's own queued kernels (its compute stream only: the collectives' stream may be
waiting on a slow peer) and that wait counts as compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["ComputeClock"]


class ComputeClock:
    """Started when a step's actions start; `apart` wraps the handlers whose time is not compute."""

    def __init__(self, channel, device: torch.device) -> None:
        self._channel = channel
        self._cuda = device.type == "cuda"
        self._device = device
        self._start = time.perf_counter()
        self._waited = self._wait_s()
        self._apart_s = 0.0
        self._apart_waited = 0.0

    def _wait_s(self) -> float:
        return self._channel.wait_s if self._channel is not None else 0.0

    def apart(self, handler: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            if self._cuda:
                torch.cuda.current_stream(self._device).synchronize()
            start, waited = time.perf_counter(), self._wait_s()
            try:
                handler()
            finally:
                self._apart_s += time.perf_counter() - start
                self._apart_waited += self._wait_s() - waited
        return timed

    def computed_s(self) -> float:
        """Seconds of compute since the clock started (never below 0)."""
        total = time.perf_counter() - self._start
        waited = self._wait_s() - self._waited - self._apart_waited
        return max(0.0, total - waited - self._apart_s)
