"""Copy this daemon's worker logs into etcd, and pick what status must show out of them.

Each worker writes ``STATE_DIR/logs/<job>/e<epoch>-r<rank>.log`` (varunad.node.supervisor). The
shipper reads what was appended since its last call, whole lines only (a worker that has ended
also its last line without a newline), prefixes every line with
``[member e<epoch> r<rank>]`` and writes it in chunks of at most ``_CHUNK`` bytes under the job's
log keys, where ``varunactl logs`` reads them. The newest ``_KEPT_BYTES`` per job and daemon are
kept; once older chunks go, a marker first in the listing (sequence 0) says how much and where the
whole logs are. A line saying a checkpoint was skipped (trainer.checkpoint.store), or that a
resumed run's learning-rate schedule started over (trainer.engine.varuna), is also logged here and
kept as a note, which status shows.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from varunad.store.contract import Store
from varunad.store.keys import Keys

__all__ = ["LogShipper", "ShippedLog"]

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
# per job and daemon: at one chunk a tick, a count of chunks kept a busy job's last 30 s only
_KEPT_BYTES = 4 << 20
_CHUNKS_PER_CALL = 16   # per worker: a burst of output reaches etcd within a few ticks
# what a worker logs that status must show, each note from its marker on: a checkpoint that does not
# verify (trainer.checkpoint.store), and a learning-rate schedule a resume started over
# (trainer.engine.varuna's check of a scheduler not given to set_optimizer)
_NOTED = (b"skipping checkpoint", b"learning-rate schedule started over")


class ShippedLog(Protocol):
    """What the shipper needs of a worker (varunad.node.supervisor's record of one)."""

    job: str
    epoch: int
    rank: int
    log_path: Path
    log_offset: int  # bytes of the log already shipped (or written before this worker started)
    alive: bool      # still running: a line without its newline yet is not shipped
    log_end: int | None   # where its lines end (an earlier epoch's, whose log file a later one may append to)


class LogShipper:
    """One daemon's worker logs, shipped to etcd in chunks. Store errors propagate to the caller;
    a worker's offset only moves once its chunk is written, so a failed write is retried next time."""

    def __init__(self, *, name: str, store: Store, keys: Keys) -> None:
        self.name = name
        self.store = store
        self.keys = keys
        self._seq = time.time_ns() // 1000
        self._chunks: dict[str, deque[tuple[str, int]]] = {}  # job -> (chunk key, bytes) written here, oldest first
        self._kept: dict[str, int] = {}   # job -> bytes of its chunks in etcd (a small chunk a tick: many)
        self._dropped: dict[str, int] = {}   # job -> bytes of its oldest chunks deleted
        self._notes: dict[str, list[str]] = {}  # job -> what its workers logged here that status shows (_NOTED)

    async def ship(self, workers: Iterable[ShippedLog], timeout: float) -> None:
        for w in list(workers):
            for _ in range(_CHUNKS_PER_CALL):
                if not await self._ship_chunk(w, timeout):
                    break

    async def _ship_chunk(self, w: ShippedLog, timeout: float) -> bool:
        """Ship the next chunk of `w`'s log; False when there is none yet."""
        try:
            size = _CHUNK if w.log_end is None else min(_CHUNK, w.log_end - w.log_offset)
            if size <= 0:
                return False
            with open(w.log_path, "rb") as f:
                f.seek(w.log_offset)
                data = f.read(size)
        except OSError:
            return False
        if not data:
            return False
        if not data.endswith(b"\n"):
            # whole lines only: a line the worker is still writing would be shipped in two
            # chunks, each prefixed ("... mb8[vm1 e34 r0] "). Its rest is shipped with it next
            # time; a worker that has ended writes no more, and a line longer than a chunk
            # goes as it is
            if b"\n" in data:
                data = data[: data.rindex(b"\n") + 1]
            elif len(data) < _CHUNK and w.alive:
                return False
        await self._note_lines(w, data, timeout)
        prefix = f"[{self.name} e{w.epoch} r{w.rank}] ".encode()
        text = b"".join(prefix + line for line in data.splitlines(keepends=True))
        self._seq = max(self._seq + 1, time.time_ns() // 1000)
        key = self.keys.log_chunk(w.job, self.name, self._seq)
        await self.store.put(key, text, timeout=timeout)
        w.log_offset += len(data)
        chunks = self._chunks.setdefault(w.job, deque())
        chunks.append((key, len(text)))
        self._kept[w.job] = self._kept.get(w.job, 0) + len(text)
        dropped = 0
        while self._kept[w.job] > _KEPT_BYTES:
            old, n = chunks[0]
            await self.store.delete(old, timeout=timeout)
            chunks.popleft()
            self._kept[w.job] -= n
            dropped += n
        if dropped:
            self._dropped[w.job] = self._dropped.get(w.job, 0) + dropped
            await self.store.put(self.keys.log_chunk(w.job, self.name, 0), (
                f"[{self.name}] ({self._dropped[w.job]} bytes of earlier output dropped here: etcd keeps the last "
                f"{_KEPT_BYTES >> 20} MiB of each daemon's; the whole logs are in {w.log_path.parent} on "
                f"{self.name})\n").encode(), timeout=timeout)
        return True

    async def _note_lines(self, w: ShippedLog, data: bytes, timeout: float) -> None:
        """A worker that skipped a corrupt checkpoint (trainer.checkpoint.store: "skipping checkpoint N:
        ...") resumed from an older one and redoes steps; one whose learning-rate schedule started over
        trains another model: say so in this daemon's log and in etcd (``notes/<job>/<member>``, shown by
        status), not only in the worker's own output."""
        found = [(line, marker) for line in data.splitlines() for marker in _NOTED if marker in line]
        if not found:
            return
        notes = self._notes.setdefault(w.job, [])
        for line, marker in found:
            text = line[line.index(marker):].decode("utf-8", "replace").strip()[:500]
            log.warning("%s: rank %d of %s epoch %d: %s", self.name, w.rank, w.job, w.epoch, text)
            notes.append(f"epoch {w.epoch} rank {w.rank} on {self.name}: {text}")
        del notes[:-10]
        await self.store.put(self.keys.note_entry(w.job, self.name), json.dumps(notes).encode(), timeout=timeout)
