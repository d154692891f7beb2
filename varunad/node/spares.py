"""A daemon's spare worker processes (trainer.spare): one per slot, torch already imported, so
that the next epoch's worker on the slot (after a morph) starts without the import.

`fill` starts the missing ones in the environment the slots' workers start with, importing what
the job's script imports when it is known here; `run` hands a worker to its slot's spare when the
spare is alive, its start-up environment fits the worker's (`trainer.spare.fits`) and it imported
ahead for no other script, else says to start a fresh process; `wait_ready` waits until
each spare has imported what it imports ahead. A spare is the daemon's child in a session of its
own that dies with the daemon (the supervisor's `dying_with`), watched like any worker once it runs
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from trainer import spare

__all__ = ["SparePool"]

log = logging.getLogger(__name__)


class SparePool:
    def __init__(self, *, name: str, state_dir: str, enabled: bool, wrap: Callable[[list[str]], list[str]]) -> None:
        self.name, self.state_dir, self.enabled = name, state_dir, enabled
        self._wrap = wrap   # a spare's command line made to die with the daemon
        # slot -> (process, its environment, the script whose imports it imported ahead)
        self._spares: dict[int, tuple[asyncio.subprocess.Process, dict[str, str], Path | None]] = {}

    async def fill(self, slots: Iterable[int], env: Mapping[str, str], *, script: Path | None = None) -> None:
        if not self.enabled:
            return
        folder = Path(self.state_dir) / "spares"
        folder.mkdir(parents=True, exist_ok=True)
        for slot in slots:
            if slot in self._spares:
                proc, _, made_for = self._spares[slot]
                if proc.returncode is None and made_for in (None, script):
                    continue
                self._kill(self._spares.pop(slot)[0])   # dead, or holding another script's modules
            ready = self._ready_file(slot)
            ready.unlink(missing_ok=True)
            ahead = ["--imports-of", str(script)] if script is not None else []
            try:
                with open(folder / f"slot{slot}.log", "ab") as out:
                    proc = await asyncio.create_subprocess_exec(
                        *self._wrap([sys.executable, "-m", "trainer.spare", "--ready", str(ready), *ahead]),
                        cwd=self.state_dir, env=dict(env), stdin=asyncio.subprocess.PIPE, stdout=out,
                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                log.warning("%s: could not start a spare worker for slot %d: %s", self.name, slot, exc)
                return
            self._spares[slot] = (proc, dict(env), script)

    def _ready_file(self, slot: int) -> Path:
        return Path(self.state_dir) / "spares" / f"slot{slot}.ready"

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until every spare has imported what it imports ahead (or died, or `timeout`
        passed): whether all of them are ready."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = [slot for slot, (proc, _, _) in self._spares.items()
                       if proc.returncode is None and not self._ready_file(slot).exists()]
            if not waiting:
                return all(proc.returncode is None for proc, _, _ in self._spares.values())
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    async def run(self, slot: int, script: Path, args: list[str], env: dict[str, str], log_path: Path,
                  what: str) -> asyncio.subprocess.Process | None:
        """The slot's spare, now running `script`; None: start a fresh process."""
        proc, spare_env, made_for = self._spares.pop(slot, (None, {}, None))
        if proc is None:
            return None
        # a spare that imported another script's packages could hand this one a module of the same
        # name as one of its own files
        other = made_for is not None and made_for != script
        if proc.returncode is not None or proc.stdin is None or not spare.fits(spare_env, env) or other:
            self._kill(proc)
            return None
        imported = self._ready_file(slot).exists()
        order = {"script": str(script), "args": list(args), "cwd": str(script.parent), "env": env, "log": str(log_path)}
        try:
            proc.stdin.write(json.dumps(order).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except OSError as exc:   # it died in between: a fresh process it is
            log.info("%s: the spare of slot %d is gone (%s); starting %s afresh", self.name, slot, exc, what)
            self._kill(proc)
            return None
        log.info("%s: %s runs in the spare of slot %d (pid %d, %s)", self.name, what, slot, proc.pid,
                 "its imports done" if imported else "still importing")
        return proc

    def close(self) -> None:
        for proc, _, _ in self._spares.values():
            self._kill(proc)
        self._spares.clear()

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
