"""Writes made on behalf of a plan epoch never overwrite a newer epoch's record.

A daemon cut off from etcd longer than its lease fences itself (``Membership.on_expire``: its
workers are killed), but what it had not yet written is still queued; when the link heals it
would flush an old epoch's progress over the record the survivors' epoch wrote meanwhile
(seen: ``progress/c2/1`` holding epoch 1193's step 36 after the job was done). Records that
are not keyed by epoch (progress) therefore go through ``put_for_epoch``: read the key, refuse
if it holds a newer epoch, else write in a transaction on the revision read, so a newer write
that lands in between wins too (a writer that knows its own last write's revision skips the read
while the key is still as it left it). A record that claims an epoch no plan could have had yet
when it was written is overwritten.
"""

from __future__ import annotations

import logging

from varunad.store import schemas
from varunad.store.contract import Store

__all__ = ["put_for_epoch", "stored_epoch"]

log = logging.getLogger(__name__)

_TRIES = 3


def stored_epoch(value: bytes) -> int | None:
    """The ``epoch`` field of a stored JSON record (None when it has none or is not JSON)."""
    try:
        doc = schemas.load_json(value)
    except ValueError:
        return None
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


async def put_for_epoch(store: Store, key: str, value: bytes, *, epoch: int, timeout: float | None = None,
                        mine: int | None = None) -> int | None:
    """Write `value` for `epoch` unless `key` holds a newer epoch's record: the write's revision,
    None when refused.

    `mine`: the revision of this writer's own last write of `key` (for this epoch or an older
    one). While nobody else has written the key since, that is all the read would tell, so the
    transaction is tried on it first and the read is saved: progress is most of a fleet's writes,
    and the read doubled them."""
    if mine is not None:
        written = await store.compare_and_swap(key, value, mod_revision=mine, timeout=timeout)
        if written is not None:
            return written
    for _ in range(_TRIES):
        current = await store.get(key, timeout=timeout)
        revision = 0 if current is None else current.mod_revision
        if current is not None:
            theirs = stored_epoch(current.value)
            # An epoch is the revision of its plan, so a record written for it has a later revision:
            # one claiming an epoch at or past its own revision was never written for a plan (a hand,
            # garbage) and must not shut this writer out for good.
            if theirs is not None and theirs > epoch and theirs < current.mod_revision:
                log.info("not writing %s for epoch %d: it holds epoch %d's record", key, epoch, theirs)
                return None
        written = await store.compare_and_swap(key, value, mod_revision=revision, timeout=timeout)
        if written is not None:
            return written
    log.info("not writing %s for epoch %d: it kept changing under this write", key, epoch)
    return None
