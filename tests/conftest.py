"""Shared pytest fixtures and hooks. Keep each section short; add new sections at the end.

Sections:
  * async tests: ``async def test_...`` runs on a fresh event loop, with a time limit.
  * etcd: a real etcd server per test module (``etcd``), a private one for fault injection
    (``etcd_fault``), and a unique key root per test (``etcd_root``).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import uuid

import pytest
from support.etcd_server import EtcdNotInstalled, EtcdServer

# ----------------------------------------------------------------------------- async tests

# Generous: a test that hangs on etcd should fail, not stall CI.
ASYNC_TEST_TIMEOUT = 120.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests with asyncio.run (no pytest-asyncio needed).

    Tests marked ``@pytest.mark.asyncio`` are left to pytest-asyncio if it is installed.
    """
    func = pyfuncitem.obj
    if not inspect.iscoroutinefunction(func) or pyfuncitem.get_closest_marker("asyncio"):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(func(**kwargs), ASYNC_TEST_TIMEOUT))
    return True


# ----------------------------------------------------------------------------- etcd


def _start_server() -> EtcdServer:
    missing = None
    try:
        server = EtcdServer()
    except EtcdNotInstalled as exc:
        missing = str(exc)
    if missing is not None:  # a failure, never a skip: a CI without etcd must not pass quietly
        pytest.fail(missing, pytrace=False)
    try:
        server.start()
    except BaseException:
        server.close()  # no stray process or data directory when etcd fails to start
        raise
    return server


@pytest.fixture(scope="module")
def etcd() -> EtcdServer:
    """A running etcd shared by the tests of one module. Do not stop or pause it: use etcd_fault."""
    server = _start_server()
    yield server
    server.close()


@pytest.fixture
def etcd_fault() -> EtcdServer:
    """A private etcd for one test, which may pause, stop, kill and restart it."""
    server = _start_server()
    yield server
    server.close()


@pytest.fixture
def etcd_root(request: pytest.FixtureRequest) -> str:
    """A key root no other test uses, e.g. ``/t/test_put_get-1a2b3c4d/``."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60]
    return f"/t/{name}-{uuid.uuid4().hex[:8]}/"
