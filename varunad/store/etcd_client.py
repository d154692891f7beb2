"""aetcd underneath ``EtcdStore``: gRPC's environment, the channel options, the client that can
also open TLS, and the translation of any client, gRPC or timeout failure into one ``StoreError``
that says what to check. With ``varunad.store.etcd`` the only modules that import aetcd.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

# Before grpc (under aetcd) is imported: its fork handlers crash children forked while another
# thread is inside gRPC (about 1 in 8 in a stress test), and the daemon forks every worker. The
# children exec at once and never use gRPC, so they need no such handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.client
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from varunad.store.contract import HistoryCompacted, StoreAuthError, StoreError, StoreUnavailable

__all__ = ["Client", "CHANNEL_OPTIONS", "HINT_UNAVAILABLE", "rpc_code", "translate"]

HINT_UNAVAILABLE = (
    "check that etcd runs and answers at the endpoints given (etcdctl --endpoints=... endpoint "
    "health), that this host can reach them, and that the TLS settings match the server"
)
HINT_AUTH = (
    "check the etcd user and password (or client certificate) and that the user's role may "
    "read and write the varunad key root"
)



# gRPC's reconnect backoff grows to two minutes by default; after an etcd restart a node must
# see etcd again well within one lease TTL. Calibration prefixes can exceed the 4 MiB default.
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    # A connection whose packets vanish (a partition, no reset) is found dead by a ping, not by
    # TCP's retransmission back-off (minutes). 10 s: etcd's --grpc-keepalive-min-time is 5 s and
    # a client pinging more often is sent away. Faster detection is EtcdStore.reconnect's job.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.max_receive_message_length": 256 * 2**20,
}


class Client(aetcd.Client):
    """aetcd.Client that can also open a TLS channel (aetcd 1.0 only opens insecure ones).

    The TLS branch repeats aetcd's ``connect`` with ``secure_channel``; keep it in step when
    aetcd is upgraded (the store tests run a TLS etcd to catch a mismatch).
    """

    def __init__(self, *, credentials: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @aetcd.client._handle_errors
    @aetcd.client._ensure_connected
    async def get_at(self, key: bytes, revision: int) -> Any:
        """aetcd's ``get`` at an older revision (aetcd 1.0 has no such argument)."""
        request = aetcd.rpc.RangeRequest(key=key, revision=revision)
        response = await self.kvstub.Range(request, timeout=self._timeout, metadata=self.metadata)
        return response.kvs[0] if response.count >= 1 else None

    async def connect(self) -> None:
        if self._credentials is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = aetcd.rpc.secure_channel(
                target, self._credentials, options=list(self._options.items())
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def rpc_code(exc: BaseException) -> Any:
    cause = exc if isinstance(exc, aetcd.rpc.AioRpcError) else exc.__cause__
    return cause.code() if isinstance(cause, aetcd.rpc.AioRpcError) else None


_AUTH_MESSAGES = (
    "user name is empty",
    "authentication failed",
    "permission denied",
    "invalid auth token",
)


def translate(exc: BaseException, what: str, endpoint: str | None) -> StoreError:
    """One StoreError for any client, gRPC or timeout failure, saying what to check."""
    where = f"etcd at {endpoint}" if endpoint else "etcd"
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, aetcd.RevisionCompactedError):
        return HistoryCompacted(
            f"{what}: {where} has compacted history below revision {exc.compacted_revision}",
            compact_revision=exc.compacted_revision,
        )
    code = rpc_code(exc)
    # A read at a compacted revision: OUT_OF_RANGE ("required revision has been compacted"); etcd
    # uses the same code for a future revision, so the message decides.
    if code == aetcd.rpc.StatusCode.OUT_OF_RANGE and "compacted" in str(exc):
        return HistoryCompacted(f"{what}: {where} has compacted that revision away")
    if isinstance(exc, asyncio.TimeoutError):
        return StoreUnavailable(f"{where} did not answer {what} in time", hint=HINT_UNAVAILABLE)
    if isinstance(exc, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError)) or code in (
        aetcd.rpc.StatusCode.UNAVAILABLE,
        aetcd.rpc.StatusCode.DEADLINE_EXCEEDED,
        aetcd.rpc.StatusCode.CANCELLED,
    ):
        return StoreUnavailable(f"{where} is unreachable for {what}: {exc}", hint=HINT_UNAVAILABLE)
    # etcd reports some auth failures as INVALID_ARGUMENT, so the message decides too.
    if (
        isinstance(exc, aetcd.exceptions.UnauthenticatedError)
        or code in (aetcd.rpc.StatusCode.UNAUTHENTICATED, aetcd.rpc.StatusCode.PERMISSION_DENIED)
        or any(m in str(exc) for m in _AUTH_MESSAGES)
    ):
        return StoreAuthError(f"{where} refused {what}: {exc}", hint=HINT_AUTH)
    return StoreError(f"{where} failed {what}: {exc}", hint="see the etcd server log for details")
