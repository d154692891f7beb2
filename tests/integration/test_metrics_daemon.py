"""Prometheus metrics (varunad.node.metrics): the registry and its exposition, the asyncio endpoint, and
a daemon that cannot serve them (tests/integration/test_daemon_single.py scrapes a real daemon running a job).

The tests of tests/unit/test_metrics.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import socket
import subprocess

import pytest
from support.ring import Ring

# A daemon serving every documented metric while it runs a job: tests/integration/test_daemon_single.py's first
# test (one daemon start for both).


def test_a_taken_metrics_port_is_a_clear_startup_error(tmp_path, etcd, etcd_root):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
        try:
            d = ring.start("clash", "--metrics-port", str(port))
            try:
                code = d.proc.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail("the daemon kept running with its metrics port taken\n" + ring.tails())
            out = d.log_text()
            assert code != 0, out
            assert f"cannot serve metrics on 127.0.0.1:{port}" in out and "Traceback" not in out, out
            assert not ring.member_present("clash")
        finally:
            ring.close()
