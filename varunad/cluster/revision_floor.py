"""Moving etcd's revision past every epoch the fleet ran, after its history went back.

Plan epochs are etcd revisions ([Note: nothing depends on what a store may drop]): a daemon
applies a plan only if its revision is newer than the epoch it applied last, and the checkpoint
store's fences refuse an epoch older than one that wrote. An etcd restored from an older copy
(a backup restored without `etcdutl snapshot restore --bump-revision`, a disk image rolled
back) counts its revisions from that copy's again, so every plan the leader writes next is older
than what the daemons applied: the fleet ignored them all, and stood still until every daemon
was restarted.

etcd has no call that sets its revision, but every write moves it by one. A daemon that sees a
leader's plan older than the epoch it applied (the one sign that cannot be forged from outside:
the epoch is in its own memory) writes one key over and over until etcd's revision is past that
epoch. The leader's next plan then lands above every epoch the daemon ran, and the leader,
seeing workers report an epoch newer than its plan's, stops them and plans again
(`varunad.control.decide`). The writes cost etcd what the same number of progress reports do; a
backup a day old in a fleet writing ten times a second is about 900,000 of them, minutes of writes.
"""

from __future__ import annotations

import asyncio
import logging
import time

from varunad.store.contract import Store
from varunad.store.keys import Keys

__all__ = ["CONCURRENT_WRITES", "raise_revision_past"]

log = logging.getLogger("varunad")

CONCURRENT_WRITES = 32   # puts in flight at once: a few thousand a second on a local etcd
_REPORT_S = 5.0


async def raise_revision_past(store: Store, keys: Keys, epoch: int, *, who: str, timeout: float) -> int:
    """Write ``keys.revision_floor`` until etcd's revision is above ``epoch``; the revision reached.
    Stops early if another writer (another daemon doing the same, the fleet's own writes) got
    there first."""
    revision = await store.revision(timeout=timeout)
    if revision > epoch:
        return revision
    started = last_said = time.monotonic()
    log.warning("%s: moving etcd's revision from %d past epoch %d (%d writes of %s)", who, revision, epoch,
                epoch - revision + 1, keys.revision_floor)
    while revision <= epoch:
        batch = max(1, min(CONCURRENT_WRITES, epoch - revision + 1))
        written = await asyncio.gather(*(store.put(keys.revision_floor, str(epoch).encode(), timeout=timeout)
                                         for _ in range(batch)))
        revision = max(revision, *written)
        if time.monotonic() - last_said >= _REPORT_S:
            last_said = time.monotonic()
            log.warning("%s: etcd's revision is at %d of %d", who, revision, epoch + 1)
    log.warning("%s: etcd's revision is %d, past epoch %d, after %.1fs", who, revision, epoch,
                time.monotonic() - started)
    return revision
