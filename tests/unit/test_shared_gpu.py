"""Ranks that find they share a GPU reduce over gloo: every rank posts its GPU's UUID to the job's
rendezvous store (a real one, on loopback) and all decide alike. The GPU is faked: this machine
has none (benchmarks/cuda_matrix.py runs the real thing on a GPU host)."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from trainer.engine.groups import ProcessGroups
from trainer.launch import free_ports
from trainer.net.rendezvous import RendezvousStore


def _decide(monkeypatch, uuids: list[str]) -> list[bool]:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid=uuids[d.index]))
    port = free_ports(1)[0]
    out: list[bool | None] = [None] * len(uuids)

    def rank(r: int, store: RendezvousStore) -> None:
        worker = SimpleNamespace(assignment=SimpleNamespace(rank=r, world_size=len(uuids)),
                                 device=torch.device("cuda", r))
        out[r] = ProcessGroups._gpu_shared(worker, store, timedelta(seconds=10))

    stores = [RendezvousStore("127.0.0.1", port, is_server=r == 0, timeout=timedelta(seconds=10))
              for r in range(len(uuids))]
    try:
        threads = [threading.Thread(target=rank, args=(r, s)) for r, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        for s in reversed(stores):
            s.close()
    return out


@pytest.mark.parametrize("uuids, shared", [
    (["GPU-a", "GPU-b", "GPU-c"], False),   # a GPU per rank: NCCL
    (["GPU-a", "GPU-b", "GPU-a"], True),    # two ranks on one: gloo, for every rank
    (["GPU-a", "GPU-a"], True),
])
def test_every_rank_decides_alike_whether_a_gpu_is_shared(monkeypatch, uuids, shared):
    assert _decide(monkeypatch, uuids) == [shared] * len(uuids)
