"""A real etcd for tests: start, stop, freeze (SIGSTOP), resume and restart on the same data.

Used by the fixtures in conftest.py; fault-injection tests drive it directly::

    server.pause()      # etcd frozen: requests hang until their timeouts
    server.resume()
    server.stop()       # graceful SIGTERM, data kept
    server.start()      # same name, data dir and ports: leases and keys survive
    server.kill()       # SIGKILL, like a crashed VM

Also ``make_pki`` (a throwaway CA with server and client certificates, for TLS tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from trainer.launch import free_ports

__all__ = ["EtcdServer", "EtcdNotInstalled", "Pki", "make_pki", "find_etcd"]

T = TypeVar("T")

INSTALL_HINT = (
    "the tests need a real etcd server binary: install it with "
    "`apt-get install -y etcd-server` (Debian/Ubuntu), or put `etcd` on PATH, "
    "or set VARUNAD_TEST_ETCD=/path/to/etcd"
)


class EtcdNotInstalled(RuntimeError):
    pass


def find_etcd() -> str:
    explicit = os.environ.get("VARUNAD_TEST_ETCD")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdNotInstalled(f"VARUNAD_TEST_ETCD={explicit} is not executable; {INSTALL_HINT}")
        return explicit
    found = shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise EtcdNotInstalled(f"no `etcd` binary found; {INSTALL_HINT}")
    return found


def die_with_parent() -> list[str]:
    """A prefix for a command line: the process gets SIGKILL when the test process dies."""
    # If pytest is killed, etcd (or a daemon) must not linger holding ports. Not a preexec_fn calling prctl:
    # that forces a plain fork() of a process with gRPC threads, whose fork handlers can wedge
    # the child before exec. setpriv (util-linux) sets the parent-death signal, then execs etcd.
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL"] if setpriv else []


@dataclass(frozen=True)
class Pki:
    """Files of a throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(directory: Path) -> Pki:
    """Create a CA and certificates with the openssl CLI (seconds; for TLS tests only)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=varunad-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", f"{who}.key", "-out", f"{who}.csr")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.crt")
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


class EtcdServer:
    """One single-member etcd on loopback ports, in its own temporary data directory."""

    def __init__(
        self,
        *,
        name: str | None = None,
        pki: Pki | None = None,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host  # the client address (tests/netns: the bridge's); peers stay on loopback
        self.binary = binary or find_etcd()
        self.extra_args = tuple(extra_args)
        self.name = name or f"varunad-test-{uuid.uuid4().hex[:8]}"
        self.pki = pki
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "etcd.log"
        self.client_port = 0
        self.peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def endpoint(self) -> str:
        """``<host>:<port>`` (127.0.0.1 unless told), what EtcdStore takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        scheme = "https" if self.pki else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-token", self.name,
        ]
        if self.pki:
            cmd += [
                "--cert-file", str(self.pki.server_cert),
                "--key-file", str(self.pki.server_key),
                "--trusted-ca-file", str(self.pki.ca),
                "--client-cert-auth",
            ]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 15.0) -> None:
        """Start (or restart on the same data and ports) and wait until etcd answers."""
        if self.running:
            return
        first = self.client_port == 0
        for _attempt in range(3 if first else 1):
            if first:
                self.client_port, self.peer_port = free_ports(2)
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    die_with_parent() + self._command(), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            self._paused = False
            if self._wait_ready(timeout):
                return
            exited = self._proc.poll() is not None
            self._terminate()
            if not (first and exited and "address already in use" in self._log_tail()):
                break
            shutil.rmtree(self.data_dir, ignore_errors=True)  # another process took a port: retry
        raise RuntimeError(f"etcd did not become ready within {timeout}s; log tail:\n{self._log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if self._healthy():
                return True
            time.sleep(0.05)
        return False

    def _healthy(self) -> bool:
        context = None
        if self.pki:
            context = ssl.create_default_context(cafile=str(self.pki.ca))
            context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        scheme = "https" if self.pki else "http"
        try:
            with urllib.request.urlopen(f"{scheme}://{self.endpoint}/health", timeout=0.5, context=context) as resp:
                return b'"true"' in resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def enable_auth(self, user: str = "root", password: str = "secret") -> None:
        """Create ``user`` with etcd's root role and turn authentication on (plain HTTP only).

        Through etcd's JSON gateway, so that no test code needs the etcd client library.
        """
        for path, body in (
            ("role/add", {"name": "root"}),
            ("user/add", {"name": user, "password": password}),
            ("user/grant", {"user": user, "role": "root"}),
            ("enable", {}),
        ):
            self._gateway(f"auth/{path}", body)

    def compact(self) -> int:
        """Compact etcd's history up to its current revision, as ``--auto-compaction-*`` does on its
        own in production; returns that revision. Plain HTTP only, through the JSON gateway."""
        revision = int(self._gateway("kv/range", {"key": "AA=="})["header"]["revision"])
        try:
            self._gateway("kv/compaction", {"revision": revision, "physical": True})
        except urllib.error.HTTPError as exc:  # nothing written since the last compaction: done already
            if b"compacted" not in exc.read():
                raise
        return revision

    def _gateway(self, path: str, body: dict) -> dict:
        """One POST to etcd's JSON gateway (``/v3/<path>``), so that no test needs the etcd client."""
        request = urllib.request.Request(
            f"http://{self.endpoint}/v3/{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read() or b"{}")

    def _log_tail(self, size: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open but nothing is answered.

        Returns once the kernel reports the process stopped: the signal is asynchronous, and a
        request sent in between would still be answered.
        """
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True
            self._wait_state(stopped=True)

    def resume(self) -> None:
        if self._proc is not None and self._paused:
            self._proc.send_signal(signal.SIGCONT)
            self._paused = False
            self._wait_state(stopped=False)

    def _wait_state(self, *, stopped: bool, timeout: float = 5.0) -> None:
        # Every thread must have stopped (or resumed), not just the main one.
        task_dir = Path(f"/proc/{self._proc.pid}/task")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in task_dir.iterdir()]
            except (OSError, IndexError):
                return  # exited, or not Linux: nothing better to wait for
            if all((s in "tT") == stopped for s in states):
                return
            time.sleep(0.005)
        raise RuntimeError(f"etcd did not {'stop' if stopped else 'resume'} within {timeout}s")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after ``timeout``); data and ports are kept for start()."""
        self._terminate(timeout)

    def kill(self) -> None:
        """SIGKILL, like a VM that vanished; data and ports are kept for start()."""
        if self._proc is not None:
            self.resume()
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _terminate(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        self.resume()  # a stopped process cannot handle SIGTERM
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop and remove the data directory."""
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
