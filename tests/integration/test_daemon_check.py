"""varunad's pieces without processes: config and its timing rules, job specs and bundles, plan
documents, and the leader's decisions from snapshot data (Patroni's layer of unit tests).

The tests of tests/unit/test_daemon_units.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import subprocess
import sys

from support import REPO

from varunad.node.config import load_config

BASE = ["--etcd", "127.0.0.1:2379", "--store", "/tmp/store", "--plaintext"]


# --- config ---------------------------------------------------------------------------------------


def test_advertise_defaults_to_the_route_to_etcd_and_check_prints_the_settings(tmp_path):
    from varunad.node.config import route_address

    assert load_config(BASE, environ={}).advertise == "127.0.0.1"   # etcd on loopback: the loopback route
    assert route_address("http://127.0.0.1:2379,10.9.9.9:2379") == "127.0.0.1"   # the first endpoint's
    assert route_address("etcd.invalid:2379") == "127.0.0.1"   # unresolvable: a safe default
    assert load_config([*BASE, "--advertise", "10.0.0.7"], environ={}).advertise == "10.0.0.7"
    daemon = [sys.executable, "-m", "varunad.node.daemon"]
    r = subprocess.run([*daemon, *BASE, "--advertise", "10.0.0.7", "--check"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0 and "advertise=10.0.0.7" in r.stdout.splitlines(), r.stdout + r.stderr
    assert "--advertise 10.0.0.7 is no address of this host" in r.stderr
    bad = tmp_path / "bad.env"
    bad.write_text("garbage\n")
    r = subprocess.run([*daemon, "--env-file", str(bad), "--check"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 2 and "bad.env:1: expected KEY=VALUE" in r.stderr


def test_varunad_help_and_errors():
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "varunad.node.daemon", "--help"], capture_output=True, text=True, env=env,
                       cwd=str(REPO), timeout=60)
    assert r.returncode == 0 and "SIGTERM" in r.stdout and "VARUNAD_" in r.stdout and "--curve-keys" in r.stdout
    r = subprocess.run([sys.executable, "-m", "varunad.node.daemon", "--store", "/tmp/x", "--plaintext"], capture_output=True,
                       text=True, env=env, cwd=str(REPO), timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no etcd endpoint" in r.stderr


def test_the_daemon_never_imports_torch():
    code = ("import sys, varunad.node.daemon, varunad.node.leader, varunad.node.supervisor, varunad.ctl.cli, varunad.ctl.commands; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert r.stdout.strip() == "False", r.stderr
