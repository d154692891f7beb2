"""varunad.store.etcd (the contract of varunad.store.contract) against a real etcd (no mocks), plus
the key layout of varunad.store.keys.

The in-process tests of tests/integration/test_store.py (tests/README.md).
"""

from __future__ import annotations

import pytest

from varunad.store.contract import (
    StoreConfigError,
)
from varunad.store.etcd import EtcdStore, parse_endpoints
from varunad.store.keys import Keys

# ----------------------------------------------------------------------------- pure checks


def test_parse_endpoints():
    assert parse_endpoints("10.0.0.5:2379, https://etcd-b:2380/") == (("10.0.0.5", 2379), ("etcd-b", 2380))
    assert parse_endpoints(["[::1]:2379"]) == (("[::1]", 2379),)
    for bad in ("", "host", "host:port", "host:70000"):
        with pytest.raises(StoreConfigError, match="host:port|no etcd endpoint"):
            parse_endpoints(bad)
    with pytest.raises(StoreConfigError, match="both cert_file and key_file"):
        EtcdStore("h:1", cert_file="c.pem")


def test_key_layout():
    keys = Keys()
    assert keys.member("vm-1") == "/varunad/members/vm-1"
    assert keys.leader == "/varunad/leader" and keys.plan == "/varunad/plan"
    assert keys.calibration_entry("ab12", "NVIDIA H200") == "/varunad/calibration/ab12/NVIDIA H200"
    assert keys.progress_entry("job7", 3) == "/varunad/progress/job7/3"
    assert keys.member_name(keys.member("vm-1")) == "vm-1"
    assert Keys("/t/x/").job("j") == "/t/x/jobs/j"
    assert keys.probe("vm1") == "/varunad/links/probe/vm1" and keys.probe("vm1").startswith(keys.probes)
    assert keys.link_pair("vm2", "vm1") == keys.link_pair("vm1", "vm2") == "/varunad/links/pair/vm1/vm2"
    assert keys.link_pair("vm1", "vm2").startswith(keys.link_pairs) and keys.link_pairs.startswith(keys.links)
    assert keys.history_entry("j", 7, "vm1", 3) == "/varunad/history/j/000000000007/vm1/00000003"
    assert keys.parse_history("j", keys.history_entry("j", 7, "vm1", 3)) == (7, "vm1")
    assert keys.parse_history("j", "/varunad/history/j/000000000007/vm1") == (7, "vm1")   # an earlier release's
    for bad in ("/varunad/history/j/7", "/varunad/history/j/x/vm1", "/varunad/history/j/7/vm1/x",
                "/varunad/history/j/7/vm1/3/4", "/varunad/history/j/7/vm1/", "/varunad/history/k/7/vm1/3"):
        with pytest.raises(ValueError):
            keys.parse_history("j", bad)
    for bad in ("", "a/b", "..", "tab\there"):
        with pytest.raises(ValueError):
            keys.member(bad)
    with pytest.raises(ValueError, match="start and end with '/'"):
        Keys("varunad")
    with pytest.raises(ValueError, match="nested"):
        keys.member_name("/varunad/members/a/b")


async def test_a_call_cut_off_by_a_closed_channel_is_an_outage_not_a_cancellation(monkeypatch):
    """gRPC cancels the calls in flight on a channel that is closed (another task's reconnect):
    the caller gets StoreUnavailable, while its own cancellation and the call's deadline still
    act as they did."""
    import asyncio

    from varunad.store.contract import StoreUnavailable

    store = EtcdStore("127.0.0.1:1")

    async def a_client():
        return object()

    monkeypatch.setattr(store, "_ensure_client", a_client)

    async def cut_off(client):
        raise asyncio.CancelledError()   # what grpc.aio raises in the awaiting coroutine

    with pytest.raises(StoreUnavailable, match="cut off"):
        await store._call("read '/k'", cut_off, timeout=5.0)

    async def slow(client):
        await asyncio.sleep(3600)

    with pytest.raises(StoreUnavailable, match="did not answer"):
        await store._call("read '/k'", slow, timeout=0.2)
    task = asyncio.create_task(store._call("read '/k'", slow, timeout=30.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
