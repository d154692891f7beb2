"""Control messages between daemons, the leader and trainer workers, and their encoding.

Wire layout: one ZeroMQ frame holding one msgpack array of three items::

    [PROTOCOL_VERSION, type_tag, {field_name: value, ...}]

`PROTOCOL_VERSION` is an int (1), separate from the package version; a peer speaking another version
is refused, never guessed at. `type_tag` is a short string naming the message class (`"ping"`,
`"plan_changed"`, ...). The map holds exactly the class's fields, by name, every one of them (optional
values are sent as nil). Values are msgpack nil, bool, int, float, str and array (a tuple field)
only. No bin, no ext, no
timestamps. Nothing is ever unpickled. A plan never travels here: the leader only says which epoch
to read (`PlanChanged`), and the plan itself is read from etcd.

`decode` trusts nothing: size first, then msgpack with bounded lengths and unique str keys, then the
version, the tag, the exact field set, each field's type (a bool is not an int) and range, then the
cross-field rules of the class, if it has any. Any failure is a `ProtocolError` with the
reason. Building a message locally runs the same checks and raises `MessageValueError` (a ValueError).

Identifiers (job ids, member names, schedule names) are 1..128 characters of letters, digits and
`. _ - : @`: they end up in etcd keys, file names and log lines.

One module over 500 lines: it is the whole wire schema, one small class per message and the
field checks they share, so the format reads in one place.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from protocol.errors import MessageValueError, ProtocolError

__all__ = [
    "MAX_MESSAGE_SIZE",
    "PROTOCOL_VERSION",
    "CheckpointNow",
    "Message",
    "Ping",
    "PlanChanged",
    "Pong",
    "StopWorkers",
    "WorkerCheckpointed",
    "WorkerFailed",
    "WorkerProgress",
    "WorkerRescuing",
    "WorkerStoreOutage",
    "decode",
    "encode",
    "message_types",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_SIZE = 1 << 20

_I64_MAX = (1 << 63) - 1
_U64_MAX = (1 << 64) - 1
_SMALL_MAX = (1 << 31) - 1    # ranks, stages, slots, sizes: anything that indexes real hardware
_MAX_ID = 128
_MAX_TEXT = 16 * 1024         # reasons and error text: enough for a traceback tail, not a log file
_MAX_PATH = 4096
_ID_RE = re.compile(r"[A-Za-z0-9._:@-]+")


# --- field kinds: one object per field says how to check it, write it and read it back -------------

def _short(value: Any) -> str:
    # Error text may quote a peer's value: keep it short so a hostile message cannot flood logs.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return type(value).__name__


class _Kind:
    """check: validate (and normalise) a value, run by the record's __post_init__.
    dump: value -> msgpack-native. load: msgpack-native -> what check expects; plain kinds pass the
    wire value through, so each field is validated exactly once, by check."""

    def check(self, where: str, value: Any) -> Any:
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return value

    def load(self, where: str, wire: Any) -> Any:
        return wire


class _Int(_Kind):
    def __init__(self, lo: int = 0, hi: int = _I64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, where: str, value: Any) -> int:
        if isinstance(value, bool):
            raise MessageValueError(f"{where} must be an integer, not a bool")
        try:
            number = operator.index(value)
        except TypeError:
            raise MessageValueError(f"{where} must be an integer, got {_type_name(value)}") from None
        if not self.lo <= number <= self.hi:
            raise MessageValueError(f"{where} must be in [{self.lo}, {self.hi}], got {_short(number)}")
        return number


class _Float(_Kind):
    def __init__(self, lo: float = -math.inf, hi: float = math.inf, *, finite: bool = True) -> None:
        self.lo, self.hi, self.finite = lo, hi, finite

    def check(self, where: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageValueError(f"{where} must be a number, got {_type_name(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise MessageValueError(f"{where} is too large for a float") from None
        if not math.isfinite(number):
            if not self.finite:
                return number
            raise MessageValueError(f"{where} must be finite, got {number}")
        if not self.lo <= number <= self.hi:
            raise MessageValueError(f"{where} must be in [{self.lo}, {self.hi}], got {number}")
        return number


class _Bool(_Kind):
    def check(self, where: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise MessageValueError(f"{where} must be true or false, got {_type_name(value)}")
        return value


class _Str(_Kind):
    def __init__(self, max_len: int, *, min_len: int = 1, pattern: re.Pattern[str] | None = None,
                 what: str = "", nul: bool = False) -> None:
        self.max_len, self.min_len, self.pattern, self.what, self.nul = max_len, min_len, pattern, what, nul

    def check(self, where: str, value: Any) -> str:
        if not isinstance(value, str):
            raise MessageValueError(f"{where} must be a string, got {_type_name(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            hint = "; keep its tail" if self.min_len == 0 else ""
            raise MessageValueError(
                f"{where} must have {self.min_len}..{self.max_len} characters, got {len(value)}{hint}")
        if not self.nul and "\x00" in value:
            raise MessageValueError(f"{where} must not contain NUL characters")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise MessageValueError(f"{where} must be {self.what}, got {_short(value)}")
        return value


class _Optional(_Kind):
    def __init__(self, inner: _Kind) -> None:
        self.inner = inner

    def check(self, where: str, value: Any) -> Any:
        return None if value is None else self.inner.check(where, value)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)

    def load(self, where: str, wire: Any) -> Any:
        return None if wire is None else self.inner.load(where, wire)


class _Tuple(_Kind):
    def __init__(self, item: _Kind, max_items: int) -> None:
        self.item, self.max_items = item, max_items

    def _items(self, where: str, value: Any) -> list | tuple:
        if not isinstance(value, (list, tuple)):
            raise MessageValueError(f"{where} must be a sequence, got {_type_name(value)}")
        if len(value) > self.max_items:
            raise MessageValueError(f"{where} has {len(value)} items; at most {self.max_items} are allowed")
        return value

    def check(self, where: str, value: Any) -> tuple:
        return tuple(self.item.check(f"{where}[{i}]", v) for i, v in enumerate(self._items(where, value)))

    def dump(self, value: Any) -> list:
        return [self.item.dump(v) for v in value]

    def load(self, where: str, wire: Any) -> Any:
        if type(self.item).load is _Kind.load:
            return wire
        return [self.item.load(f"{where}[{i}]", v) for i, v in enumerate(self._items(where, wire))]


def _f(kind: _Kind) -> Any:
    """A dataclass field checked by `kind` on construction and on decode."""
    return field(metadata={"kind": kind})


_ID = _Str(_MAX_ID, pattern=_ID_RE, what="an identifier of letters, digits and . _ - : @")
_TEXT = _Str(_MAX_TEXT, min_len=0, nul=True)   # free text: error output may hold anything
_PATH = _Str(_MAX_PATH)
_EPOCH = _Int()
_RANK = _Int(0, _SMALL_MAX)
_STEP = _Int()


# --- records: frozen dataclasses whose fields carry kinds -------------------------------------------

_FIELD_CACHE: dict[type, tuple[tuple[str, _Kind], ...]] = {}


def _kinds(cls: type) -> tuple[tuple[str, _Kind], ...]:
    cached = _FIELD_CACHE.get(cls)
    if cached is None:
        cached = tuple((f.name, f.metadata["kind"]) for f in fields(cls))
        _FIELD_CACHE[cls] = cached
    return cached


@dataclass(frozen=True, slots=True, kw_only=True)
class _Record:
    """Base of messages and the value objects inside them: checks every field, then `_validate`."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field_name, kind in _kinds(type(self)):
            value = getattr(self, field_name)
            checked = kind.check(f"{name}.{field_name}", value)
            if checked is not value:
                object.__setattr__(self, field_name, checked)
        self._validate()

    def _validate(self) -> None:
        """Rules across fields; subclasses raise MessageValueError."""


def _dump_record(record: _Record) -> dict[str, Any]:
    return {name: kind.dump(getattr(record, name)) for name, kind in _kinds(type(record))}


def _load_record(cls: type[_Record], wire: Any, where: str) -> Any:
    if not isinstance(wire, dict):
        raise MessageValueError(f"{where} must be a map of fields, got {_type_name(wire)}")
    kinds = _kinds(cls)
    expected = {name for name, _ in kinds}
    if wire.keys() != expected:
        missing = sorted(expected - wire.keys())
        unknown = sorted(k for k in wire if k not in expected)
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {_short(unknown)}")
        raise MessageValueError(f"{where} has the wrong fields ({'; '.join(parts)})")
    return cls(**{name: kind.load(f"{where}.{name}", wire[name]) for name, kind in kinds})


# --- strict msgpack ---------------------------------------------------------------------------------

def _unique_str_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise ProtocolError(f"map keys must be strings, got {_type_name(key)}")
        if key in out:
            raise ProtocolError(f"map key {_short(key)} appears twice")
        out[key] = value
    return out


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _unpack(data: Any, max_size: int, what: str) -> Any:
    """msgpack bytes -> plain Python values, or ProtocolError. Shared with frames.py."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = memoryview(data)
        except TypeError:
            raise ProtocolError(f"a {what} must be bytes, got {_type_name(data)}") from None
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_size:
        raise ProtocolError(f"a {what} of {size} bytes exceeds the limit of {max_size}")
    if size == 0:
        raise ProtocolError(f"an empty {what}")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, timestamp=0,
            object_pairs_hook=_unique_str_map, ext_hook=_refuse_ext,
            max_str_len=size, max_bin_len=0, max_array_len=size, max_map_len=size, max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ValueError, FormatError, StackError, ...)
        detail = str(exc)
        if len(detail) > 120:
            detail = detail[:117] + "..."
        cause = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        raise ProtocolError(f"a {what} that is not valid msgpack ({cause})") from None


def _pack(payload: Any) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


# --- messages ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Message(_Record):
    """A control message. Subclasses set TYPE, the tag that names them on the wire."""

    TYPE: ClassVar[str] = ""


def _register(cls: type[Message]) -> type[Message]:
    if not cls.TYPE or cls.TYPE in _REGISTRY:
        raise RuntimeError(f"message type tag {cls.TYPE!r} of {cls.__name__} is empty or taken")
    _REGISTRY[cls.TYPE] = cls
    return cls


def message_types() -> dict[str, type[Message]]:
    """Type tag -> message class, for every message `decode` accepts."""
    return dict(_REGISTRY)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping(Message):
    """Liveness probe; the peer answers with a Pong carrying the same nonce."""

    TYPE: ClassVar[str] = "ping"
    sender: str = _f(_ID)
    nonce: int = _f(_Int(0, _U64_MAX))


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanChanged(Message):
    """The leader wrote a new plan at `epoch`: read it from etcd now, not at the next watch event.
    etcd holds the plan; this push only saves the wait, so it carries nothing else."""

    TYPE: ClassVar[str] = "plan_changed"
    epoch: int = _f(_EPOCH)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    sender: str = _f(_ID)
    nonce: int = _f(_Int(0, _U64_MAX))


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class StopWorkers(Message):
    """Stop the job's workers of `epoch` (after a checkpoint when `checkpoint` is true)."""

    TYPE: ClassVar[str] = "stop_workers"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    reason: str = _f(_TEXT)
    checkpoint: bool = _f(_Bool())


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointNow(Message):
    """Checkpoint at the next step boundary and keep running."""

    TYPE: ClassVar[str] = "checkpoint_now"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    reason: str = _f(_TEXT)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerProgress(Message):
    """A worker finished `step`. `loss` may be NaN or infinite: a diverged step, which the workers
    agreed to skip, is still a step the job took (unreported, the daemon saw no progress and the
    leader restarted a diverged job as stuck);
    `busy_fraction` is the share of wall time spent computing rather than waiting, in [0, 1];
    `peak_bytes` the most memory it has held since its stage was built, as the plan counts it (on a
    GPU its tensors, on a CPU its whole process; 0: not measured);
    `compute_s` the seconds its stage computed per micro-batch in the step, waits on peers and the
    stage-wide all-reduce and optimizer step left out (0: not measured), which the leader compares
    across slots to find a slow one."""

    TYPE: ClassVar[str] = "worker_progress"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    rank: int = _f(_RANK)
    step: int = _f(_STEP)
    loss: float = _f(_Float(finite=False))
    samples_per_s: float = _f(_Float(0.0))
    busy_fraction: float = _f(_Float(0.0, 1.0))
    peak_bytes: int = field(default=0, metadata={"kind": _Int(0, _U64_MAX)})
    compute_s: float = field(default=0.0, metadata={"kind": _Float(0.0)})


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerCheckpointed(Message):
    """A worker's share of the checkpoint of `step` is in place at `path`. `stalled_s` is how long
    its training stood still for it: the whole write, or for a checkpoint staged in a local
    directory and copied in the background, the local write alone."""

    TYPE: ClassVar[str] = "worker_checkpointed"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    rank: int = _f(_RANK)
    step: int = _f(_STEP)
    path: str = _f(_PATH)
    stalled_s: float = _f(_Float(0.0))


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRescuing(Message):
    """A worker whose epoch broke is writing the state it holds, that of `step` completed steps,
    into the store for the next epoch (trainer.checkpoint.rescue): its daemon gives it the time
    of a checkpoint, not the short grace of a worker blocked on a dead peer, before SIGKILL."""

    TYPE: ClassVar[str] = "worker_rescuing"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    rank: int = _f(_RANK)
    step: int = _f(_STEP)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStoreOutage(Message):
    """The checkpoint store refuses this worker's writes (full, read-only, failing) since the
    checkpoint of `step`, for `error`; the worker keeps training, or holds its state and retries a
    write it cannot go on without. `failing` false: a write went through again (so does any
    WorkerCheckpointed)."""

    TYPE: ClassVar[str] = "worker_store_outage"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    rank: int = _f(_RANK)
    step: int = _f(_STEP)
    failing: bool = _f(_Bool())
    error: str = _f(_TEXT)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerFailed(Message):
    """A worker stopped with an error. `exit_code` is None while the process is still alive
    (an error it caught and reported), negative for a signal as in `subprocess`."""

    TYPE: ClassVar[str] = "worker_failed"
    job: str = _f(_ID)
    epoch: int = _f(_EPOCH)
    rank: int = _f(_RANK)
    error: str = _f(_TEXT)
    exit_code: int | None = _f(_Optional(_Int(-255, 255)))


# --- encode / decode --------------------------------------------------------------------------------

def encode(msg: Message, *, max_size: int = MAX_MESSAGE_SIZE) -> bytes:
    """One message -> the bytes of one frame. Raises MessageValueError past `max_size`, because
    receivers with the default limit would refuse it."""
    cls = type(msg)
    if not isinstance(msg, Message) or _REGISTRY.get(cls.TYPE) is not cls:
        raise TypeError(f"encode takes a registered Message, got {_type_name(msg)}")
    data = _pack([PROTOCOL_VERSION, cls.TYPE, _dump_record(msg)])
    if len(data) > max_size:
        raise MessageValueError(f"{cls.__name__} encodes to {len(data)} bytes, over the limit of {max_size}")
    return data


def decode(data: bytes, *, max_size: int = MAX_MESSAGE_SIZE) -> Message:
    """The bytes of one frame -> a validated message. Raises ProtocolError, and only that, on any
    input that is not exactly what `encode` produces for a valid message."""
    obj = _unpack(data, max_size, "message")
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("a message must be a msgpack array [version, type, fields]")
    version, tag, body = obj
    if isinstance(version, bool) or not isinstance(version, int) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {_short(version)} is not {PROTOCOL_VERSION}; run the same varunad release everywhere")
    if not isinstance(tag, str) or tag not in _REGISTRY:
        raise ProtocolError(f"unknown message type {_short(tag)}")
    cls = _REGISTRY[tag]
    try:
        return _load_record(cls, body, cls.__name__)
    except MessageValueError as exc:
        raise ProtocolError(f"bad {tag} message: {exc.reason}") from None
