"""Whether the kernel's OOM killer ended a worker: a SIGKILL the daemon did not send, while the
kernel's count of OOM kills went up.

The count is /proc/vmstat's `oom_kill` (Linux 4.13+), which counts every OOM kill on the host,
a cgroup's memory limit included (the VM's, a container's, or one set for a test). A worker that
dies of SIGKILL while it rose is reported as out of memory; the leader then re-plans with less of
its slot kind's memory (varunad.control.failures). Another process OOM-killed at the same moment
would be taken for the worker's: a rare misreading whose cost is one plan with a smaller memory
share, never a lost job.
"""

from __future__ import annotations

__all__ = ["OOM_WORDS", "kernel_oom_kills"]

# what the supervisor says of such a worker; varunad.control.failures classifies on "OOM killer"
OOM_WORDS = "killed by the kernel's OOM killer (SIGKILL): out of memory"


def kernel_oom_kills(path: str = "/proc/vmstat") -> int | None:
    """The host's count of OOM kills so far; None where the kernel does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
