"""Jobs: the spec varunactl submits, the script bundle, and the state the leader keeps.

A job is a plain Varuna script plus the files next to it (a *bundle*, zipped into etcd, size-
limited), run with the same global batch whatever P x D the fleet allows. Values in etcd are
JSON so that ``etcdctl get`` shows them to a person; every parse validates and raises
``JobSpecError`` with the reason, which the leader records when it fails a hand-written spec.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import posixpath
import re
import shutil
import stat
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from trainer.errors import ConfigError
from trainer.planning.parallel import micro_batches
from trainer.planning.schedule import DEFAULT_SCHEDULE, ScheduleError, check_choice  # pure Python
from varunad.store import schemas

__all__ = [
    "JobSpecError",
    "BundleError",
    "JobSpec",
    "JobState",
    "MorphEvent",
    "STATES",
    "TERMINAL",
    "CHANGES",
    "MAX_BUNDLE_BYTES",
    "pack_bundle",
    "unpack_bundle",
    "bundle_digest",
    "script_fingerprint",
    "job_store",
    "job_trace_dir",
]

STATES = ("queued", "running", "morphing", "done", "failed", "cancelled")
TERMINAL = frozenset({"done", "failed", "cancelled"})
# what a "morphing" job is going through: "stopping" (a worker failed; whether a VM went with it
# is not known yet), "restart" (the same plan again) or "morph" (a new plan); "" otherwise
CHANGES = ("", "stopping", "restart", "morph")

MAX_BUNDLE_BYTES = 1 << 20  # zipped; etcd refuses requests over 1.5 MiB by default
MAX_UNPACKED_BYTES = 64 << 20
MAX_BUNDLE_FILES = 2000
_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # protocol identifiers: job ids travel in messages
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".venv", "venv", "node_modules"}

T = TypeVar("T")


class JobSpecError(ValueError):
    """A job spec that cannot run, with the reason."""


class BundleError(JobSpecError):
    """The script directory cannot be bundled (too big, unreadable) or a bundle is corrupt."""


# A global batch larger than any training run uses; the planner enumerates its divisors, so a bound
# also bounds the leader's work on a spec written to etcd by hand.
MAX_BATCH_SIZE = 1 << 24


def divisors(n: int) -> list[int]:
    """Every divisor of `n` >= 1, ascending (sqrt(n) steps, not n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# Counts of steps beyond this are no training run's, and JSON readers elsewhere lose precision there.
MAX_COUNT = 2**53


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobSpecError(f"{where} must be a positive integer, got {value!r}")
    if value > MAX_COUNT:
        raise JobSpecError(f"{where} must be at most {MAX_COUNT}, got {value}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What ``varunactl submit`` stores at ``jobs/<job>``."""

    job: str
    script: str  # path of the script inside the bundle (POSIX, relative)
    args: tuple[str, ...] = ()
    batch_size: int
    chunk_size: int | None = None  # fixed micro-batch size; None = the planner chooses ("auto")
    steps: int
    checkpoint_every: int
    keep_checkpoints: int = 3
    store: str | None = None  # None: the daemon's --store / <job>
    schedule: str = DEFAULT_SCHEDULE
    bundle_digest: str
    bundle_bytes: int
    submitted_at: float = 0.0  # wall clock, display only

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not _ID_RE.fullmatch(self.job):
            shown = repr(self.job) if not isinstance(self.job, str) or len(self.job) <= 80 else \
                f"{self.job[:60]!r}... ({len(self.job)} characters)"   # a 5000-character name filled the terminal
            raise JobSpecError(f"job name {shown} must be 1..128 letters, digits or . _ - : @")
        if not isinstance(self.script, str) or not self.script:
            raise JobSpecError("the spec names no script")
        path = PurePosixPath(self.script)
        if path.is_absolute() or ".." in path.parts:
            raise JobSpecError(f"script {self.script!r} must be a relative path inside the bundle")
        if not isinstance(self.args, (list, tuple)) or not all(isinstance(a, str) for a in self.args):
            raise JobSpecError("args must be a list of strings")
        for what, text in (("script", self.script), ("store", self.store or ""), *(("an argument", a) for a in self.args)):
            if "\x00" in text:   # no process can be given it: the worker would never start
                raise JobSpecError(f"{what} holds a NUL character: {text!r}")
        object.__setattr__(self, "args", tuple(self.args))
        _positive_int("batch size", self.batch_size)
        if self.batch_size > MAX_BATCH_SIZE:
            raise JobSpecError(f"batch size {self.batch_size} is more than {MAX_BATCH_SIZE} examples per step")
        _positive_int("steps", self.steps)
        _positive_int("checkpoint interval", self.checkpoint_every)
        _positive_int("checkpoints to keep", self.keep_checkpoints)
        if self.chunk_size is not None:
            try:  # the engine's rule for one replica: the planner picks only replica counts that divide the batch
                micro_batches(self.batch_size, 1, self.chunk_size)
            except ConfigError as exc:
                raise JobSpecError(str(exc)) from None
            if self.chunk_size > self.batch_size:   # no calibration measures it: the job would wait for a plan forever
                raise JobSpecError(f"the micro-batch size {self.chunk_size} is larger than the global batch "
                                   f"{self.batch_size}")
        try:
            check_choice(self.schedule)
        except ScheduleError as exc:
            raise JobSpecError(str(exc)) from None
        if self.store is not None and (not isinstance(self.store, str) or not self.store):
            raise JobSpecError("store must be a non-empty path")
        if isinstance(self.store, str) and "://" not in self.store and not posixpath.isabs(self.store):
            # each VM would resolve it in its own working directory: no checkpoint would ever be whole
            raise JobSpecError(f"store must be an absolute path (every VM mounts it there) or a URL, got "
                               f"{self.store!r}")
        if not isinstance(self.bundle_digest, str) or not re.fullmatch(r"[0-9a-f]{64}", self.bundle_digest):
            raise JobSpecError("bundle_digest must be a sha256 hex digest")
        if isinstance(self.bundle_bytes, bool) or not isinstance(self.bundle_bytes, int) or self.bundle_bytes < 0:
            raise JobSpecError("bundle_bytes must be a non-negative integer")

    def micro_batch_sizes(self) -> list[int]:
        """Sizes the planner may choose: the fixed chunk size, or every divisor of the batch."""
        if self.chunk_size is not None:
            return [self.chunk_size]
        return divisors(self.batch_size)

    def encode(self) -> bytes:
        doc = asdict(self)
        doc["args"] = list(self.args)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, *, job: str | None = None) -> JobSpec:
        doc = _json_object(data, "job spec")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise JobSpecError(f"job spec has unknown fields {unknown}")
        if job is not None and doc.get("job") != job:
            raise JobSpecError(f"job spec under jobs/{job} names job {doc.get('job')!r}")
        return _checked(cls, doc, "job spec")


def _json_object(data: bytes, what: str) -> dict:
    try:
        doc = schemas.load_json(data)
    except ValueError as exc:   # UnicodeDecodeError is one
        raise JobSpecError(f"{what} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise JobSpecError(f"{what} is not a JSON object")
    return doc


def _checked(cls: type[T], doc: dict, what: str) -> T:
    """``cls(**doc)`` once its fields have their declared types; any mismatch, or a field ``cls``
    does not have, is one JobSpecError (a job's documents are strict, unlike the fleet's records)."""
    try:
        schemas.check(cls, doc, what)
        return cls(**doc)
    except JobSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise JobSpecError(f"{what} is malformed: {exc}") from None


def job_store(spec: JobSpec, default_root: str) -> str:
    return spec.store or os.path.join(default_root, spec.job)


def job_trace_dir(store: str, epoch: int) -> str | None:
    """Where the workers of ``epoch`` write their Chrome traces: inside the job's store, which
    every VM shares, so the end-of-job report finds them all. None for an object-store URL
    (``s3://...``): traces are plain files."""
    if "://" in store:
        return None
    return os.path.join(store, "traces", f"epoch{epoch}")


def script_fingerprint(spec: JobSpec) -> str:
    """Key of the job's calibration in etcd: a digest of the bundle and the arguments (same script,
    same model), not of the model itself, which the daemon never loads (that is
    `trainer.profiler.model_fingerprint`)."""
    h = hashlib.sha256(spec.bundle_digest.encode())
    h.update(json.dumps([spec.script, list(spec.args)]).encode())
    return h.hexdigest()[:16]


# --- job state ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class MorphEvent:
    """One change of plan of a running job (wall-clock times, for display and benchmarks)."""

    reason: str
    from_shape: str  # "PxD" or "-" when nothing ran
    to_shape: str
    from_epoch: int
    to_epoch: int
    noticed_at: float  # when the leader decided to morph
    stopped_at: float  # when every old worker was gone
    planned_at: float  # when the new plan was written
    checkpoint: bool  # whether the old workers were asked to checkpoint
    restart: bool = False  # a worker failed and no VM was lost: the same work started again
    cause: str = ""  # what happened, in a few words ("vm4 was lost"), for progress lines and plots
    # where the new epoch resumed from (varunad.control.resume): "replicas" (saved from the
    # survivors' memory), "checkpoint", "scratch"; "" when the leader could not read the store
    source: str = ""
    resumed_from: int = -1  # the step it resumed at (-1: unknown)
    source_why: str = ""    # for a fallback to the store: what the replicas could not provide

    @property
    def duration_s(self) -> float:
        return self.planned_at - self.noticed_at


_MORPH_FIELDS = frozenset(f.name for f in fields(MorphEvent))


@dataclass(frozen=True, slots=True, kw_only=True)
class JobState:
    """What the leader records at ``state/<job>``."""

    job: str
    state: str = "queued"
    reason: str = "submitted"
    epoch: int = 0  # epoch of the newest run plan (0 before the first)
    epochs: tuple[int, ...] = ()  # every run epoch, oldest first
    plan: dict[str, Any] = field(default_factory=dict)  # P, D, micro_batch_size, schedule, members, estimated_s
    restarts: int = 0
    error: str | None = None
    morphs: tuple[MorphEvent, ...] = ()
    updated_at: float = 0.0
    # For the end-of-job report (device-hours); 0 / "" in states written before they existed.
    started_at: float = 0.0  # wall clock of the first run plan
    finished_at: float = 0.0  # wall clock when it became done, failed or cancelled
    store: str = ""  # the job's checkpoint store as the leader resolved it (traces and report live there)
    change: str = ""  # one of CHANGES: while morphing, whether it restarts or morphs
    # wall clock of the calibration run before the first plan (0: none ran), for the report's timeline
    calibration_started: float = 0.0
    calibration_ended: float = 0.0
    # device kind -> the share of a slot's memory the planner counts on for this job, lowered each
    # time a stage of that kind ran out of memory (absent: all of it)
    memory_scale: dict[str, float] = field(default_factory=dict)
    # slot ("member/index") -> how many times slower than the fastest slot of its kind it computes,
    # as measured in the running epoch (varunad.control.speeds); stragglers: those the leader plans
    # around
    paces: dict[str, float] = field(default_factory=dict)
    stragglers: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise JobSpecError(f"job state {self.state!r} is not one of {STATES}")
        if self.change not in CHANGES:
            raise JobSpecError(f"job change {self.change!r} is not one of {CHANGES}")
        object.__setattr__(self, "epochs", tuple(self.epochs))
        # fields a newer release added are left out, so a fleet can be upgraded one VM at a time
        morphs = tuple(m if isinstance(m, MorphEvent)
                       else MorphEvent(**{k: v for k, v in m.items() if k in _MORPH_FIELDS}) for m in self.morphs)
        object.__setattr__(self, "morphs", morphs)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def but(self, **changes: Any) -> JobState:
        return replace(self, updated_at=time.time(), **changes)

    def encode(self) -> bytes:
        doc = asdict(self)
        doc["epochs"] = list(self.epochs)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> JobState:
        return _checked(cls, _json_object(data, "job state"), "job state")


# --- bundles -----------------------------------------------------------------------------------------

def _bundle_files(directory: Path) -> list[Path]:
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(names):
            if name.endswith((".pyc", ".pyo")) or name.startswith("."):
                continue
            path = Path(root) / name
            if path.is_symlink() or not path.is_file():
                continue
            files.append(path)
    return files


def pack_bundle(script: str | os.PathLike[str], *, limit: int = MAX_BUNDLE_BYTES) -> tuple[bytes, str]:
    """Zip the script's directory (hidden and cache directories left out); returns (zip bytes,
    the script's path inside). BundleError with the biggest files when it exceeds ``limit``."""
    script = Path(script)
    if not script.is_file():
        raise BundleError(f"{script} is a directory; give the training script in it" if script.is_dir()
                          else f"no such script: {script}")
    directory = script.resolve().parent
    files = _bundle_files(directory)
    if len(files) > MAX_BUNDLE_FILES:
        raise BundleError(f"{directory} holds {len(files)} files; a bundle takes at most {MAX_BUNDLE_FILES}: "
                          "put the script in a directory of its own")
    buf = io.BytesIO()
    try:
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for path in files:
                rel = path.relative_to(directory).as_posix()
                info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))  # same files, same digest
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                zf.writestr(info, path.read_bytes())
                if buf.tell() > limit:
                    break
    except OSError as exc:
        raise BundleError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
    data = buf.getvalue()
    if len(data) > limit:
        biggest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:3]
        listing = ", ".join(f"{p.relative_to(directory)} ({p.stat().st_size / 2**10:.0f} KiB)" for p in biggest)
        raise BundleError(
            f"the files next to {script.name} compress to more than {limit / 2**20:.1f} MiB (largest: {listing}); "
            "move data and checkpoints out of the script's directory (read them from a shared path instead)")
    return data, script.resolve().relative_to(directory).as_posix()


def bundle_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unpack_bundle(data: bytes, digest: str, dest_root: str | os.PathLike[str]) -> Path:
    """Unpack into ``dest_root/<digest[:16]>`` (once; atomically); returns that directory."""
    if bundle_digest(data) != digest:
        raise BundleError("the bundle in etcd does not match the digest in the job spec")
    dest_root = Path(dest_root)
    dest = dest_root / digest[:16]
    if dest.is_dir():
        return dest
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest_root))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_BUNDLE_FILES or sum(i.file_size for i in infos) > MAX_UNPACKED_BYTES:
                raise BundleError("the bundle unpacks to too many files or bytes")
            for info in infos:
                rel = PurePosixPath(info.filename)
                mode = info.external_attr >> 16
                if rel.is_absolute() or ".." in rel.parts or not rel.parts or stat.S_ISLNK(mode):
                    raise BundleError(f"the bundle holds an unsafe entry {info.filename!r}")
                if info.is_dir():
                    continue
                target = tmp.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():  # another task won the race otherwise
                raise
    except zipfile.BadZipFile as exc:
        raise BundleError(f"the bundle is not a zip file: {exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
