"""Members and election contenders against a real etcd, for the membership, election, plan-writer
and schema tests: ``make_member`` (a member's facts), ``Node`` (one simulated daemon: its own
store connection, membership and election loop), ``fleet`` (several, started and stopped
together), ``leaders`` and ``one_leader``."""

from __future__ import annotations

import asyncio
import contextlib
import time

from support.waiting import until_async
from varunad.cluster.election import Election
from varunad.cluster.membership import Member, Membership
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

TTL = 2.0  # a Node's lease


def make_member(name: str, **changes) -> Member:
    facts = dict(name=name, host=f"{name}.internal", endpoint=f"tcp://{name}.internal:7100", slots=2,
                 device_kind="cpu", memory_bytes=8 << 30, version="0.1.0", started_at=1_700_000_000.0)
    facts.update(changes)
    return Member(**facts)


class Node:
    """One simulated daemon: its own store connection, membership and election loop."""

    def __init__(self, endpoint: str, keys: Keys, name: str, *, clock=time.monotonic, timeout=3.0):
        self.store = EtcdStore(endpoint, timeout=timeout)
        self.membership = Membership(self.store, keys, make_member(name), ttl=TTL, clock=clock)
        self.changes = []
        self.election = Election(self.store, keys, self.membership, on_change=self._record)
        self.task: asyncio.Task | None = None

    def _record(self, state):
        self.changes.append((time.monotonic(), state))

    async def start(self):
        await self.store.connect()
        await self.membership.join()
        self.task = asyncio.create_task(self.election.run())

    async def stop(self):
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.membership.leave()
        await self.store.close()


@contextlib.asynccontextmanager
async def fleet(endpoint, keys, names, **kwargs):
    nodes = [Node(endpoint, keys, name, **kwargs) for name in names]
    try:
        for node in nodes:
            await node.start()
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


def leaders(nodes):
    return [n for n in nodes if n.election.is_leader()]


async def one_leader(nodes, timeout):
    """Wait until exactly one node leads and every other node names it; return it."""

    def settled():
        current = leaders(nodes)
        if len(current) != 1:
            return None
        name = current[0].election.name
        return current[0] if all(n.election.state.leader == name for n in nodes) else None

    return await until_async(settled, timeout=timeout, what="exactly one agreed leader")
