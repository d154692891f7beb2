"""The loss history a daemon keeps is written HISTORY_CHUNK steps to a key (varunad.node.reporter):
a progress write rewrites the chunk its new steps are in, not the epoch's whole history, and
`varunactl status` reads the chunks back as one history (varunad.control.status)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from varunad.control.records import Progress, decode_history
from varunad.node.config import load_config
from varunad.node.reporter import HISTORY_CHUNK, Reporter
from varunad.store.keys import Keys

KEYS = Keys("/varunad/")


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts: list[tuple[str, int]] = []   # (key, bytes) of every write

    async def put(self, key, value, *, lease=None, timeout=None):
        self.data[key] = value
        self.puts.append((key, len(value)))
        return len(self.puts)


def _reporter(store: _Store, lease=None) -> Reporter:
    config = load_config(["--etcd", "127.0.0.1:2379", "--store", "/tmp/store", "--plaintext", "--name", "vm1"],
                         environ={})
    # without a lease the report itself is not written: only the history is under test
    membership = SimpleNamespace(lease=lease)
    return Reporter(config=config, store=store, keys=KEYS, membership=membership,
                    report=lambda: SimpleNamespace(encode=lambda: b"{}"), workers=lambda: ())


def _step(r: Reporter, step: int) -> None:
    r.record_progress(Progress(job="j", epoch=3, rank=0, step=step, loss=10.0 / (1 + step), samples_per_s=1.0,
                               busy_fraction=1.0, at=1000.0 + step), keeps_history=True)


def test_a_progress_write_rewrites_only_the_chunk_of_its_steps():
    async def main():
        store = _Store()
        r = _reporter(store)
        last = 3 * HISTORY_CHUNK + 10
        for s in range(last):
            _step(r, s)
        await r.flush(periodic=False)
        keys = sorted(k for k, _ in store.puts)
        assert keys == [KEYS.history_entry("j", 3, "vm1", c) for c in range(4)]
        store.puts.clear()
        _step(r, last)
        await r.flush(periodic=False)
        (key, size), = store.puts
        assert key == KEYS.history_entry("j", 3, "vm1", 3)
        assert size < 1000, "a write of 11 steps"
        # every chunk together is the whole history, each with the epoch's span
        steps = {}
        for k, v in store.data.items():
            assert KEYS.parse_history("j", k) == (3, "vm1")
            pairs, span = decode_history(v)
            assert all(s // HISTORY_CHUNK == int(k.rsplit("/", 1)[1]) for s, _ in pairs)
            steps.update(pairs)
            assert span[0] == 1000.0
        assert steps == {s: 10.0 / (1 + s) for s in range(last + 1)} == r.history("j", 3)

    asyncio.run(main())


def test_the_history_is_written_before_the_report_that_may_end_the_job():
    async def main():
        store = _Store()
        r = _reporter(store, lease=SimpleNamespace(id=7))
        _step(r, 0)
        r.mark()
        await r.flush(periodic=False)
        assert [k for k, _ in store.puts] == [KEYS.history_entry("j", 3, "vm1", 0), KEYS.workers_of("vm1")]

    asyncio.run(main())


def test_a_diverged_steps_nan_loss_is_kept_in_the_history_and_shown_as_null_in_json():
    import json
    import math

    from varunad.ctl.commands import dumps

    async def main():
        store = _Store()
        r = _reporter(store)
        _step(r, 0)
        r.record_progress(Progress(job="j", epoch=3, rank=0, step=1, loss=math.nan, samples_per_s=1.0,
                                   busy_fraction=1.0, at=1001.0), keeps_history=True)
        await r.flush(periodic=False)
        (value,) = store.data.values()
        pairs, _ = decode_history(value)
        assert pairs[0] == (0, 10.0) and pairs[1][0] == 1 and math.isnan(pairs[1][1])
        # `varunactl status` prints JSON that jq and JSON.parse take: null where Python wrote NaN
        shown = dumps({"loss": pairs[1][1], "loss_history": [list(p) for p in pairs], "rate": math.inf})
        assert json.loads(shown, parse_constant=lambda c: pytest.fail(f"{c} in the JSON")) == {
            "loss": None, "loss_history": [[0, 10.0], [1, None]], "rate": None}

    asyncio.run(main())
