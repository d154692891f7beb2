"""Where varunad keeps things in etcd: every key name is built here, nowhere else.

Layout under a root prefix (default ``/varunad/``)::

    members/<name>                          one per live daemon, attached to its lease
    leader                                  name of the leader, attached to the leader's lease
    plan                                    the current plan; its mod revision is the plan epoch
    plan-writer                             who wrote it (leader, term, lease), in the plan's transaction
    revision-floor                          written over and over to move etcd's revision past the fleet's
                                            epochs after etcd's history went back (varunad.cluster.revision_floor)
    config                                  cluster-wide settings (optional)
    jobs/<id>                               job specs submitted by varunactl
    calibration/<fingerprint>/<device kind> calibrated cut-point costs
    progress/<job>/<rank>                   step, loss and throughput reported by workers
    bundles/<job>                           the job's script directory, zipped (written once by varunactl)
    signatures/<job>                        the submitter's signature of jobs/<job> (varunad.node.signing)
    state/<job>                             the job's state as the leader sees it (leader-written, fenced)
    cancel/<job>                            a cancel request (varunactl)
    workers/<member>                        a daemon's workers and how they ended (on the member's lease)
    history/<job>/<epoch>/<member>          (step, loss) pairs one daemon saw in one epoch
    logs/<job>/<member>/<seq>               chunks of the workers' output
    notes/<job>/<member>                    what a daemon's workers refused (a corrupt checkpoint), for status
    links/probe/<member>                    the leader's request that a member measure one link
    links/pair/<a>/<b>                      a measured link between members a < b

Several fleets (or several test cases) share one etcd by using different roots.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_ROOT",
    "MEMBERS",
    "LEADER",
    "PLAN",
    "PLAN_WRITER",
    "REVISION_FLOOR",
    "CONFIG",
    "JOBS",
    "CALIBRATION",
    "PROGRESS",
    "BUNDLES",
    "SIGNATURES",
    "NOTES",
    "STATE",
    "CANCEL",
    "WORKERS",
    "HISTORY",
    "LOGS",
    "LINKS",
    "Keys",
    "check_component",
]

DEFAULT_ROOT = "/varunad/"

# Names relative to the root. Directories end with "/" so that a prefix read of
# "members/" cannot also match a sibling such as "membership".
MEMBERS = "members/"
LEADER = "leader"
PLAN = "plan"
PLAN_WRITER = "plan-writer"
REVISION_FLOOR = "revision-floor"
CONFIG = "config"
JOBS = "jobs/"
CALIBRATION = "calibration/"
PROGRESS = "progress/"
BUNDLES = "bundles/"
SIGNATURES = "signatures/"
NOTES = "notes/"
STATE = "state/"
CANCEL = "cancel/"
WORKERS = "workers/"
HISTORY = "history/"
LOGS = "logs/"
LINKS = "links/"


def check_component(what: str, value: str) -> str:
    """Return ``value`` if it can be one path component of a key, else raise ValueError.

    A "/" would silently move the key into another directory (``members/a/b`` is
    seen by a prefix read of ``members/a/``), so it is refused rather than escaped.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if "/" in value:
        raise ValueError(f"{what} {value!r} contains '/'; choose a name without slashes")
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise ValueError(f"{what} {value!r} contains control characters")
    if value in (".", ".."):
        raise ValueError(f"{what} cannot be {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one root; immutable, cheap to pass around."""

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        if not (self.root.startswith("/") and self.root.endswith("/")):
            raise ValueError(
                f"key root {self.root!r} must start and end with '/', e.g. {DEFAULT_ROOT!r}"
            )

    # Directories (prefixes for reads and watches).
    @property
    def members(self) -> str:
        return self.root + MEMBERS

    @property
    def jobs(self) -> str:
        return self.root + JOBS

    @property
    def calibration(self) -> str:
        return self.root + CALIBRATION

    @property
    def progress(self) -> str:
        return self.root + PROGRESS

    # Single keys.
    @property
    def leader(self) -> str:
        return self.root + LEADER

    @property
    def plan(self) -> str:
        return self.root + PLAN

    @property
    def plan_writer(self) -> str:
        return self.root + PLAN_WRITER

    @property
    def revision_floor(self) -> str:
        return self.root + REVISION_FLOOR

    @property
    def config(self) -> str:
        return self.root + CONFIG

    def member(self, name: str) -> str:
        return self.members + check_component("member name", name)

    def job(self, job_id: str) -> str:
        return self.jobs + check_component("job id", job_id)

    def calibration_of(self, fingerprint: str) -> str:
        """Prefix of every device kind's calibration for one model fingerprint."""
        return self.calibration + check_component("model fingerprint", fingerprint) + "/"

    def calibration_entry(self, fingerprint: str, device_kind: str) -> str:
        return self.calibration_of(fingerprint) + check_component("device kind", device_kind)

    def progress_of(self, job_id: str) -> str:
        """Prefix of every rank's progress for one job."""
        return self.progress + check_component("job id", job_id) + "/"

    def progress_entry(self, job_id: str, rank: int) -> str:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        return self.progress_of(job_id) + str(rank)

    # The daemon's records of jobs and workers.
    @property
    def states(self) -> str:
        return self.root + STATE

    @property
    def cancels(self) -> str:
        return self.root + CANCEL

    @property
    def workers(self) -> str:
        return self.root + WORKERS

    def signature(self, job: str) -> str:
        return self.root + SIGNATURES + check_component("job id", job)

    def bundle(self, job: str) -> str:
        return self.root + BUNDLES + check_component("job id", job)

    def state(self, job: str) -> str:
        return self.states + check_component("job id", job)

    def cancel(self, job: str) -> str:
        return self.cancels + check_component("job id", job)

    def workers_of(self, member: str) -> str:
        return self.workers + check_component("member name", member)

    def history_of(self, job: str) -> str:
        return self.root + HISTORY + check_component("job id", job) + "/"

    def history_entry(self, job: str, epoch: int, member: str, chunk: int) -> str:
        """One chunk of an epoch's loss history as one daemon saw it (varunad.node.reporter)."""
        return f"{self.history_of(job)}{epoch:012d}/{check_component('member name', member)}/{chunk:08d}"

    def parse_history(self, job: str, key: str) -> tuple[int, str]:
        """(epoch, member) of a ``history/<job>/<epoch>/<member>/<chunk>`` key, or of one without
        the chunk (an earlier release wrote one key per epoch); ValueError otherwise."""
        prefix = self.history_of(job)
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not under {prefix!r}")
        epoch, sep, rest = key[len(prefix):].partition("/")
        parts = rest.split("/")   # [member] or [member, chunk]
        if not sep or not epoch.isdigit() or not parts[0] or len(parts) > 2 or not all(c.isdigit() for c in parts[1:]):
            raise ValueError(f"{key!r} is not a history entry")
        return int(epoch), parts[0]

    def notes_of(self, job: str) -> str:
        return self.root + NOTES + check_component("job id", job) + "/"

    def note_entry(self, job: str, member: str) -> str:
        return self.notes_of(job) + check_component("member name", member)

    def logs_of(self, job: str) -> str:
        return self.root + LOGS + check_component("job id", job) + "/"

    def log_chunk(self, job: str, member: str, seq: int) -> str:
        return f"{self.logs_of(job)}{check_component('member name', member)}/{seq:020d}"

    def logs_of_member(self, job: str, member: str) -> str:
        return f"{self.logs_of(job)}{check_component('member name', member)}/"

    # Link measurements (varunad.control.links).
    @property
    def links(self) -> str:
        return self.root + LINKS

    @property
    def probes(self) -> str:
        return self.links + "probe/"

    @property
    def link_pairs(self) -> str:
        return self.links + "pair/"

    def probe(self, member: str) -> str:
        return self.probes + check_component("member name", member)

    def link_pair(self, a: str, b: str) -> str:
        """The one key of the link between `a` and `b`, whichever way round they are named."""
        a, b = sorted((a, b))
        return f"{self.link_pairs}{check_component('member name', a)}/{check_component('member name', b)}"

    # Parsing keys read back from a prefix read or a watch.
    def state_job(self, key: str) -> str:
        return self._last_component(self.states, key)

    def cancel_job(self, key: str) -> str:
        return self._last_component(self.cancels, key)

    def workers_member(self, key: str) -> str:
        return self._last_component(self.workers, key)

    def member_name(self, key: str) -> str:
        """The member name in a ``members/<name>`` key; ValueError for any other key."""
        return self._last_component(self.members, key)

    def job_id(self, key: str) -> str:
        return self._last_component(self.jobs, key)

    @staticmethod
    def _last_component(prefix: str, key: str) -> str:
        if not key.startswith(prefix) or len(key) == len(prefix):
            raise ValueError(f"key {key!r} is not directly under {prefix!r}")
        rest = key[len(prefix):]
        if "/" in rest:
            raise ValueError(f"key {key!r} is nested below {prefix!r}, not directly under it")
        return rest
