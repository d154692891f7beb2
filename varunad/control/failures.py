"""What a failed worker's error means for its job: fail now, or start the same work again.

The leader asks only after it has stopped the epoch and pinged its members: a failure on an
epoch that lost a VM is the VM's doing and is never counted against the script. Otherwise

* ``fail``: the error cannot go away by starting again: a ``ConfigError``/``PartitionError``
  (the script and the job disagree), a ``SyntaxError`` or missing import, or any error that
  repeats word for word the one that ended the previous attempt;
* ``outage``: the checkpoint store refused a write (full, over quota, read-only, I/O errors): the
  job is fine and starts again, but the attempt is not counted against ``max_restarts``, because
  a full disk can last longer than any budget of restarts and says nothing about the script;
* ``retry``: it looks transient (a peer's connection broke, a timeout), or it is new, so one
  fresh start shows whether it repeats.

``cause`` is the line that says what went wrong (the exception that ended the script, without
torch.distributed's ``[rankN]:`` prefix): what the leader compares between attempts and what the
job's reason leads with. The raw text stays in the job's ``error`` and ``varunactl logs``.
"""

from __future__ import annotations

import re

__all__ = ["DETERMINISTIC", "cause", "classify", "is_store_outage"]

# Exceptions that a fresh start on the same script, spec and fleet raises again.
DETERMINISTIC = ("ConfigError", "PartitionError", "SyntaxError", "IndentationError", "ModuleNotFoundError",
                 "ImportError", "JobSpecError", "BundleError")
_TRANSIENT = re.compile(
    r"closed by peer|connection (reset|refused|closed)|broken pipe|timed? ?out|timeout|host unreachable|"
    r"no route to host|did not reach a first step|ZMQError|WorkerError|got no \w+ for micro-batch|gloo|NCCL|"
    r"ECONNRESET|EPIPE", re.IGNORECASE)
# trainer.errors.StoreOutage, or an older worker's checkpoint error with the store's own words
_OUTAGE = re.compile(r"^((?:[A-Za-z_]\w*\.)*StoreOutage\b|(CheckpointError|OSError)\b.*(No space left on device|Disk quota exceeded|"
                     r"Read-only file system|Input/output error))")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
_EXC_NAME = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception))\b")


def cause(summary: str) -> str:
    """The part of ``leader.error_summary``'s line after the worker's name: "rank 0 on vm1 exited
    with code 1: ValueError: boom" -> "ValueError: boom" (module path of the class dropped)."""
    text = summary.split(": ", 1)[1] if re.match(r"rank \d+ on \S+ ", summary) and ": " in summary else summary
    text = _RANK_PREFIX.sub("", text.strip())
    m = _EXC_NAME.match(text)
    return m.group(1) + text[m.end():] if m else text


def is_store_outage(summary: str) -> bool:
    """Whether the failure with ``summary`` (error_summary's line) is the checkpoint store's doing."""
    return bool(_OUTAGE.match(cause(summary)))


def classify(summary: str, previous: str | None) -> str:
    """``fail``, ``outage`` or ``retry`` for a failure with ``summary`` (error_summary's line) when the
    previous attempt of the same job ended with ``previous`` (its summary; None on a first failure)."""
    if is_store_outage(summary):
        return "outage"
    now = cause(summary)
    m = _EXC_NAME.match(now)
    if m and m.group(1) in DETERMINISTIC:
        return "fail"
    if _TRANSIENT.search(now):
        return "retry"
    if previous is not None and cause(previous) == now:
        return "fail"
    return "retry"
