"""The torch.distributed rendezvous store: a key-value server on rank 0, bound to its address.

torch's TCPStore would do, but for two things a fleet on ordinary VMs trips over: its server
listens on every interface whatever address the daemon advertises, and each client socket is
formatted for a log line with ``getnameinfo`` of its own address, a reverse DNS lookup that
waits out the resolver's timeout (10 s, measured) on a VM whose address is in no /etc/hosts and
whose name server does not answer. This store listens on the worker's bound address only and
never asks a resolver: addresses are numeric, nothing is looked up.

gloo and torch.distributed use it through the Python ``dist.Store`` interface (set, get, add,
check, wait, compare_set, delete_key, num_keys). Wire format, both ways: an op byte, a field
count, then each field as a 4-byte big-endian length and its bytes; replies start with a status
byte (0 ok, 1 timeout, 2 error). The peers are the job's own workers on the fleet's network,
as with TCPStore; nothing here is unpickled or evaluated.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["RendezvousStore", "parse_url"]

_SET, _GET, _ADD, _CHECK, _WAIT, _CSET, _DEL, _NUM = range(1, 9)
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_LEN = struct.Struct(">I")


def parse_url(url: str) -> tuple[str, int]:
    """("10.0.0.5", 29500) from "tcp://10.0.0.5:29500" (IPv6: "tcp://[fe80::1]:29500")."""
    if not url.startswith("tcp://"):
        raise ValueError(f"rendezvous URL {url!r} must look like tcp://ADDRESS:PORT")
    host, _, port = url[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous URL {url!r} must look like tcp://ADDRESS:PORT")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the rendezvous peer closed the connection")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, head: int, fields: list[bytes]) -> None:
    parts = [bytes([head, len(fields)])]
    for f in fields:
        parts += [_LEN.pack(len(f)), f]
    sock.sendall(b"".join(parts))


def _recv(sock: socket.socket) -> tuple[int, list[bytes]]:
    head, count = _recv_exact(sock, 2)
    fields = []
    for _ in range(count):
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        fields.append(_recv_exact(sock, n))
    return head, fields


class _Server:
    """The keys, on rank 0: one thread per connected client (a job has few workers)."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        # the daemon holds the port bound (not listening) with SO_REUSEADDR until the worker takes it
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._accept, name="rendezvous-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="rendezvous-client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    op, fields = _recv(conn)
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    status, out = self._handle(op, fields)
                except Exception as exc:  # a malformed request: answered, the server goes on
                    status, out = _ERROR, [str(exc).encode()]
                try:
                    _send(conn, status, out)
                except OSError:
                    return

    def _wait_for(self, keys: list[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def _handle(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        if op == _SET:
            with self.cond:
                self.data[f[0].decode()] = f[1]
                self.cond.notify_all()
            return _OK, []
        if op == _GET:
            key = f[0].decode()
            if not self._wait_for([key], float(f[1])):
                return _TIMEOUT, [key.encode()]
            with self.cond:
                return _OK, [self.data[key]]
        if op == _ADD:
            with self.cond:
                key = f[0].decode()
                value = int(self.data.get(key, b"0")) + int(f[1])
                self.data[key] = str(value).encode()
                self.cond.notify_all()
            return _OK, [str(value).encode()]
        if op == _CHECK:
            with self.cond:
                return _OK, [b"1" if all(k.decode() in self.data for k in f) else b"0"]
        if op == _WAIT:
            keys = [k.decode() for k in f[1:]]
            return (_OK, []) if self._wait_for(keys, float(f[0])) else (_TIMEOUT, [",".join(keys).encode()])
        if op == _CSET:
            with self.cond:
                key = f[0].decode()
                current = self.data.get(key)
                if (current is None and f[1] == b"") or current == f[1]:
                    self.data[key] = f[2]
                    self.cond.notify_all()
                    return _OK, [f[2]]
                return _OK, [current if current is not None else f[1]]
        if op == _DEL:
            with self.cond:
                return _OK, [b"1" if self.data.pop(f[0].decode(), None) is not None else b"0"]
        if op == _NUM:
            with self.cond:
                return _OK, [str(len(self.data)).encode()]
        return _ERROR, [f"unknown rendezvous op {op}".encode()]

    def close(self) -> None:
        self.sock.close()


class RendezvousStore(dist.Store):
    """A ``dist.Store`` whose server runs in rank 0 (``is_server``), bound to ``host:port``."""

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self.host, self.port, self._timeout_s = host, port, timeout.total_seconds()
        self.set_timeout(timeout)
        self._server = _Server(host, port) if is_server else None
        self._local = threading.local()   # one connection per calling thread: a blocking get holds only its own

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        deadline = time.monotonic() + self._timeout_s
        delay = 0.02
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(5.0, self._timeout_s))
                break
            except OSError as exc:   # rank 0 not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot reach the rendezvous at {self.host}:{self.port} "
                                       f"within {self._timeout_s:.0f}s: {exc}") from exc
                time.sleep(delay)
                delay = min(0.5, delay * 2)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.sock = sock
        return sock

    def _call(self, op: int, fields: list[bytes]) -> list[bytes]:
        sock = self._conn()
        try:
            _send(sock, op, fields)
            status, out = _recv(sock)
        except (OSError, ConnectionError):
            self._local.sock = None
            sock.close()
            raise
        if status == _TIMEOUT:
            raise TimeoutError(f"rendezvous: timed out after {self._timeout_s:.0f}s waiting for "
                               f"{out[0].decode(errors='replace')}")
        if status != _OK:
            raise RuntimeError(f"rendezvous: {out[0].decode(errors='replace') if out else 'error'}")
        return out

    @staticmethod
    def _bytes(value) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key: str, value) -> None:
        self._call(_SET, [key.encode(), self._bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call(_GET, [key.encode(), str(self._timeout_s).encode()])[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, [key.encode(), str(int(amount)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call(_WAIT, [str(seconds).encode(), *(k.encode() for k in keys)])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(_CSET, [key.encode(), self._bytes(expected), self._bytes(desired)])[0]

    def delete_key(self, key: str) -> bool:
        return self._call(_DEL, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(_NUM, [])[0])

    def close(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None
        if self._server is not None:
            self._server.close()
            self._server = None
