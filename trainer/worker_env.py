"""The environment contract between whoever starts a worker and the worker itself.

The local launcher (`python -m trainer.launch`) and the daemon start every trainer worker with
`WorkerAssignment.to_env()`; `Varuna(..., stage_to_rank_map=None)` reads it back with
`WorkerAssignment.from_env()`. Both directions go by the dataclass's fields, with one rule, so a
field added to `WorkerAssignment`, or to the plan it carries, reaches the worker with no edit
here, and the two sides cannot disagree on a name or a type.

The name: field ``checkpoint_every`` is ``VARUNA_CHECKPOINT_EVERY`` (`env_name`). Every name the
README, the examples, the tests and scripts use already follows it, so no name is mapped.

The value, by the field's declared type (`encode`, `decode`):

    str                  as it is
    int, float           decimal text (a float as its repr, which reads back to the same float)
    bool                 "1" or "0" ("true" and "false" read too)
    None                 the variable is absent; an empty variable of an optional field reads as
                         None too (``VAR=`` in a shell means unset); so "" in a ``str | None``
                         field is the one value that does not round-trip
    a type with to_json  its own JSON (the plan: `ParallelPlan.to_json`, every field by name)
    anything else        JSON (lists, tuples, dicts, optional values inside them); read back by
                         the declared type, so tuples come back as tuples and a wrong element
                         type is refused

Scalars stay plain text rather than JSON because they are what people set by hand
(``VARUNA_STORE=/mnt/ckpt``) and what scripts read with ``os.environ``; a JSON string would need
its quotes. The rest is JSON because it nests (the plan's ``ranks[stage][replica]``) and keeps
null apart from empty.

Besides the fields: ``VARUNA_WORLD_SIZE`` (P * D, for scripts; written, never read back), and
variables other modules own: the stream security (``VARUNA_SECURITY`` ...,
`protocol.security.SecurityConfig`) and the control token (`trainer.engine.control.TOKEN_ENV`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ConfigError
from trainer.planning.parallel import ParallelPlan

__all__ = ["WorkerAssignment", "OWNED_ELSEWHERE", "available_cores", "job_setting", "env_name", "env_fields", "encode",
           "decode"]


def available_cores() -> int:
    """CPUs this process may run on: its affinity mask, which a container's cpuset narrows (the
    default share of torch threads among workers, and the cores a daemon reports)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1

log = logging.getLogger("varuna")

_PREFIX = "VARUNA_"

# Read by earlier releases, now fields of VARUNA_PLAN: set by hand, they would be ignored unsaid.
_REPLACED = ("VARUNA_STAGE_TO_RANK", "VARUNA_CUTS", "VARUNA_RECOMPUTE", "VARUNA_SCHEDULE", "VARUNA_MICRO_BATCH")

# Variables other modules own and read themselves (stream security, the control token, timeouts,
# the calibration's cap), and the ones above: a field whose derived name is one of them would
# silently override it, so env_fields refuses such a field. tests/unit/test_worker_env.py keeps this
# list complete against every VARUNA_* name the code spells.
OWNED_ELSEWHERE = frozenset({
    "VARUNA_WORLD_SIZE", "VARUNA_SECURITY", "VARUNA_TRUSTED_NETWORK", "VARUNA_SECRET_KEY_FILE",
    "VARUNA_ALLOWED_KEYS_DIR", "VARUNA_CONTROL_TOKEN", "VARUNA_PEER_TIMEOUT", "VARUNA_DIST_TIMEOUT",
    "VARUNA_PROFILE_MAX_MICRO_BATCH", "VARUNA_CHECKPOINT_COMMIT_TIMEOUT", *_REPLACED})

# Job settings that the plan decides, read from it: the name a script uses -> the plan's field.
_FROM_PLAN = {"micro_batch": "micro_batch_size"}

# A field with this metadata is no variable of its own: its mapping goes into the environment as
# it is (and is not read back).
_AS_IS = "varuna_env_as_is"


def env_name(field_name: str) -> str:
    return _PREFIX + field_name.upper()


def job_setting(name: str, default: int) -> int:
    """A job-level number the daemon (or launcher) may set, e.g. job_setting("steps", 50)
    reads VARUNA_STEPS, job_setting("micro_batch", 8) the plan's micro-batch: scripts use it as
    their flag's default so one script runs both ways."""
    if name in _FROM_PLAN:
        text = os.environ.get(env_name("plan"))
        value = getattr(ParallelPlan.from_json(text), _FROM_PLAN[name]) if text else None
        return default if value is None else int(value)
    return int(os.environ.get(env_name(name), default))


# --- the codec ------------------------------------------------------------------------------------

def _optional(kind: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X | None``; any other union is not one type."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a worker variable has one type (or None), not {kind}")
        return rest[0], len(rest) < len(typing.get_args(kind))
    return kind, False


def encode(value: Any, kind: Any) -> str:
    """``value`` of declared type ``kind`` as a variable's text (never None: absent)."""
    base, _ = _optional(kind)
    if base is bool:
        return "1" if value else "0"
    if base in (str, int):
        return str(value)
    if base is float:
        return repr(float(value))
    if hasattr(value, "to_json"):
        return value.to_json()
    return json.dumps(value, sort_keys=True, default=_to_dict)


def _to_dict(value: Any) -> Any:
    if hasattr(value, "to_dict"):   # a value inside a list or dict, read back by its from_dict
        return value.to_dict()
    raise TypeError(f"a worker variable cannot hold a {type(value).__name__}")


def decode(text: str, kind: Any) -> Any:
    """What `encode` wrote, as a value of ``kind``; ValueError or TypeError when it is not one."""
    base, optional = _optional(kind)
    if optional and text == "":
        return None
    if base is str:
        return text
    if base is bool:
        flag = {"1": True, "true": True, "0": False, "false": False}.get(text.strip().lower())
        if flag is None:
            raise ValueError(f"expected 1 or 0, got {text[:40]!r}")
        return flag
    if base in (int, float):
        return base(text)
    if hasattr(base, "from_json"):
        return base.from_json(text)
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"expected JSON, got {text[:100]!r}: {exc}") from None
    return _typed(doc, kind)


def _typed(doc: Any, kind: Any) -> Any:
    """A JSON value as ``kind`` says: lists become the tuples a tuple field holds."""
    base, optional = _optional(kind)
    if base is Any or (doc is None and optional):
        return doc
    origin, args = typing.get_origin(base) or base, typing.get_args(base)
    if origin in (list, tuple) and isinstance(doc, list):
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(doc) != len(args):
                raise ValueError(f"expected {len(args)} values, got {len(doc)}")
            return tuple(_typed(v, a) for v, a in zip(doc, args))
        items = [_typed(v, args[0] if args else Any) for v in doc]
        return tuple(items) if origin is tuple else items
    if origin is dict and isinstance(doc, dict):
        key, value = args or (Any, Any)
        # JSON keys are strings: an int key is read back from its text.
        return {(int(k) if key is int else _typed(k, key)): _typed(v, value) for k, v in doc.items()}
    if hasattr(base, "from_dict"):
        return base.from_dict(doc)
    if base is float and isinstance(doc, int) and not isinstance(doc, bool):
        return float(doc)
    if isinstance(base, type) and isinstance(doc, base) and not (isinstance(doc, bool) and base is not bool):
        return doc
    raise ValueError(f"expected {getattr(base, '__name__', base)}, got {doc!r:.60}")


@functools.cache
def env_fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """(field, declared type) of each field of ``cls`` that is a variable of its own."""
    hints = typing.get_type_hints(cls)
    fields = tuple((f, hints[f.name]) for f in dataclasses.fields(cls) if not f.metadata.get(_AS_IS))
    taken = sorted(env_name(f.name) for f, _ in fields if env_name(f.name) in OWNED_ELSEWHERE)
    if taken:
        raise TypeError(f"{cls.__name__}: field(s) would be {', '.join(taken)}, a variable another module owns")
    return fields


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# --- the assignment -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerAssignment:
    """Where one worker sits in a P x D plan, and how it reaches its peers. Each field is the
    variable VARUNA_<FIELD> (see the module's doc)."""

    rank: int                                # this worker's global rank, 0 .. world-1
    # The job's plan (P, D, micro-batch, schedule, cuts, recompute, the rank of each (stage,
    # replica), each replica's share of the batch); its unset fields leave the choice to the
    # script or to Varuna.
    plan: ParallelPlan
    endpoints: list[str]                     # by rank: the ZeroMQ endpoint each worker binds
    dist_url: str                            # torch.distributed rendezvous, tcp://host:port
    job: str = "local"                       # tags every tensor frame
    epoch: int = 0                           # plan epoch: frames of another are dropped
    threads: int | None = None               # torch intra-op threads
    trace_dir: str | None = None             # write a Chrome trace of each step here
    store: str | None = None                 # the job's checkpoint store (global_store)
    device: str | None = None                # "cpu" or a CUDA ordinal
    # How CUDA tensors are reduced: "nccl", or "gloo" (through host memory). None: NCCL unless
    # ranks of the job find they share a GPU, which NCCL refuses (trainer.engine.groups).
    gpu_collectives: str | None = None
    control: str | None = None               # the daemon's local endpoint (trainer.engine.control)
    checkpoint_every: int | None = None      # checkpoint to the store every K steps
    keep_checkpoints: int = 3                # complete checkpoints to keep
    checkpoint_tmpdir: str | None = None     # stage checkpoints here, copy them in the background
    resume: str | None = None                # "latest": load the store's newest in set_optimizer
    batch_size: int | None = None            # the job's global batch; the script's must agree
    steps: int | None = None                 # the job's total steps, for scripts
    profile: str | None = None               # calibrate into this file at set_optimizer, and exit
    profile_slots: int | None = None         # CPU only: profile as this many slots busy at once
    profile_machine_slots: int | None = None  # CPU only: then time this many busy at once (a shared machine)
    # The address this worker's collectives bind (trainer.net.netaddr): the one its daemon
    # advertises. None: torch's default (the host name's address).
    bind_address: str | None = None
    peer_keys: dict[str, str] | None = None  # stream sockets' public keys by endpoint ("*": any other)
    trace_steps: int | None = None           # steps traced when trace_dir is set (None: 10)
    # keep the exported model here and load it from here (trainer.graph.capture_cache): a
    # directory per job bundle on this VM, which the daemon gives its workers
    capture_cache: str | None = None
    extra: dict[str, str] = field(default_factory=dict, metadata={_AS_IS: True})

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
        if self.gpu_collectives not in (None, "gloo", "nccl"):
            raise ConfigError(f"VARUNA_GPU_COLLECTIVES must be 'gloo' or 'nccl', got {self.gpu_collectives!r}")
        if self.resume not in (None, "latest", "none"):
            raise ConfigError(f"VARUNA_RESUME must be 'latest' or 'none', got {self.resume!r}")

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def position(self) -> tuple[int, int]:
        """(stage, replica) of this worker."""
        return self.plan.position(self.rank)

    def to_env(self) -> dict[str, str]:
        env = {env_name("world_size"): str(self.world_size)}
        for f, kind in env_fields(type(self)):
            value = getattr(self, f.name)
            if value is not None:
                env[env_name(f.name)] = encode(value, kind)
        env.update(self.extra)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerAssignment:
        environ = os.environ if environ is None else environ
        fields = env_fields(cls)
        missing = [env_name(f.name) for f, _ in fields if _required(f) and env_name(f.name) not in environ]
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
        values = {}
        try:
            for f, kind in fields:
                name = env_name(f.name)
                if name in environ:
                    try:
                        values[f.name] = decode(environ[name], kind)
                    except (ValueError, TypeError) as exc:
                        raise ValueError(f"{name}: {exc}") from exc
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"malformed worker assignment in the environment: {exc}") from exc
