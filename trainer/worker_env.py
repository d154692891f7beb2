"""The environment contract between whoever starts a worker and the worker itself.

The local launcher (`python -m trainer.launch`) and, later, the daemon start every trainer
worker with these variables; `Varuna(..., stage_to_rank_map=None)` reads them back. Keeping
both directions in one module means the two sides cannot disagree on a name.

Variables (all strings):

    VARUNA_RANK            this worker's global rank, 0 .. world-1
    VARUNA_WORLD_SIZE      P * D
    VARUNA_PLAN            JSON of the job's `trainer.planning.parallel.ParallelPlan` (P, D,
                           micro-batch, schedule, cuts, recompute, which rank holds each
                           (stage, replica)); its unset fields leave the choice to the script
                           or to Varuna (the local launcher sets P, D and, when
                           given, the cuts and the schedule)
    VARUNA_ENDPOINTS       JSON list, by rank, of the ZeroMQ endpoint each worker binds
                           for activations/gradients ("tcp://host:port")
    VARUNA_DIST_URL        torch.distributed rendezvous ("tcp://host:port") for gloo/NCCL
    VARUNA_BIND_ADDRESS    optional: the IP address this worker's collectives bind (gloo's
                           device, NCCL's interface; trainer.net.netaddr): the one its daemon
                           advertises. Absent: torch's default (the host name's address)
    VARUNA_JOB             job id (tags every tensor frame)
    VARUNA_EPOCH           plan epoch (frames from another epoch are dropped)
    VARUNA_THREADS         torch intra-op threads for this worker
    VARUNA_TRACE_DIR       optional: write a Chrome trace of each step here
    VARUNA_STORE           optional: the job's checkpoint store (global_store)
    VARUNA_DEVICE          optional: "cpu" or a CUDA ordinal
    VARUNA_CONTROL         optional: the daemon's local ZeroMQ endpoint for progress and
                           checkpoint/stop requests (trainer.engine.control)
    VARUNA_CHECKPOINT_EVERY  optional: checkpoint to VARUNA_STORE every K steps
    VARUNA_KEEP_CHECKPOINTS  optional: complete checkpoints to keep (default 3)
    VARUNA_CHECKPOINT_TMPDIR  optional: stage the periodic checkpoints in this local directory
                           and copy them into VARUNA_STORE in the background
    VARUNA_RESUME          optional: "latest" loads the newest complete checkpoint of
                           VARUNA_STORE in set_optimizer, so scripts need no resume code
    VARUNA_BATCH_SIZE      optional: the job's global batch; the script's must agree
    VARUNA_STEPS           optional: the job's total steps (`WorkerAssignment.steps`, for scripts)
    VARUNA_PROFILE         optional: profile the model into this calibration file when the
                           script sets its optimizer (timing that optimizer), and exit
    VARUNA_PROFILE_SLOTS   optional, CPU only: profile as this many slots busy at once (the
                           host's workers share its cores), one torch thread each
    VARUNA_SECURITY, VARUNA_SECRET_KEY_FILE, VARUNA_ALLOWED_KEYS_DIR, VARUNA_TRUSTED_NETWORK
                           how the tensor streams are secured (protocol.security.SecurityConfig)
    VARUNA_PEER_KEYS       optional: JSON {endpoint: z85 public key} of the neighbours' stream
                           sockets, "*" standing for any other endpoint (`peer_keys`)
    VARUNA_TRACE_STEPS     optional: steps each worker records in its trace (`trace_steps`; 10)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.errors import ConfigError
from trainer.planning.parallel import ParallelPlan

__all__ = ["WorkerAssignment", "job_setting"]

log = logging.getLogger("varuna")

# Read by earlier releases, now fields of VARUNA_PLAN: set by hand, they would be ignored unsaid.
_REPLACED = ("VARUNA_STAGE_TO_RANK", "VARUNA_CUTS", "VARUNA_RECOMPUTE", "VARUNA_SCHEDULE", "VARUNA_MICRO_BATCH")


# Job settings that the plan decides, read from it: the name a script uses -> the plan's field.
_FROM_PLAN = {"micro_batch": "micro_batch_size"}


def job_setting(name: str, default: int) -> int:
    """A job-level number the daemon (or launcher) may set, e.g. job_setting("steps", 50)
    reads VARUNA_STEPS, job_setting("micro_batch", 8) the plan's micro-batch: scripts use it as
    their flag's default so one script runs both ways."""
    if name in _FROM_PLAN:
        text = os.environ.get("VARUNA_PLAN")
        value = getattr(ParallelPlan.from_json(text), _FROM_PLAN[name]) if text else None
        return default if value is None else int(value)
    return int(os.environ.get(f"VARUNA_{name.upper()}", default))


def _opt_int(text: str | None) -> int | None:
    return int(text) if text else None


def _opt_keys(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    keys = json.loads(text)
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ValueError(f"VARUNA_PEER_KEYS must be a JSON object of strings, got {text[:100]!r}")
    return keys


def _opt_str(value: int | None) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerAssignment:
    """Where one worker sits in a P x D plan, and how it reaches its peers."""

    rank: int
    plan: ParallelPlan
    endpoints: list[str]  # by rank
    dist_url: str
    job: str = "local"
    epoch: int = 0
    threads: int | None = None
    trace_dir: str | None = None
    store: str | None = None
    device: str | None = None
    control: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    checkpoint_tmpdir: str | None = None
    resume: str | None = None
    batch_size: int | None = None
    steps: int | None = None
    profile: str | None = None
    profile_slots: int | None = None
    bind_address: str | None = None
    peer_keys: dict[str, str] | None = None   # stream sockets' public keys by endpoint ("*": any other)
    trace_steps: int | None = None            # steps traced when trace_dir is set (None: 10)
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, ParallelPlan):
            raise ConfigError(f"a worker's plan must be a ParallelPlan, got {self.plan!r:.100}")
        world = self.plan.world_size
        if len(self.endpoints) != world:
            raise ConfigError(f"{len(self.endpoints)} endpoints for {world} ranks")
        if not 0 <= self.rank < world:
            raise ConfigError(f"rank {self.rank} outside 0..{world - 1}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint interval must be >= 1 step, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume == "latest") and not self.store:
            raise ConfigError("periodic checkpoints and resume need a store (VARUNA_STORE)")
        if self.resume not in (None, "latest", "none"):
            raise ConfigError(f"VARUNA_RESUME must be 'latest' or 'none', got {self.resume!r}")

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def position(self) -> tuple[int, int]:
        """(stage, replica) of this worker."""
        return self.plan.position(self.rank)

    def to_env(self) -> dict[str, str]:
        env = {
            "VARUNA_RANK": str(self.rank),
            "VARUNA_WORLD_SIZE": str(self.world_size),
            "VARUNA_PLAN": self.plan.to_json(),
            "VARUNA_ENDPOINTS": json.dumps(self.endpoints),
            "VARUNA_DIST_URL": self.dist_url,
            "VARUNA_JOB": self.job,
            "VARUNA_EPOCH": str(self.epoch),
        }
        optional = {
            "VARUNA_THREADS": None if self.threads is None else str(self.threads),
            "VARUNA_TRACE_DIR": self.trace_dir,
            "VARUNA_STORE": self.store,
            "VARUNA_DEVICE": self.device,
            "VARUNA_CONTROL": self.control,
            "VARUNA_CHECKPOINT_EVERY": None if self.checkpoint_every is None else str(self.checkpoint_every),
            "VARUNA_KEEP_CHECKPOINTS": str(self.keep_checkpoints),
            "VARUNA_CHECKPOINT_TMPDIR": self.checkpoint_tmpdir,
            "VARUNA_RESUME": self.resume,
            "VARUNA_BATCH_SIZE": _opt_str(self.batch_size),
            "VARUNA_STEPS": _opt_str(self.steps),
            "VARUNA_PROFILE": self.profile,
            "VARUNA_PROFILE_SLOTS": _opt_str(self.profile_slots),
            "VARUNA_BIND_ADDRESS": self.bind_address,
            "VARUNA_PEER_KEYS": None if self.peer_keys is None else json.dumps(self.peer_keys, sort_keys=True),
            "VARUNA_TRACE_STEPS": _opt_str(self.trace_steps),
        }
        env.update({k: v for k, v in optional.items() if v is not None})
        env.update(self.extra)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerAssignment:
        environ = os.environ if environ is None else environ
        missing = [k for k in ("VARUNA_RANK", "VARUNA_PLAN", "VARUNA_ENDPOINTS", "VARUNA_DIST_URL")
                   if k not in environ]
        if missing:
            raise ConfigError(
                f"no worker assignment in the environment (missing {', '.join(missing)})",
                hint="start the script with `python -m trainer.launch --stages P --replicas D script.py`, "
                     "under varunad, or pass stage_to_rank_map to Varuna",
            )
        stale = [k for k in _REPLACED if k in environ]
        if stale:
            log.warning("%s no longer read: the plan (VARUNA_PLAN) says P, D, micro-batch, schedule, cuts and "
                        "recompute; with the local launcher use --cuts/--schedule, and chunk_size for the "
                        "micro-batch", ", ".join(stale) + (" is" if len(stale) == 1 else " are"))
        try:
            return cls(
                rank=int(environ["VARUNA_RANK"]),
                plan=ParallelPlan.from_json(environ["VARUNA_PLAN"]),
                endpoints=list(json.loads(environ["VARUNA_ENDPOINTS"])),
                dist_url=environ["VARUNA_DIST_URL"],
                job=environ.get("VARUNA_JOB", "local"),
                epoch=int(environ.get("VARUNA_EPOCH", "0")),
                threads=int(environ["VARUNA_THREADS"]) if "VARUNA_THREADS" in environ else None,
                trace_dir=environ.get("VARUNA_TRACE_DIR"),
                store=environ.get("VARUNA_STORE"),
                device=environ.get("VARUNA_DEVICE"),
                control=environ.get("VARUNA_CONTROL"),
                checkpoint_every=_opt_int(environ.get("VARUNA_CHECKPOINT_EVERY")),
                keep_checkpoints=int(environ.get("VARUNA_KEEP_CHECKPOINTS", "3")),
                checkpoint_tmpdir=environ.get("VARUNA_CHECKPOINT_TMPDIR") or None,
                resume=environ.get("VARUNA_RESUME"),
                batch_size=_opt_int(environ.get("VARUNA_BATCH_SIZE")),
                steps=_opt_int(environ.get("VARUNA_STEPS")),
                profile=environ.get("VARUNA_PROFILE"),
                profile_slots=_opt_int(environ.get("VARUNA_PROFILE_SLOTS")),
                bind_address=environ.get("VARUNA_BIND_ADDRESS") or None,
                peer_keys=_opt_keys(environ.get("VARUNA_PEER_KEYS")),
                trace_steps=_opt_int(environ.get("VARUNA_TRACE_STEPS")),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"malformed worker assignment in the environment: {exc}") from exc
