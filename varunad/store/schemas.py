"""The one place that decides whether a document read from etcd has the right shape.

Every value the daemons read from etcd is JSON written by another process: a daemon of another
release, ``varunactl``, or a person with ``etcdctl``. A value of the wrong type must never reach
code that trusts it (``reason[:1000]`` on an int stopped every daemon of a fleet), so each
document kind is a frozen dataclass whose annotated field types *are* its schema, and
:func:`check` compares a decoded JSON object against them before the dataclass is built:
``str``, ``int`` (not ``bool``), ``float`` (an int is fine), ``bool``, ``X | None``,
``tuple[X, ...]`` (a JSON list), ``dict[str, X]``/``Mapping[str, X]``, ``Any`` and nested
dataclasses. Fields the dataclass does not know are left to the caller (newer releases add
fields; older readers ignore them).

:data:`DOCUMENTS` names every document kind and its key family in one table; :func:`reject`
is how a reader reports a value it ignores: logged once per key and reason (then at most once a
minute), and counted per kind (``varunad_bad_documents{kind}`` on the metrics endpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union

__all__ = ["DOCUMENTS", "strict_json", "load_json", "check", "build", "decode", "decoded", "reject", "rejected", "on_reject",
           "Throttle"]

log = logging.getLogger("varunad.store.schemas")

T = TypeVar("T")

# kind -> (key family under the root, the class whose fields are its schema). For the reader,
# the README and the chaos suite's "garbage in every key family" scenario.
DOCUMENTS: dict[str, tuple[str, str]] = {
    "member": ("members/<name>", "varunad.cluster.facts:DaemonMember"),
    "leader": ("leader", "member name (text) on the leader's member lease"),
    "plan": ("plan", "varunad.control.plans:PlanDoc"),
    "plan-writer": ("plan-writer", "varunad.cluster.election:PlanWriter"),
    "job": ("jobs/<job>", "varunad.control.jobs:JobSpec"),
    "state": ("state/<job>", "varunad.control.jobs:JobState"),
    "report": ("workers/<member>", "varunad.control.records:WorkerReport"),
    "progress": ("progress/<job>/<rank>", "varunad.control.records:Progress"),
    "history": ("history/<job>/<epoch>/<member>/<chunk>", "varunad.control.records:decode_history"),
    "calibration": ("calibration/<fingerprint>/<kind>", "trainer.planning.calibration:Calibration"),
    "bundle": ("bundles/<job>", "zip checked against the spec's digest (and signature)"),
}

_hints: dict[type, dict[str, Any]] = {}
_lock = threading.Lock()


def _type_hints(cls: type) -> dict[str, Any]:
    hints = _hints.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        with _lock:
            _hints[cls] = hints
    return hints


def _problem(value: Any, tp: Any) -> str | None:
    """Why ``value`` (decoded JSON) is not of type ``tp``; None when it is."""
    if tp is Any or tp is object:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        problems = [_problem(value, t) for t in options if t is not type(None)]
        if any(p is None for p in problems):
            return None
        return problems[0] if len(problems) == 1 else f"{value!r:.60} is none of {tp}"
    if tp is type(None):
        return None if value is None else f"expected null, got {value!r:.60}"
    if tp is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r:.60}"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected an integer, got {value!r:.60}"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {value!r:.60}"
    if tp is str:
        return None if isinstance(value, str) else f"expected a string, got {value!r:.60}"
    if origin is tuple or origin is list or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return f"expected a list, got {value!r:.60}"
        args = typing.get_args(tp)
        if args and (len(args) == 2 and args[1] is Ellipsis or origin is list):
            for i, item in enumerate(value):
                p = _problem(item, args[0])
                if p is not None:
                    return f"item {i}: {p}"
        elif args:
            if len(args) != len(value):
                return f"expected {len(args)} items, got {len(value)}"
            for i, (item, t) in enumerate(zip(value, args)):
                p = _problem(item, t)
                if p is not None:
                    return f"item {i}: {p}"
        return None
    if origin in (dict, Mapping) or tp in (dict, Mapping) or origin is typing.get_origin(Mapping[str, int]):
        if not isinstance(value, Mapping):
            return f"expected an object, got {value!r:.60}"
        args = typing.get_args(tp)
        if args:
            for k, v in value.items():
                p = _problem(k, args[0]) or _problem(v, args[1])
                if p is not None:
                    return f"entry {k!r:.40}: {p}"
        return None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return None
        if not isinstance(value, Mapping):
            return f"expected an object, got {value!r:.60}"
        try:
            check(tp, value)
        except ValueError as exc:
            return str(exc)
        return None
    return None  # a type this checker does not know: the dataclass's own checks decide


def strict_json(doc: Any, **dumps: Any) -> str:
    """``doc`` as JSON every parser takes: a non-finite float (a diverged step's NaN loss) is null,
    where Python's json would write the NaN that jq and JSON.parse refuse."""
    return json.dumps(_finite(doc), allow_nan=False, **dumps)


def _finite(doc: Any) -> Any:
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, Mapping):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc


def load_json(data: bytes | str) -> Any:
    """A stored value parsed as JSON; whatever is wrong with it (not text, not JSON, nested past
    the parser's depth: a RecursionError) is a ValueError, the one error readers catch."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check(cls: type, doc: Mapping[str, Any], what: str | None = None) -> Mapping[str, Any]:
    """Raise ValueError naming the first field of ``doc`` whose value is not of its declared type
    in dataclass ``cls``, or a required field that is missing; returns ``doc``."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{what or cls.__name__} is not a JSON object")
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in doc:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{what or cls.__name__} lacks field {f.name!r}")
            continue
        p = _problem(doc[f.name], hints.get(f.name, Any))
        if p is not None:
            raise ValueError(f"{what or cls.__name__} field {f.name!r}: {p}")
    return doc


def build(cls: type[T], doc: Mapping[str, Any], what: str | None = None) -> T:
    """``cls`` from ``doc`` once :func:`check` passes; fields ``cls`` does not know (a newer
    release's) are left out."""
    check(cls, doc, what)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in doc.items() if k in known})


def decode(cls: type[T], data: bytes, what: str, *, upgrade: Callable[[Any], Any] | None = None) -> T:
    """``cls`` from a stored JSON value (see :func:`build`); anything wrong with it, from bytes
    that are not JSON to a field of the wrong type, is one ValueError "<what> is malformed: ...".
    ``upgrade`` turns the parsed JSON of an older release's form into this one's first."""
    try:
        doc = load_json(data)
        return build(cls, upgrade(doc) if upgrade is not None else doc, what)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} is malformed: {exc}") from None


_DECODED: dict[tuple[Callable[[bytes], Any], str], tuple[bytes, Any]] = {}
_DECODED_MAX = 50_000
_decoded_lock = threading.Lock()


def decoded(key: str, data: bytes, decode: Callable[[bytes], T]) -> T:
    """``decode(data)``, reusing the document decoded last for ``key`` while its value is byte for
    byte the same (the documents are frozen). The leader reads whole prefixes every cycle: at 300
    VMs, checking the same members, worker reports and links again was most of its CPU
    (benchmarks/fleet_scale.py). A value that does not decode is not kept: it raises each time."""
    memo = (decode, key)
    with _decoded_lock:
        hit = _DECODED.get(memo)
    if hit is not None and hit[0] == data:
        return hit[1]
    value = decode(data)
    with _decoded_lock:
        if len(_DECODED) >= _DECODED_MAX:   # keys of VMs long gone: start again
            _DECODED.clear()
        _DECODED[memo] = (bytes(data), value)
    return value


class Throttle:
    """Say each distinct thing at most once per ``interval`` seconds (a junk key read every
    leader cycle would otherwise log a line per cycle, forever)."""

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[Any, float] = {}

    def __call__(self, what: Any) -> bool:
        now = self.clock()
        last = self._last.get(what)
        if last is not None and now - last < self.interval:
            return False
        if len(self._last) > 10000:  # a flood of distinct junk must not grow this without bound
            self._last.clear()
        self._last[what] = now
        return True


_counts: dict[str, int] = {}
_listeners: list[Callable[[str], None]] = []
_throttle = Throttle()


def on_reject(listener: Callable[[str], None]) -> None:
    """Call ``listener(kind)`` for every rejected document (the daemon's metric)."""
    _listeners.append(listener)


def rejected() -> dict[str, int]:
    """Documents ignored so far in this process, by kind."""
    return dict(_counts)


def reject(kind: str, key: str, reason: object, *, level: int = logging.WARNING) -> None:
    """Report that the value at ``key`` (a document of ``kind``) was ignored because of ``reason``."""
    _counts[kind] = _counts.get(kind, 0) + 1
    for listener in _listeners:
        try:
            listener(kind)
        except Exception:  # a metric must not turn bad data into a crash
            log.debug("reject listener failed", exc_info=True)
    if _throttle((key, str(reason))):
        log.log(level, "ignored %s key %s: %s (said once a minute; counted in varunad_bad_documents)",
                kind, key, reason)
