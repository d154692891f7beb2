"""Bounded waits for tests: call a check until it returns something truthy, instead of sleeping.

``until`` (sync) and ``until_async`` (its twin inside a coroutine; the check may be sync or
async) return the check's first truthy value. When ``timeout`` passes first they fail the test
with an AssertionError that says what was awaited, for how long, the last value the check
returned and, where ``retry_on`` let a check's exception count as "not yet", the last such
error; ``on_timeout`` adds more (e.g. a ring's daemon log tails)::

    st = until(lambda: ring.job_state("j"), "job j's state", timeout=30)
    leader = await until_async(find_leader, "exactly one agreed leader", timeout=5, interval=0.05)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["until", "until_async"]

T = TypeVar("T")


def _failure(what: str, timeout: float, last: Any, error: BaseException | None,
             on_timeout: Callable[[], str] | None) -> AssertionError:
    message = f"{what} not reached within {timeout:.1f}s (last value {last!r}"
    message += f", last error {error!r})" if error is not None else ")"
    if on_timeout is not None:
        message += "\n" + on_timeout()
    return AssertionError(message)


def until(check: Callable[[], T], what: str, timeout: float, interval: float = 0.1, *,
          retry_on: tuple[type[BaseException], ...] = (),
          on_timeout: Callable[[], str] | None = None) -> T:
    """``check()`` until it is truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result, error = check(), None
        except retry_on as exc:
            result, error = None, exc
        if result:
            return result
        if time.monotonic() > deadline:
            raise _failure(what, timeout, result, error, on_timeout)
        time.sleep(interval)


async def until_async(check: Callable[[], Awaitable[T] | T], what: str, timeout: float, interval: float = 0.05, *,
                      retry_on: tuple[type[BaseException], ...] = (),
                      on_timeout: Callable[[], str] | None = None) -> T:
    """``until`` inside a coroutine: ``check`` may return an awaitable, which is awaited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result, error = check(), None
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
        except retry_on as exc:
            result, error = None, exc
        if result:
            return result
        if time.monotonic() > deadline:
            raise _failure(what, timeout, result, error, on_timeout)
        await asyncio.sleep(interval)
