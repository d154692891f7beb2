"""What a failed worker's error means for its job: fail now, or start the same work again.

The leader asks only after it has stopped the epoch and pinged its members: a failure on an
epoch that lost a VM is the VM's doing and is never counted against the script. Otherwise

* ``fail``: the error cannot go away by starting again: a ``ConfigError``/``PartitionError``
  (the script and the job disagree), a ``SyntaxError`` or missing import, a script that ended on
  its own before the job's last step (``ended_early``), or any error that repeats word for word
  the one that ended the previous attempt (a store path's epoch or checkpoint number aside);
* ``outage``: the checkpoint store refused a write (full, over quota, read-only, I/O errors): the
  job is fine and starts again, but the attempt is not counted against ``max_restarts``, because
  a full disk can last longer than any budget of restarts and says nothing about the script;
* ``memory``: a stage ran out of memory (the engine's ``StageOutOfMemoryError``, CUDA's
  ``OutOfMemoryError``, a ``MemoryError``, or the kernel's OOM killer as the daemon saw it): the
  same plan would run out again, so the leader re-plans with less of that slot kind's memory
  counted as usable (``memory_backoff``); counted against ``max_restarts``;
* ``retry``: it looks transient (a peer's connection broke, a timeout), a signal ended the
  worker (a kill -9 from outside, however often), or it is new, so one
  fresh start shows whether it repeats.

``cause`` is the line that says what went wrong (the exception that ended the script, without
torch.distributed's ``[rankN]:`` prefix): what the leader compares between attempts and what the
job's reason leads with. The raw text stays in the job's ``error`` and ``varunactl logs``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DETERMINISTIC", "MemoryBackoff", "cause", "classify", "ended_early", "is_out_of_memory",
           "is_store_outage", "is_transient", "memory_backoff"]

# Exceptions that a fresh start on the same script, spec and fleet raises again.
DETERMINISTIC = ("ConfigError", "PartitionError", "SyntaxError", "IndentationError", "ModuleNotFoundError",
                 "ImportError", "JobSpecError", "BundleError")
_TRANSIENT = re.compile(
    r"closed by peer|connection (reset|refused|closed)|broken pipe|timed? ?out|timeout|host unreachable|"
    r"no route to host|did not reach a first step|ZMQError|WorkerError|got no \w+ for micro-batch|gloo|NCCL|"
    r"ECONNRESET|EPIPE", re.IGNORECASE)
# the numbers of a store's paths aside: the same failure names the epoch or checkpoint it struck (a
# probe's store that could not be created failed "could not write <store>/epochs/55.json", then
# ".../67.json", and used up every restart instead of failing at the second). Other numbers stay:
# an exit code, a pid, an errno or a stalled epoch's step tell two failures apart.
_STORE_NUMBERS = re.compile(r"(?<=/epochs/)\d+(?=\.json)|(?<=varuna_ckpt_)\d+")
# trainer.errors.StoreOutage, or an older worker's checkpoint error with the store's own words
_OUTAGE = re.compile(r"^((?:[A-Za-z_]\w*\.)*StoreOutage\b|(CheckpointError|OSError)\b.*(No space left on device|Disk quota exceeded|"
                     r"Read-only file system|Input/output error))")
# the engine's error, CUDA's, Python's, and the supervisor's words for a worker the kernel's OOM killer ended
_OUT_OF_MEMORY = re.compile(r"\b(StageOutOfMemoryError|OutOfMemoryError|MemoryError)\b|OOM killer")
_MEASURED_PEAK = re.compile(r"measured peak ([\d.]+) MB")
_RANK_ON = re.compile(r"^rank (\d+) on \S+ ")
# each re-plan after running out counts on this much less at most (a peak above the estimate, more)
BACKOFF = 0.8
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
# a worker a signal ended (not the OOM killer, which is `memory`): someone or something outside the
# script did it, however often; never "the same error again"
_SIGNALLED = re.compile(r"^rank \d+ on \S+ killed by SIG[A-Z0-9]+\b")
# `ended_early`'s words: a script that ended on its own before the job's last step does so again
_ENDED_EARLY = re.compile(r"^the script ended at step \d+ of \d+,")
_EXC_NAME = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception))\b")


def cause(summary: str) -> str:
    """The part of ``leader.error_summary``'s line after the worker's name: "rank 0 on vm1 exited
    with code 1: ValueError: boom" -> "ValueError: boom" (module path of the class dropped)."""
    text = summary.split(": ", 1)[1] if re.match(r"rank \d+ on \S+ ", summary) and ": " in summary else summary
    text = _RANK_PREFIX.sub("", text.strip())
    m = _EXC_NAME.match(text)
    return m.group(1) + text[m.end():] if m else text


def ended_early(reached: int, steps: int) -> str:
    """The cause of a job whose script ended (exit code 0) after ``reached`` of its ``steps``."""
    return (f"the script ended at step {reached} of {steps}, before the job's last step "
            "(loop `while model.iteration < job_setting('steps', ...)`)")


def is_signalled(summary: str) -> bool:
    """Whether a signal from outside the script ended the worker (not the OOM killer)."""
    return bool(_SIGNALLED.search(summary))


def is_store_outage(summary: str) -> bool:
    """Whether the failure with ``summary`` (error_summary's line) is the checkpoint store's doing."""
    return bool(_OUTAGE.match(cause(summary)))


def is_out_of_memory(summary: str) -> bool:
    """Whether the failure with ``summary`` (error_summary's line) is a stage out of memory."""
    return bool(_OUT_OF_MEMORY.search(summary))


def is_transient(summary: str) -> bool:
    """Whether the failure with ``summary`` reads like a consequence (a peer's connection broke, a
    timeout) rather than a cause: when one worker raises, its peers fail next in these words."""
    return bool(_TRANSIENT.search(cause(summary)))


def classify(summary: str, previous: str | None) -> str:
    """``fail``, ``outage``, ``memory`` or ``retry`` for a failure with ``summary`` (error_summary's
    line) when the previous attempt of the same job ended with ``previous`` (its summary; None on a
    first failure)."""
    if is_store_outage(summary):
        return "outage"
    if is_out_of_memory(summary):
        return "memory"
    now = cause(summary)
    m = _EXC_NAME.match(now)
    if (m and m.group(1) in DETERMINISTIC) or _ENDED_EARLY.match(now):
        return "fail"
    if _TRANSIENT.search(now) or is_signalled(summary):
        return "retry"
    if previous is not None and _STORE_NUMBERS.sub("N", cause(previous)) == _STORE_NUMBERS.sub("N", now):
        return "fail"
    return "retry"


@dataclass(frozen=True, slots=True)
class MemoryBackoff:
    """What the leader does after a stage ran out: count on `scale` of a `kind` slot's memory."""

    kind: str
    scale: float
    stage: int | None
    words: str   # the stage, the planner's estimate, the measured peak and the new share, for the job's reason


def memory_backoff(summary: str, plan: Mapping[str, Any], scales: Mapping[str, float],
                   peaks: Mapping[int, int]) -> MemoryBackoff | None:
    """The slot kind of the failed worker of ``summary`` in ``plan`` (the job state's plan: its
    ``ranks``, ``stage_kinds``, ``stage_memory``, ``stage_capacity``) and the share of its memory
    to plan with from now on: the current share (``scales``) times the estimate over the measured
    peak (from the error's words or ``peaks``, rank -> the peak it last reported), at most BACKOFF.
    None when the summary names no rank of the plan."""
    m = _RANK_ON.match(summary)
    ranks, kinds = plan.get("ranks"), plan.get("stage_kinds") or []
    if m is None or not isinstance(ranks, list):
        return None
    rank = int(m.group(1))
    stage = next((s for s, row in enumerate(ranks) if isinstance(row, list) and rank in row), None)
    if stage is None or stage >= len(kinds):
        return None
    kind = kinds[stage]
    estimates, capacity = plan.get("stage_memory") or [], plan.get("stage_capacity") or []
    estimate = estimates[stage] if stage < len(estimates) else None
    said = _MEASURED_PEAK.search(summary)
    peak = int(float(said.group(1)) * 1e6) if said else peaks.get(rank) or None
    factor = BACKOFF
    if estimate and peak and peak > estimate:
        factor = min(BACKOFF, estimate / peak)
    scale = max(0.05, scales.get(kind, 1.0) * factor)
    mb = lambda x: "unknown" if not x else f"{x / 1e6:.0f} MB"  # noqa: E731
    usable = capacity[stage] if stage < len(capacity) else None
    words = (f"stage {stage} ({kind}) ran out of memory: the plan estimated {mb(estimate)} of {mb(usable)} usable, "
             f"measured peak {mb(peak)}; re-planning with {100 * scale:.0f}% of a {kind} slot's memory counted")
    return MemoryBackoff(kind, scale, stage, words)
