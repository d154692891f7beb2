"""Bounds the daemon's local state: the bundles and worker logs of old jobs are deleted.

Every job a VM runs leaves ``STATE_DIR/bundles/<job>`` (its script directory),
``STATE_DIR/logs/<job>`` (each worker's whole output, a file per epoch) and
``STATE_DIR/staging/<job>`` (checkpoints on their way to the store). A VM image that lives
across many jobs would fill its disk with them, so when a job's files arrive on a VM, only the
``keep`` most recently used jobs stay; the running one is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path

__all__ = ["BUNDLES", "CAPTURES", "LOGS", "STAGING", "job_dir", "prune_jobs"]

log = logging.getLogger(__name__)

# What the state dir holds per job: every writer names its directory through `job_dir`, so
# pruning sees whatever a job left there.
BUNDLES, LOGS, STAGING, CAPTURES = "bundles", "logs", "staging", "captures"
_KINDS = (BUNDLES, LOGS, STAGING, CAPTURES)


def job_dir(state_dir: str | os.PathLike[str], kind: str, job: str) -> Path:
    """``STATE_DIR/<kind>/<job>``, for one of BUNDLES, LOGS, STAGING, CAPTURES."""
    if kind not in _KINDS:
        raise ValueError(f"unknown kind of job files {kind!r}; one of {_KINDS}")
    return Path(state_dir) / kind / job


def _last_used(dirs: list[Path]) -> float:
    """The newest modification time in the job's directories (a log file written to counts)."""
    newest = 0.0
    for d in dirs:
        with os.scandir(d) as entries:
            newest = max([newest, d.stat().st_mtime, *(e.stat().st_mtime for e in entries)])
    return newest


def prune_jobs(state_dir: str | os.PathLike[str], keep: int, protect: Collection[str] = ()) -> list[str]:
    """Delete the bundles and logs of all but the `keep` most recently used jobs, never one named
    in `protect`; returns the names of the jobs deleted, oldest first. A directory that cannot be
    read or removed is logged and left: housekeeping never stops a job from starting."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = Path(state_dir)
    dirs: dict[str, list[Path]] = {}
    for kind in _KINDS:
        base = root / kind   # the parent of every job_dir of this kind
        if base.is_dir():
            for d in base.iterdir():
                if d.is_dir():
                    dirs.setdefault(d.name, []).append(d)
    used = {}
    for job, paths in dirs.items():
        try:
            used[job] = _last_used(paths)
        except OSError as exc:   # vanished or unreadable: leave it to a later pass
            log.warning("housekeeping: cannot read %s: %s", paths[0], exc)
    ranked = sorted(used, key=used.__getitem__, reverse=True)
    doomed = [job for job in reversed(ranked[keep:]) if job not in protect]   # oldest first
    for job in doomed:
        for d in dirs[job]:
            try:
                shutil.rmtree(d)
            except OSError as exc:
                log.warning("housekeeping: cannot remove %s: %s", d, exc)
    if doomed:
        log.info("housekeeping: deleted the bundles and logs of %d old job(s): %s", len(doomed), ", ".join(doomed))
    return doomed
