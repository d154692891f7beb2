"""varunad.store.etcd (the contract of varunad.store.contract) against a real etcd (no mocks), plus
the key layout of varunad.store.keys."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.etcd_server import EtcdServer, make_pki
from support.waiting import until_async

from varunad.store.contract import (
    DELETE,
    PUT,
    HistoryCompacted,
    KeyValue,
    LeaseExpired,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
)
from varunad.store.etcd import EtcdStore

# ----------------------------------------------------------------------------- reads and writes


async def test_put_get_with_str_and_bytes_keys(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        assert await store.get(etcd_root + "missing") is None
        r1 = await store.put(etcd_root + "a", "alpha")
        r2 = await store.put((etcd_root + "b").encode(), b"\x00beta")
        assert r2 > r1
        a = await store.get((etcd_root + "a").encode())
        assert a == KeyValue(key=etcd_root + "a", value=b"alpha", create_revision=r1,
                             mod_revision=r1, version=1, lease=0)
        b = await store.get(etcd_root + "b")
        assert (b.key, b.value, b.mod_revision) == (etcd_root + "b", b"\x00beta", r2)
        assert await store.revision() >= r2
        assert await store.delete(etcd_root + "a") is True
        assert await store.delete(etcd_root + "a") is False
        assert await store.get(etcd_root + "a") is None


async def test_get_prefix_is_ordered_and_atomic(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        for name in ("c", "a", "b/nested"):
            await store.put(etcd_root + "dir/" + name, name)
        await store.put(etcd_root + "dirx", "sibling, not under dir/")
        listing = await store.get_prefix(etcd_root + "dir/")
        assert [kv.key for kv in listing] == [etcd_root + "dir/" + n for n in ("a", "b/nested", "c")]
        assert listing.revision == await store.revision()
        assert listing.get(etcd_root + "dir/c").value == b"c"
        assert await store.delete_prefix(etcd_root + "dir/") == 3
        assert len(await store.get_prefix(etcd_root + "dir/")) == 0
        assert (await store.get(etcd_root + "dirx")) is not None


# ----------------------------------------------------------------------------- leases


async def test_key_with_lease_disappears_when_lease_expires(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        lease = await store.grant(2)
        assert lease.ttl == 2
        await store.put(etcd_root + "ephemeral", "x", lease=lease)
        assert (await store.get(etcd_root + "ephemeral")).lease == lease.id
        started = time.monotonic()

        async def gone():
            return await store.get(etcd_root + "ephemeral") is None

        await until_async(gone, timeout=2 + 3, interval=0.1, what="expiry of a 2 s lease")
        assert time.monotonic() - started >= 1.0  # not deleted early
        assert await lease.time_to_live() is None
        with pytest.raises(LeaseExpired, match="expired or was revoked"):
            await lease.refresh()


async def test_lease_refresh_revoke_and_ttl_query(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        lease = await store.grant(5)
        await store.put(etcd_root + "k", "v", lease=lease)
        assert await lease.refresh() == 5
        assert 0 < await lease.time_to_live() <= 5
        await lease.revoke()
        assert await store.get(etcd_root + "k") is None
        await lease.revoke()  # revoking again is harmless
        with pytest.raises(LeaseExpired):
            await store.refresh(lease.id)


# ----------------------------------------------------------------------------- transactions


async def test_create_if_absent_succeeds_once(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        key = etcd_root + "once"
        assert await store.create_if_absent(key, "first") is True
        assert await store.create_if_absent(key, "second") is False
        assert (await store.get(key)).value == b"first"
        racers = await asyncio.gather(*(store.create_if_absent(etcd_root + "race", str(i)) for i in range(8)))
        assert racers.count(True) == 1


async def test_put_if_holds_only_while_the_guard_holds(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        guard, plan = etcd_root + "leader", etcd_root + "plan"
        await store.put(guard, "node-a")
        term = (await store.get(guard)).create_revision
        rev = await store.put_if(plan, "plan-1", guard_key=guard, guard_value="node-a",
                                 guard_create_revision=term)
        assert rev is not None and (await store.get(plan)).mod_revision == rev
        await store.put(guard, "node-b")
        assert await store.put_if(plan, "plan-2", guard_key=guard, guard_value="node-a") is None
        assert (await store.get(plan)).value == b"plan-1"
        # Same name, new term (the key was deleted and created again): the old term is refused.
        await store.delete(guard)
        await store.put(guard, "node-a")
        assert await store.put_if(plan, "plan-3", guard_key=guard, guard_value="node-a",
                                  guard_create_revision=term) is None
        assert await store.put_if(plan, "plan-3", guard_key=guard, guard_value="node-a") is not None


async def test_compare_and_swap_and_delete_if(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        key = etcd_root + "cas"
        r1 = await store.compare_and_swap(key, "v1", mod_revision=0)  # 0: only if absent
        assert r1 is not None
        assert await store.compare_and_swap(key, "v2", mod_revision=0) is None
        r2 = await store.compare_and_swap(key, "v2", mod_revision=r1)
        assert r2 is not None and r2 > r1
        assert await store.compare_and_swap(key, "v3", mod_revision=r1) is None
        assert await store.delete_if(key, value="v1") is False
        assert await store.delete_if(key, value="v2") is True
        assert await store.get(key) is None


# ----------------------------------------------------------------------------- watches


async def test_watch_sees_put_and_delete(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        async with store.watch_prefix(etcd_root + "w/") as watch:
            r_put = await store.put(etcd_root + "w/x", "1")
            await store.put(etcd_root + "elsewhere", "not watched")
            r_del = await store.delete(etcd_root + "w/x") and await store.revision()
            first = await watch.next(timeout=5)
            second = await watch.next(timeout=5)
        assert (first.kind, first.key, first.value, first.revision) == (PUT, etcd_root + "w/x", b"1", r_put)
        assert (second.kind, second.key, second.value, second.revision) == (DELETE, etcd_root + "w/x", b"", r_del)
        assert watch.cancelled and watch.last_revision == r_del
        assert await watch.next(timeout=1) is None


async def test_watch_replays_from_revision_and_cancels_from_another_task(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        key = etcd_root + "leader"
        r1 = await store.put(key, "a")
        await store.put(key, "b")
        seen = []
        watch = store.watch(key, start_revision=r1)

        async def consume():
            async for event in watch:
                seen.append(event.value)

        consumer = asyncio.create_task(consume())
        await until_async(lambda: len(seen) == 2, timeout=5, what="replay of two puts")
        assert await watch.next(timeout=0.1) is None  # a timeout is not an error
        await watch.cancel()
        await asyncio.wait_for(consumer, 5)  # iteration ended cleanly
        assert seen == [b"a", b"b"]


async def test_watch_from_compacted_revision_raises(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        key = etcd_root + "compact"
        r1 = await store.put(key, "1")
        await store.put(key, "2")
        # Compaction is an etcd admin action; reach the raw client only in this test.
        client = await store._ensure_client()
        await client.compact(await store.revision())
        with pytest.raises(HistoryCompacted) as info:
            async with store.watch(key, start_revision=r1) as watch:
                await watch.next(timeout=5)
        assert info.value.compact_revision > r1 and "read the key or prefix again" in str(info.value)


# ----------------------------------------------------------------------------- faults


async def test_unavailable_within_bound_when_etcd_is_stopped_then_reconnects(etcd_fault, etcd_root):
    async with EtcdStore(etcd_fault.endpoint, timeout=1.5) as store:
        await store.put(etcd_root + "survives", "yes")
        etcd_fault.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            await store.get(etcd_root + "survives")
        assert time.monotonic() - started < 1.5 + 0.5
        assert "etcdctl" in str(info.value)  # says what to check
        etcd_fault.start()  # same data dir and port
        value = await until_async(lambda: _get_or_none(store, etcd_root + "survives"), timeout=10,
                                 interval=0.1, what="reconnect after etcd restart")
        assert value.value == b"yes"


async def _get_or_none(store, key):
    try:
        return await store.get(key)
    except StoreUnavailable:
        return None


async def test_unavailable_within_bound_when_etcd_is_frozen(etcd_fault, etcd_root):
    async with EtcdStore(etcd_fault.endpoint, timeout=1.0) as store:
        await store.put(etcd_root + "k", "v")
        with etcd_fault.paused():
            for call in (lambda: store.get(etcd_root + "k"), lambda: store.put(etcd_root + "k", "w"),
                         lambda: store.grant(5), lambda: store.create_if_absent(etcd_root + "c", "x")):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable, match="did not answer"):
                    await call()
                assert time.monotonic() - started < 1.0 + 0.5
            with pytest.raises(StoreUnavailable):
                await store.get(etcd_root + "k", timeout=0.2)
        assert (await store.get(etcd_root + "k")).value in (b"v", b"w")


async def test_watch_raises_when_etcd_stops(etcd_fault, etcd_root):
    async with EtcdStore(etcd_fault.endpoint, timeout=1.5) as store:
        async with store.watch_prefix(etcd_root) as watch:
            await store.put(etcd_root + "a", "1")
            assert (await watch.next(timeout=5)).kind == PUT
            etcd_fault.kill()
            with pytest.raises(StoreUnavailable):
                await watch.next(timeout=10)
            with pytest.raises(StoreUnavailable):  # stays broken; resume from last_revision + 1
                await watch.next(timeout=1)


async def test_connect_fails_fast_without_etcd_and_fails_over_to_next_endpoint(etcd, etcd_root):
    dead = "127.0.0.1:1"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no etcd endpoint answered") as refused:
        async with EtcdStore(dead, timeout=1.0):
            pass
    assert str(refused.value).count("check that etcd runs") == 1   # the hint once, not once per endpoint
    assert time.monotonic() - started < 2.0
    async with EtcdStore(f"{dead},http://{etcd.endpoint}", timeout=1.0) as store:
        assert store.endpoint == etcd.endpoint
        await store.put(etcd_root + "k", "v")


async def test_closed_store_refuses_calls(etcd, etcd_root):
    store = EtcdStore(etcd.endpoint)
    await store.connect()
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.get(etcd_root + "k")


async def test_tls_with_client_certificate(tmp_path, etcd_root):
    pki = make_pki(tmp_path / "pki")
    with EtcdServer(pki=pki) as server:
        async with EtcdStore(server.endpoint, ca_file=pki.ca, cert_file=pki.client_cert,
                             key_file=pki.client_key) as store:
            rev = await store.put(etcd_root + "tls", "ok")
            assert (await store.get(etcd_root + "tls")).mod_revision == rev
            async with store.watch(etcd_root + "tls") as watch:
                await store.delete(etcd_root + "tls")
                assert (await watch.next(timeout=5)).kind == DELETE
        with pytest.raises(StoreUnavailable):  # plaintext to a TLS server
            async with EtcdStore(server.endpoint, timeout=1.0):
                pass


async def test_user_password_auth_and_expired_tokens(etcd_root, caplog):
    # Simple auth tokens expire after 1 s idle here (300 s by default): the store re-authenticates.
    with EtcdServer(extra_args=("--auth-token-ttl", "1")) as server:
        server.enable_auth("root", "secret")
        for credentials in ({}, {"user": "root", "password": "wrong"}):
            with pytest.raises(StoreAuthError, match="check the etcd user and password"):
                async with EtcdStore(server.endpoint, timeout=1.0, **credentials):
                    pass
        async with EtcdStore(server.endpoint, timeout=1.0, user="root", password="secret") as store:
            await store.put(etcd_root + "k", "1")
            await asyncio.sleep(2.5)  # idle: the token expires (time must pass; nothing to wait on)
            with caplog.at_level("INFO", logger="varunad.store.etcd"):
                assert await store.put(etcd_root + "k", "2")
            assert "invalid auth token" in caplog.text and "authenticating again" in caplog.text
            assert (await store.get(etcd_root + "k")).value == b"2"


async def test_create_if_absent_writes_its_companions_only_when_it_creates(etcd, etcd_root):
    async with EtcdStore(etcd.endpoint) as store:
        key, side, gone = etcd_root + "job", etcd_root + "bundle", etcd_root + "signature"
        await store.put(gone, "stale")
        assert await store.create_if_absent(key, "a", also=[(side, "bundle-a"), (gone, None)]) is True
        assert (await store.get(side)).value == b"bundle-a" and await store.get(gone) is None
        await store.put(gone, "a's")
        assert await store.create_if_absent(key, "b", also=[(side, "bundle-b"), (gone, None)]) is False
        assert (await store.get(side)).value == b"bundle-a" and (await store.get(gone)).value == b"a's"
