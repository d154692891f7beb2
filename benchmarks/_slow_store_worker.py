"""The training script of benchmarks/slow_store.py: the tiny GPT under Varuna, its checkpoint store
behind a backend that writes at `--rate` bytes per second (each write sleeps for its share: a
rate-limited mount, without root), and the wall time of every `step()` (its checkpoint included)
written to `--out`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch

from trainer import GlobalBatches, Varuna
from trainer.checkpoint.storage import LocalStorage, register_storage
from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig

SCHEME = "slow"


class _Throttled:
    def __init__(self, f: BinaryIO, rate: float) -> None:
        self._f, self._rate = f, rate

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._f.write(data)
        time.sleep(n / self._rate)
        return n

    def flush(self) -> None:
        self._f.flush()


class SlowStorage:
    """`slow:///path` is the local `/path`, written at `rate` bytes per second."""

    def __init__(self, rate: float) -> None:
        self.rate, self._local = rate, LocalStorage()

    @staticmethod
    def _path(path: str) -> str:
        return path.removeprefix(f"{SCHEME}://")

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[BinaryIO]:
        with self._local.open_atomic(self._path(path)) as f:
            yield _Throttled(f, self.rate)  # type: ignore[misc]

    def __getattr__(self, name: str):
        op = getattr(self._local, name)   # makedirs, sync_dir, open_read, size, listdir, isdir, ...
        return lambda path, *a: op(self._path(path), *a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rate", type=float, default=1e6, help="bytes per second the store takes")
    args = p.parse_args()
    register_storage(SCHEME, SlowStorage(args.rate))
    torch.manual_seed(1234)
    cfg = GPTConfig.preset("tiny")
    data = TextDataset(cfg.seq_len, num_examples=256, seed=0)
    varuna = Varuna(GPT(cfg, seed=0), None, data.sample_batch, 12, 4)
    varuna.set_optimizer(torch.optim.SGD(varuna.parameters(), lr=0.1, momentum=0.9))
    batches = GlobalBatches(len(data), 12, seed=0)
    times = []
    while varuna.iteration < args.steps:
        batch = data.batch(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth))
        start = time.perf_counter()
        varuna.step(batch)
        times.append(time.perf_counter() - start)
    varuna.close()   # the last staged checkpoint reaches the store
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"times_rank{varuna.rank}.json"), "w") as f:
        json.dump(times, f)


if __name__ == "__main__":
    main()
