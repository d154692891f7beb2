"""Rehearse a preemption on your own job: ``varunactl kill VM --at-step N [--notice]`` on a local ring.

It waits until the job has trained N steps, then ends daemon VM the way a spot VM ends: SIGKILL of
its whole process group (the daemon and its workers at once, no goodbye: its peers' connections
break and its lease runs out), or with ``--notice`` SIGTERM, the preemption notice a cloud sends
before it takes a VM back (the daemon checkpoints its workers and leaves). It then follows the job
until the new plan trained its first step and prints the morph and where it resumed::

    killed    vm2 (pid 4242, and its workers) once llama reported step 30: SIGKILL, as a VM that vanished
    morph 2x1 -> 1x1 (stopped, re-planned in 5.2s, from the checkpoint of step 30): vm2 was lost ...
    resumed   at step 30 in epoch 57 as 1x1

The ring's daemons and their process ids come from ``ring.json`` (varunad.ctl.local); the job's
progress from etcd, read as `varunactl status` reads it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Any, TextIO

from varunad.control.status import UnknownJob, job_queue, job_status
from varunad.ctl import local
from varunad.ctl.commands import CtlError
from varunad.ctl.progress import morph_line
from varunad.store.contract import Store
from varunad.store.keys import Keys

__all__ = ["kill_at_step", "local_ring"]

_TERMINAL = ("done", "failed", "cancelled")
_LIVE = ("running", "morphing")


def local_ring(state_dir: str | None) -> local.Ring:
    """The local ring that is up in `state_dir`, else CtlError saying what `kill` needs."""
    ring = local.read_ring(state_dir)
    if ring is None or not local.alive(ring.etcd_proc):
        raise CtlError(f"no local ring is up in {state_dir or local.default_dir()}: `kill` rehearses a preemption "
                       "on a ring of `varunactl up N` (on real VMs, stop one from your cloud's console)")
    return ring


async def _the_job(store: Store, keys: Keys, job: str | None, deadline: float, interval: float) -> str:
    """The job to rehearse on: `job`, else the one running (waiting for a queued one to start)."""
    while True:
        rows = await job_queue(store, keys)
        if job is not None:
            if not any(j["job"] == job for j in rows):
                raise CtlError(f"no job named {job} (see `varunactl jobs`)")
            return job
        live = [j["job"] for j in rows if j["state"] in _LIVE]
        if live:
            return live[0]
        if not any(j["state"] == "queued" for j in rows):
            raise CtlError("no job is running or queued: submit one first (`varunactl submit ...`), then kill")
        if time.monotonic() > deadline:
            raise CtlError("no job started running in time; see `varunactl jobs`")
        await asyncio.sleep(interval)


async def _at_step(store: Store, keys: Keys, job: str, step: int, deadline: float, interval: float
                   ) -> dict[str, Any]:
    """The job's status once it is running with at least `step` steps trained."""
    while True:
        doc = await job_status(store, keys, job)
        if doc["state"] in _TERMINAL:
            raise CtlError(f"{job} is {doc['state']} at step {doc['step']}, before step {step}: submit it with more "
                           f"--steps, or kill at an earlier step")
        if doc["state"] == "running" and doc["step"] >= step:
            return doc
        if time.monotonic() > deadline:
            raise CtlError(f"{job} did not reach step {step} in time (it is at step {doc['step']}, {doc['state']})")
        await asyncio.sleep(interval)


async def kill_at_step(store: Store, keys: Keys, vm: str, step: int, *, job: str | None = None,
                       notice: bool = False, state_dir: str | None = None, timeout: float = 600.0,
                       interval: float = 0.2, out: TextIO = sys.stdout) -> int:
    """Wait for `job` (default: the running one) to train `step` steps, end daemon `vm` of the local
    ring in `state_dir` (SIGKILL of its group; SIGTERM with `notice`) and follow the job until the
    next plan trained a step. Returns 0 once it resumed (or finished), 1 if it failed or was cancelled."""
    if step < 0:
        raise CtlError(f"--at-step must be 0 or more, got {step}")
    local_ring(state_dir).daemon(vm)   # refuses a name the ring does not have, before any waiting
    deadline = time.monotonic() + timeout
    job = await _the_job(store, keys, job, deadline, interval)
    doc = await _at_step(store, keys, job, step, deadline, interval)
    members = doc["plan"].get("members") or []
    if vm not in members:
        raise CtlError(f"{vm} runs no worker of {job} (its plan runs on {', '.join(members) or 'no VM'}): killing it "
                       f"would not disturb the job; kill one of those")
    before = len(doc["morphs"])
    rec = local.kill_daemon(vm, state_dir, signal.SIGTERM if notice else signal.SIGKILL)
    how = ("SIGTERM, as a preemption notice: it checkpoints its workers and leaves" if notice else
           "SIGKILL, as a VM that vanished")
    # the status trails the workers by the daemons' reporting interval: the job stood at least there
    print(f"killed    {vm} (pid {rec.pid}, and its workers) once {job} reported step {doc['step']}: {how}", file=out,
          flush=True)
    while True:
        try:
            doc = await job_status(store, keys, job)
        except UnknownJob as exc:
            raise CtlError(str(exc)) from None
        new = doc["morphs"][before:]
        ran = doc.get("epochs") or {}
        if new and str(new[-1]["to_epoch"]) in ran:
            for m in new:
                print(morph_line(m), file=out)
            last = new[-1]
            print(f"resumed   at step {ran[str(last['to_epoch'])][0]} in epoch {last['to_epoch']} as {last['to']}",
                  file=out, flush=True)
            return 0
        if doc["state"] in _TERMINAL:
            print(f"{job} is {doc['state']} at step {doc['step']}: {doc['reason']}", file=out, flush=True)
            return 0 if doc["state"] == "done" else 1
        if time.monotonic() > deadline:
            raise CtlError(f"{job} did not resume within {timeout:g}s of the kill; see `varunactl status {job}`")
        await asyncio.sleep(interval)
