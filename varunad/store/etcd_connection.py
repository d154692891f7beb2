"""EtcdStore's connection to etcd: the endpoints it is given (``parse_endpoints``), TLS and auth,
the aetcd client of the endpoint in use and the move to the next endpoint after an unavailable
error, ``reconnect`` and ``close``, and ``_call``, which runs one request within its timeout,
authenticates again once when a token expired, and turns any failure into a ``StoreError``.

``EtcdStore`` (``varunad.store.etcd``) is this class plus the contract's requests, each one short
``_call``. With ``etcd`` and ``etcd_client`` the only modules that import the etcd client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from varunad.store.contract import (
    DEFAULT_TIMEOUT,
    Key,
    StoreAuthError,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    bounded,
)
from varunad.store.etcd_client import CHANNEL_OPTIONS, HINT_UNAVAILABLE, Client, translate

__all__ = ["EtcdConnection", "parse_endpoints"]

log = logging.getLogger("varunad.store.etcd")   # the store's log: its lines keep their logger name

T = TypeVar("T")


def _encode(data: Key) -> bytes:
    # surrogateescape lets a key that is not UTF-8 (written by another tool) round-trip.
    return data if isinstance(data, bytes) else data.encode("utf-8", "surrogateescape")


def parse_endpoints(spec: str | Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``"host:port[,host:port]"`` (an ``http://``/``https://`` prefix is allowed) -> ((host, port), ...)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        text = item.strip()
        for scheme in ("http://", "https://"):
            if text.startswith(scheme):
                text = text[len(scheme):]
        text = text.rstrip("/")
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreConfigError(
                f"etcd endpoint {item!r} is not host:port",
                hint="write endpoints like 10.0.0.5:2379,10.0.0.6:2379",
            )
        out.append((host, int(port)))
    if not out:
        raise StoreConfigError("no etcd endpoint given", hint="write endpoints like 10.0.0.5:2379")
    return tuple(out)


class EtcdConnection:
    """The connection half of :class:`EtcdStore`: it takes EtcdStore's constructor arguments (see
    there) and holds the client; EtcdStore's requests go through ``_call``."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        user: str | None = None,
        password: str | None = None,
        probe_key: Key = b"\0",
    ) -> None:
        if timeout <= 0:
            raise StoreConfigError(f"etcd timeout must be positive, got {timeout}")
        if (cert_file is None) != (key_file is None):
            raise StoreConfigError(
                "an etcd client certificate needs both cert_file and key_file",
                hint="give both, or neither",
            )
        if (user is None) != (password is None):
            raise StoreConfigError("etcd auth needs both user and password", hint="give both, or neither")
        self._endpoints = parse_endpoints(endpoints)
        self._timeout = float(timeout)
        self._tls_files = (ca_file, cert_file, key_file)
        self._tls = any(f is not None for f in self._tls_files)
        self._user = user
        self._password = password
        # The key the connection check and revision() read. A user whose role may only touch the
        # fleet's prefix is refused any other key (even a missing one), so pass the key root.
        self._probe = _encode(probe_key)
        self._client: Client | None = None
        self._index = 0
        self._rotate = False
        self._closed = False
        self._lock = asyncio.Lock()
        self._closing: dict[asyncio.Task[None], Client] = {}   # old channels closed after a reconnect

    @property
    def endpoint(self) -> str:
        """The endpoint requests currently go to."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    @property
    def timeout(self) -> float:
        return self._timeout

    def __repr__(self) -> str:
        eps = ",".join(f"{h}:{p}" for h, p in self._endpoints)
        return f"EtcdStore({eps!r}, timeout={self._timeout}, tls={self._tls})"

    # -- connection management

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self._tls:
            return None
        ca, cert, key = (self._read_tls_file(p) for p in self._tls_files)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    @staticmethod
    def _read_tls_file(path: str | Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise StoreConfigError(f"cannot read etcd TLS file {path}: {exc}", hint="fix the path or its permissions") from exc

    def _new_client(self, index: int) -> Client:
        host, port = self._endpoints[index]
        return Client(
            credentials=self._credentials(),
            host=host,
            port=port,
            username=self._user,
            password=self._password,
            timeout=self._timeout,
            options=dict(CHANNEL_OPTIONS),
        )

    async def connect(self) -> None:
        """Connect to the first endpoint that answers; StoreUnavailable if none does in time."""
        self._closed = False
        try:
            await bounded(self._ensure_client(), self._timeout * len(self._endpoints))
        except asyncio.TimeoutError:
            # e.g. authenticating (etcd checks the password with bcrypt) took longer than the
            # bound; a bare TimeoutError would escape the callers' retry loops as an empty error
            raise StoreUnavailable(f"etcd at {self.endpoint} did not answer a first read in time",
                                   hint=HINT_UNAVAILABLE) from None

    async def _ensure_client(self) -> Client:
        if self._closed:
            raise StoreError("the store is closed", hint="open a new store; close() is final")
        if self._client is not None and not self._rotate:
            return self._client
        async with self._lock:
            if self._client is not None and self._rotate:
                old, self._client = self._client, None
                self._index = (self._index + 1) % len(self._endpoints)
                await self._close_client(old)
            self._rotate = False
            if self._client is not None:
                return self._client
            failures = []
            # Each endpoint gets a share of the time, so one frozen etcd cannot use it all.
            per_endpoint = self._timeout / len(self._endpoints)
            for step in range(len(self._endpoints)):
                index = (self._index + step) % len(self._endpoints)
                client = self._new_client(index)
                try:
                    await bounded(client.get(self._probe), per_endpoint)
                except (Exception, asyncio.TimeoutError) as exc:
                    await self._close_client(client)
                    err = translate(exc, "a first read", "%s:%d" % self._endpoints[index])
                    if not isinstance(err, StoreUnavailable):
                        raise err from exc  # wrong credentials will not improve elsewhere
                    failures.append(err.reason)   # the hint once, after all of them
                    continue
                self._index, self._client = index, client
                return client
            raise StoreUnavailable(
                "no etcd endpoint answered: " + "; ".join(failures), hint=HINT_UNAVAILABLE
            )

    @staticmethod
    async def _close_client(client: Client) -> None:
        try:
            await bounded(client.close(), 1.0)
        except (Exception, asyncio.TimeoutError) as exc:  # a dying channel cannot be helped
            log.debug("closing etcd client: %r", exc)

    async def reconnect(self) -> None:
        """Drop the channel: the next call opens a fresh connection. After a call timed out on a
        link that went away and came back, the old TCP connection sits in retransmission
        back-off (seconds to minutes between tries); a new one is answered at once."""
        async with self._lock:
            client, self._client = self._client, None
        if client is not None:
            # calls in flight on the old channel keep it until their own deadlines
            task = asyncio.get_running_loop().create_task(self._close_later(client, self._timeout))
            self._closing[task] = client
            task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def _close_later(self, client: Client, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._close_client(client)

    async def close(self) -> None:
        self._closed = True
        for task, old in list(self._closing.items()):
            task.cancel()
            await self._close_client(old)
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)

    async def _call(
        self, what: str, op: Callable[[Client], Awaitable[T]], timeout: float | None
    ) -> T:
        limit = self._timeout if timeout is None else timeout
        if limit <= 0:
            raise StoreUnavailable(f"no time left to {what}", hint="the caller's deadline has passed")
        retried_auth = False

        async def attempt() -> T:
            nonlocal retried_auth
            while True:
                client = await self._ensure_client()
                try:
                    return await op(client)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise   # the caller's cancellation, or bounded()'s deadline
                    # Nobody cancelled this task: gRPC cancels the calls in flight on a channel that
                    # is closed (another task's reconnect). Letting that CancelledError out would end
                    # the caller as if it had been cancelled (it silently stopped a daemon once).
                    raise StoreUnavailable(f"etcd call to {what} was cut off: its connection was closed",
                                           hint=HINT_UNAVAILABLE) from None
                except (Exception, asyncio.TimeoutError) as exc:
                    err = translate(exc, what, self.endpoint)
                    # Simple auth tokens expire (5 min by default): re-authenticate once. The
                    # request was refused, not applied, so repeating it is safe.
                    if isinstance(err, StoreAuthError) and self._user and not retried_auth:
                        log.info("etcd refused %s (%s); authenticating again", what, exc)
                        retried_auth = True
                        self._client = None
                        await self._close_client(client)
                        continue
                    raise err from exc

        try:
            return await bounded(attempt(), limit)
        except asyncio.TimeoutError as exc:
            self._rotate = len(self._endpoints) > 1
            raise StoreUnavailable(
                f"etcd at {self.endpoint} did not answer {what} within {limit:.1f}s",
                hint=HINT_UNAVAILABLE,
            ) from exc
        except StoreUnavailable:
            self._rotate = len(self._endpoints) > 1
            raise
