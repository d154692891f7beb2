"""etcd security an operator can turn on (issue 17, item 3): a daemon whose etcd user may only
touch the fleet's prefix starts and joins; varunactl takes the same TLS and user options as
flags and VARUNAD_ETCD_* variables. Real etcd (auth on, TLS with client certificates), a real
daemon process, the real varunactl."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from support import REPO
from support.etcd_server import EtcdServer, make_pki

from varunad.store.contract import StoreAuthError
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

pytestmark = pytest.mark.slow

ROOT = "/fleet/"


def _gateway(server: EtcdServer, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    req = urllib.request.Request(f"http://{server.endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                 headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read() or b"{}")


def _limited_user(server: EtcdServer) -> None:
    """root (for the operator) and `fleet`, whose role may read and write ROOT and nothing else:
    what README's Security section tells an operator to set up."""
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    end = ROOT[:-1] + chr(ord(ROOT[-1]) + 1)
    for path, body in (("auth/role/add", {"name": "root"}), ("auth/user/add", {"name": "root", "password": "rootpw"}),
                       ("auth/user/grant", {"user": "root", "role": "root"}),
                       ("auth/role/add", {"name": "fleet"}),
                       ("auth/role/grant", {"name": "fleet", "perm": {"permType": "READWRITE", "key": b64(ROOT),
                                                                     "range_end": b64(end)}}),
                       ("auth/user/add", {"name": "fleet", "password": "fleetpw"}),
                       ("auth/user/grant", {"user": "fleet", "role": "fleet"}),
                       ("auth/enable", {})):
        _gateway(server, path, body)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARUNAD_")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _varunactl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--root", ROOT, "--timeout", "5", *args],
                          capture_output=True, text=True, cwd=str(REPO), env=env, timeout=60)


async def test_a_daemon_whose_user_may_only_touch_the_prefix_joins(tmp_path):
    with EtcdServer() as server:
        _limited_user(server)
        # the limit holds: outside the prefix the fleet user is refused
        async with EtcdStore(server.endpoint, user="fleet", password="fleetpw", probe_key=ROOT) as store:
            with pytest.raises(StoreAuthError):
                await store.get("/elsewhere")
        cmd = [sys.executable, "-m", "varunad.node.daemon", "--etcd", server.endpoint, "--name", "vm1", "--root", ROOT,
               "--advertise", "127.0.0.1", "--slots", "1", "--store", str(tmp_path / "store"), "--state-dir",
               str(tmp_path / "state"), "--ttl", "2", "--plaintext", "--etcd-user", "fleet", "--log-level", "INFO"]
        log = tmp_path / "vm1.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO),
                                    env=_env(VARUNAD_ETCD_PASSWORD="fleetpw"), start_new_session=True)
        try:
            env = _env(VARUNAD_ETCD=server.endpoint, VARUNAD_ETCD_USER="fleet", VARUNAD_ETCD_PASSWORD="fleetpw")
            deadline = 60
            import time
            start = time.monotonic()
            while True:
                assert proc.poll() is None, log.read_text()
                r = _varunactl("nodes", env=env)
                if r.returncode == 0 and "vm1" in r.stdout:
                    break
                assert time.monotonic() - start < deadline, (r.stdout, r.stderr, log.read_text())
                time.sleep(0.3)
            # the leader key is there too, and plan writes work: it leads and cleared the plan
            async with EtcdStore(server.endpoint, user="fleet", password="fleetpw", probe_key=ROOT) as store:
                kv = await store.get(Keys(ROOT).leader)
                assert kv is not None and kv.value == b"vm1"
            # without the password varunactl says what is missing, in one line
            r = _varunactl("nodes", env=_env(VARUNAD_ETCD=server.endpoint, VARUNAD_ETCD_USER="fleet"))
            assert r.returncode != 0 and "VARUNAD_ETCD_PASSWORD" in r.stderr
            # what etcd refused, and the option to fix, in one line (it said "connection refused")
            refused = {
                "refused user 'fleet' and its password: check --etcd-user": ("--etcd-user", "fleet", "nodes"),
                "requires a user (authentication is on): pass --etcd-user": ("nodes",),
                "denied user 'fleet' access to '/other/' (permission denied): pass the --root":
                    ("--etcd-user", "fleet", "--root", "/other/", "status"),
            }
            for said, args in refused.items():
                password = "fleetpw" if "--root" in args else "wrong"
                r = _varunactl(*args, env=_env(VARUNAD_ETCD=server.endpoint, VARUNAD_ETCD_PASSWORD=password)
                               if "--etcd-user" in args else _env(VARUNAD_ETCD=server.endpoint))
                assert r.returncode == 1 and said in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        assert proc.returncode == 0, log.read_text()


def test_varunactl_speaks_tls_with_a_client_certificate(tmp_path):
    pki = make_pki(tmp_path / "pki")
    with EtcdServer(pki=pki) as server:
        r = _varunactl("--etcd", server.endpoint, "--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert),
                       "--etcd-key", str(pki.client_key), "nodes", env=_env())
        assert r.returncode == 0, r.stderr
        env = _env(VARUNAD_ETCD=server.endpoint, VARUNAD_ETCD_CA=str(pki.ca), VARUNAD_ETCD_CERT=str(pki.client_cert),
                   VARUNAD_ETCD_KEY=str(pki.client_key))
        assert _varunactl("nodes", env=env).returncode == 0
        # each TLS mistake is one line naming the option to fix (gRPC's own log lines are not shown)
        mistakes = {
            "closed a plaintext connection: it speaks TLS? pass --etcd-ca": (),   # plaintext to a TLS etcd
            f"cannot read --etcd-ca (VARUNAD_ETCD_CA) file {tmp_path / 'nope.pem'} (No such file or directory)":
                ("--etcd-ca", str(tmp_path / "nope.pem")),
            "refused the TLS handshake: it may want a client certificate; pass --etcd-cert": ("--etcd-ca", str(pki.ca)),
            "its TLS certificate is not signed by": ("--etcd-ca", str(pki.client_cert), "--etcd-cert",
                                                      str(pki.client_cert), "--etcd-key", str(pki.client_key)),
        }
        for said, args in mistakes.items():
            r = _varunactl("--etcd", server.endpoint, *args, "nodes", env=_env())
            assert r.returncode == 1 and said in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
