"""Fixtures of the integration tests. Keep each section short; add new sections at the end.

Sections:
  * etcd: a real etcd server per test module (``etcd``), a private one for fault injection
    (``etcd_fault``), and a unique key root per test (``etcd_root``). Unit tests (tests/unit/)
    have none of these: they run without an etcd server.
"""

from __future__ import annotations

import re
import uuid

import pytest
from support.etcd_server import EtcdNotInstalled, EtcdServer

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
