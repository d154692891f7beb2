"""Whether a ring's spare worker processes (trainer.spare) have finished their imports: the steady
state between morphs, which benchmarks and timing-sensitive tests start their events in."""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from support.ring import Ring


def waiting_spare(p: psutil.Process) -> bool:
    """A trainer.spare process still waiting for its order on a pipe (one that runs a worker reads
    /dev/null)."""
    try:
        return "trainer.spare" in " ".join(p.cmdline()) and os.readlink(f"/proc/{p.pid}/fd/0").startswith("pipe:")
    except (psutil.Error, OSError):
        return False


def spares_settled(ring: Ring) -> bool:
    """Whether every waiting spare of the ring's live daemons used no CPU in the last 0.3 s: right
    after an epoch's first step, the next epoch's spares are still importing."""
    spares = []
    for d in ring.daemons.values():
        if d.alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                spares += [p for p in psutil.Process(d.proc.pid).children(recursive=True) if waiting_spare(p)]
    before = [p.cpu_times() for p in spares]
    time.sleep(0.3)
    with contextlib.suppress(psutil.NoSuchProcess):
        return all(p.cpu_times() == b for p, b in zip(spares, before, strict=True))
    return False
