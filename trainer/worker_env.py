"""The environment contract between whoever starts a worker and the worker itself.

The local launcher (`python -m trainer.launch`) and, later, the daemon start every trainer
worker with these variables; `Varuna(..., stage_to_rank_map=None)` reads them back. Keeping
both directions in one module means the two sides cannot disagree on a name.

Variables (all strings):

    VARUNA_RANK            this worker's global rank, 0 .. world-1
    VARUNA_WORLD_SIZE      P * D
    VARUNA_STAGE_TO_RANK   JSON {"<stage>": [rank of replica 0, rank of replica 1, ...]}
    VARUNA_ENDPOINTS       JSON list, by rank, of the ZeroMQ endpoint each worker binds
                           for activations/gradients ("tcp://host:port")
    VARUNA_DIST_URL        torch.distributed rendezvous ("tcp://host:port") for gloo/NCCL
    VARUNA_BIND_ADDRESS    optional: the IP address this worker's collectives bind (gloo's
                           device, NCCL's interface; trainer.net.netaddr): the one its daemon
                           advertises. Absent: torch's default (the host name's address)
    VARUNA_JOB             job id (tags every tensor frame)
    VARUNA_EPOCH           plan epoch (frames from another epoch are dropped)
    VARUNA_CUTS            optional JSON list of the active cut-point indices, decided by
                           whoever planned; absent means Varuna balances them itself
    VARUNA_RECOMPUTE       optional JSON list, one flag per stage: recompute activations in
                           backward (the planner turns it off where the stash fits memory);
                           absent means Varuna's `recompute` argument (default on)
    VARUNA_SCHEDULE        optional: varuna | gpipe | 1f1b
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
    VARUNA_MICRO_BATCH     optional: the planner's micro-batch size (overrides chunk_size)
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
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.errors import ConfigError

__all__ = ["WorkerAssignment", "job_setting", "stage_to_rank_from_json", "stage_to_rank_to_json"]


def job_setting(name: str, default: int) -> int:
    """A job-level number the daemon (or launcher) may set, e.g. job_setting("steps", 50)
    reads VARUNA_STEPS: scripts use it as their flag's default so one script runs both ways."""
    return int(os.environ.get(f"VARUNA_{name.upper()}", default))


def _opt_int(text: str | None) -> int | None:
    return int(text) if text else None


def _opt_flags(text: str | None) -> list[bool] | None:
    if not text:
        return None
    flags = json.loads(text)
    if not isinstance(flags, list) or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"VARUNA_RECOMPUTE must be a JSON list of true/false, not {text!r}")
    return flags


def _opt_keys(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    keys = json.loads(text)
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ValueError(f"VARUNA_PEER_KEYS must be a JSON object of strings, got {text[:100]!r}")
    return keys


def _opt_str(value: int | None) -> str | None:
    return None if value is None else str(value)


def stage_to_rank_to_json(stage_to_rank: Mapping[int, list[int]]) -> str:
    return json.dumps({str(s): list(r) for s, r in sorted(stage_to_rank.items())})


def stage_to_rank_from_json(text: str) -> dict[int, list[int]]:
    try:
        raw = json.loads(text)
        return {int(s): [int(r) for r in ranks] for s, ranks in raw.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"VARUNA_STAGE_TO_RANK is not a JSON object of stage -> [ranks]: {text!r}",
            hint='set it like {"0": [0, 2], "1": [1, 3]}',
        ) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerAssignment:
    """Where one worker sits in a P x D plan, and how it reaches its peers."""

    rank: int
    stage_to_rank: dict[int, list[int]]
    endpoints: list[str]
    dist_url: str
    job: str = "local"
    epoch: int = 0
    cuts: list[int] | None = None
    recompute: list[bool] | None = None  # per stage, from the planner; None = the script's choice
    schedule: str | None = None
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
    micro_batch_size: int | None = None
    steps: int | None = None
    profile: str | None = None
    profile_slots: int | None = None
    bind_address: str | None = None
    peer_keys: dict[str, str] | None = None   # stream sockets' public keys by endpoint ("*": any other)
    trace_steps: int | None = None            # steps traced when trace_dir is set (None: 10)
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stages = sorted(self.stage_to_rank)
        if stages != list(range(len(stages))) or not stages:
            raise ConfigError(f"stages must be numbered 0..P-1, got {stages}")
        widths = {len(r) for r in self.stage_to_rank.values()}
        if len(widths) != 1:
            raise ConfigError(f"every stage needs the same number of replicas, got {self.stage_to_rank}")
        ranks = sorted(r for rs in self.stage_to_rank.values() for r in rs)
        if ranks != list(range(len(ranks))):
            raise ConfigError(f"ranks must be 0..P*D-1, each once, got {ranks}")
        if len(self.endpoints) != len(ranks):
            raise ConfigError(f"{len(self.endpoints)} endpoints for {len(ranks)} ranks")
        if not 0 <= self.rank < len(ranks):
            raise ConfigError(f"rank {self.rank} outside 0..{len(ranks) - 1}")
        if self.recompute is not None and len(self.recompute) != len(stages):
            raise ConfigError(f"{len(self.recompute)} recompute flags for {len(stages)} stages")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint interval must be >= 1 step, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume == "latest") and not self.store:
            raise ConfigError("periodic checkpoints and resume need a store (VARUNA_STORE)")
        if self.resume not in (None, "latest", "none"):
            raise ConfigError(f"VARUNA_RESUME must be 'latest' or 'none', got {self.resume!r}")

    @property
    def pipeline_depth(self) -> int:
        return len(self.stage_to_rank)

    @property
    def data_depth(self) -> int:
        return len(self.stage_to_rank[0])

    @property
    def world_size(self) -> int:
        return self.pipeline_depth * self.data_depth

    def position(self, rank: int | None = None) -> tuple[int, int]:
        """(stage, replica) of `rank` (default: this worker)."""
        rank = self.rank if rank is None else rank
        for stage, ranks in self.stage_to_rank.items():
            if rank in ranks:
                return stage, ranks.index(rank)
        raise ConfigError(f"rank {rank} is in no stage of {self.stage_to_rank}")

    def to_env(self) -> dict[str, str]:
        env = {
            "VARUNA_RANK": str(self.rank),
            "VARUNA_WORLD_SIZE": str(self.world_size),
            "VARUNA_STAGE_TO_RANK": stage_to_rank_to_json(self.stage_to_rank),
            "VARUNA_ENDPOINTS": json.dumps(self.endpoints),
            "VARUNA_DIST_URL": self.dist_url,
            "VARUNA_JOB": self.job,
            "VARUNA_EPOCH": str(self.epoch),
        }
        optional = {
            "VARUNA_CUTS": None if self.cuts is None else json.dumps(self.cuts),
            "VARUNA_RECOMPUTE": None if self.recompute is None else json.dumps([bool(r) for r in self.recompute]),
            "VARUNA_SCHEDULE": self.schedule,
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
            "VARUNA_MICRO_BATCH": _opt_str(self.micro_batch_size),
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
        missing = [k for k in ("VARUNA_RANK", "VARUNA_STAGE_TO_RANK", "VARUNA_ENDPOINTS", "VARUNA_DIST_URL")
                   if k not in environ]
        if missing:
            raise ConfigError(
                f"no worker assignment in the environment (missing {', '.join(missing)})",
                hint="start the script with `python -m trainer.launch --stages P --replicas D script.py`, "
                     "under varunad, or pass stage_to_rank_map to Varuna",
            )
        try:
            cuts = environ.get("VARUNA_CUTS")
            return cls(
                rank=int(environ["VARUNA_RANK"]),
                stage_to_rank=stage_to_rank_from_json(environ["VARUNA_STAGE_TO_RANK"]),
                endpoints=list(json.loads(environ["VARUNA_ENDPOINTS"])),
                dist_url=environ["VARUNA_DIST_URL"],
                job=environ.get("VARUNA_JOB", "local"),
                epoch=int(environ.get("VARUNA_EPOCH", "0")),
                cuts=None if cuts is None else [int(c) for c in json.loads(cuts)],
                recompute=_opt_flags(environ.get("VARUNA_RECOMPUTE")),
                schedule=environ.get("VARUNA_SCHEDULE"),
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
                micro_batch_size=_opt_int(environ.get("VARUNA_MICRO_BATCH")),
                steps=_opt_int(environ.get("VARUNA_STEPS")),
                profile=environ.get("VARUNA_PROFILE"),
                profile_slots=_opt_int(environ.get("VARUNA_PROFILE_SLOTS")),
                bind_address=environ.get("VARUNA_BIND_ADDRESS") or None,
                peer_keys=_opt_keys(environ.get("VARUNA_PEER_KEYS")),
                trace_steps=_opt_int(environ.get("VARUNA_TRACE_STEPS")),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"malformed worker assignment in the environment: {exc}") from exc
