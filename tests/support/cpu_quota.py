"""A slow VM on one machine: a fresh cgroup v1 CPU-controller child with a CFS quota, a fraction of
one core, that a process (a ring's daemon) and the children it starts afterwards (its workers,
its spares) run under.

    group = CpuQuota.create(0.25)      # None where no writable cgroup v1 cpu controller exists
    if group is None:
        pytest.skip("no writable cgroup v1 cpu controller here")
    with group:
        group.add(daemon.proc.pid)     # before the job: the workers it starts inherit the group
        ...
        group.set(None)                # unlimited again; group.set(0.25): a VM that turns slow mid-job

The group is made under this process's own cgroup of the cpu hierarchy (/proc/self/cgroup, as
tests/integration/test_memory_workers.py makes its memory child). A quota caps the group's
processes together: the daemon, its workers and spares share it. Writing a pid into a group
moves that process only: its children started before stay where they are (``add(pid,
descendants=True)`` moves them too). On leaving the ``with`` (or ``close()``) the processes still
in it go back to the parent group and the group is removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CpuQuota", "cpu_quota", "cpu_hierarchy"]

_MOUNTINFO = Path("/proc/self/mountinfo")
_CGROUP = Path("/proc/self/cgroup")

PERIOD_US = 4000   # the CFS period of a capped group (the kernel's default is 100 ms)


def cpu_hierarchy() -> Path | None:
    """This process's cgroup directory in the cgroup v1 hierarchy that has the cpu controller
    (mounted alone, or with cpuacct), or None (cgroup v2 only, no such mount, unreadable)."""
    try:
        mounts = _MOUNTINFO.read_text().splitlines()
        own = _CGROUP.read_text().splitlines()
    except OSError:
        return None
    mount = None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        if "cpu" in tail[2].split(","):   # the super options name the controllers
            mount = (fields[3], Path(fields[4]))   # (the hierarchy's root this mount shows, where)
            break
    if mount is None:
        return None
    root, point = mount
    for line in own:
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            path = parts[2]
            break
    else:
        return None
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):]
    here = point / path.lstrip("/")
    return here if (here / "cpu.cfs_quota_us").exists() else None


class CpuQuota:
    """One cgroup v1 cpu group made for a test or a benchmark; see the module's docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parent = path.parent

    @classmethod
    def create(cls, cores: float | None = None, *, name: str | None = None) -> CpuQuota | None:
        """A new group under this process's own, holding at most ``cores`` of one core's time
        (0.25: a quarter of one core; None: unlimited), or None where that cannot be done."""
        parent = cpu_hierarchy()
        if parent is None:
            return None
        base = name or f"varunad-cpu-{os.getpid()}"
        for i in range(100):
            path = parent / (base if i == 0 else f"{base}-{i}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
            except OSError:
                return None
        else:
            return None
        group = cls(path)
        try:
            group.set(cores)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return group

    # -- the quota -----------------------------------------------------------------------------------

    @property
    def period_us(self) -> int:
        return int((self.path / "cpu.cfs_period_us").read_text())

    @property
    def quota_us(self) -> int:
        """The group's quota per period in microseconds, -1 when unlimited."""
        return int((self.path / "cpu.cfs_quota_us").read_text())

    @property
    def cores(self) -> float | None:
        """The quota as a fraction of one core, None when unlimited."""
        quota = self.quota_us
        return None if quota < 0 else quota / self.period_us

    def set(self, cores: float | None) -> None:
        """Cap the group at ``cores`` of one core (a fraction of the period; 1.5: one and a half
        cores), None to lift the cap. Takes effect at once for the processes in it."""
        if cores is None:
            (self.path / "cpu.cfs_quota_us").write_text("-1")
            return
        if not cores > 0:
            raise ValueError(f"a CPU quota of {cores} cores: give a positive fraction, or None for unlimited")
        # A short period: a VM with a slower core is slow at every instant, while a quota per the
        # default 100 ms lets a burst of a few ms (a tiny model's step) run at full speed and then
        # stops the group for the rest of the period, outside the compute a worker measures.
        period = max(PERIOD_US, round(1000 / cores))   # the kernel refuses a quota under 1 ms
        (self.path / "cpu.cfs_period_us").write_text(str(period))
        (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * period))))

    def throttled(self) -> dict[str, int]:
        """cpu.stat: nr_periods, nr_throttled, throttled_time (ns), as the kernel counts them."""
        out = {}
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
        return out

    # -- its processes ---------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def add(self, pid: int, *, descendants: bool = False) -> None:
        """Move a process into the group (all its threads); the children it starts from now on
        start in it. ``descendants``: its children, their children... started before, too."""
        for p in [pid, *(_descendants(pid) if descendants else [])]:
            try:
                (self.path / "cgroup.procs").write_text(str(p))
            except ProcessLookupError:   # ESRCH: it ended meanwhile
                continue

    def close(self) -> None:
        """Put the processes still in the group back into the parent, then remove the group."""
        for _ in range(50):
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    (self.parent / "cgroup.procs").write_text(str(pid))
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                continue   # a child started between the listing and the rmdir: move it too
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        try:
            cores = self.cores
        except OSError:
            return f"CpuQuota({self.path}, removed)"
        return f"CpuQuota({self.path}, {'unlimited' if cores is None else f'{cores:g} cores'})"


@contextlib.contextmanager
def cpu_quota(cores: float | None = None, *, name: str | None = None) -> Iterator[CpuQuota | None]:
    """``CpuQuota.create`` as a context manager: yields None where no group can be made."""
    group = CpuQuota.create(cores, name=name)
    if group is None:
        yield None
        return
    with group:
        yield group


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` now, from /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command may hold spaces and parentheses: the ppid is the second field after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out
