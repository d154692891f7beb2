"""Shared pytest hooks for the whole suite. Keep each section short; add new sections at the end.

The suite is split by directory (tests/README.md has the rule):
  * tests/unit/: runs inside the pytest process: no etcd server, no child process, no socket to
    another process (two ZeroMQ or TCP sockets of the test process talking to each other are
    fine). ``python3 -m pytest tests/unit`` is the fast loop.
  * tests/integration/: the real parts: a real etcd (its fixtures are in
    tests/integration/conftest.py), daemon and worker processes, sockets between them, training;
    chaos/ and netns/ are under it.
  * tests/support/: the helpers test modules share (a test module never imports another one);
    this directory is on sys.path because this conftest.py is pytest's rootdir conftest.

Sections:
  * async tests: ``async def test_...`` runs on a fresh event loop, with a time limit.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

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
