"""GradReducer alone: two replicas in forked processes over a real gloo group on loopback.

Each replica holds an embedding and a head that are one tensor in the math (two Parameters,
Varuna's `shared_weights` way) plus an untied layer, on one stage: the P = 1, D = 2 case in
which the overlapped bucket all-reduce once wrote the un-summed gradients over the tied sum.
"""

import multiprocessing as mp
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.engine.data_parallel import GradReducer
from trainer.launch import free_ports

VOCAB, WIDTH = 7, 5


def _batch(replica: int, micro: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3,), generator=torch.Generator().manual_seed(100 * replica + micro))


def _loss(emb: torch.Tensor, head: torch.Tensor, mid: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(torch.tanh(mid(F.embedding(ids, emb))), head), ids)


def _in_group(body):
    """A replica's process: `body(rank)` inside a two-process gloo group, its outcome sent back."""
    def run(rank: int, port: int, conn) -> None:
        try:
            # the parent may have run torch's thread pool; a forked child must not use it
            torch.set_num_threads(1)
            torch.manual_seed(0)
            store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
            body(rank)
            dist.destroy_process_group()
            conn.send("ok")
        except BaseException:
            conn.send(traceback.format_exc())
        finally:
            conn.close()
    return run


def _tied(rank: int) -> None:
    emb = nn.Parameter(torch.randn(VOCAB, WIDTH))
    head = nn.Parameter(emb.detach().clone())
    mid = nn.Linear(WIDTH, WIDTH)
    # every tensor in a bucket of its own, so buckets start one by one during the backward;
    # the tied copies are passed among the stage's parameters too, as Varuna does
    reducer = GradReducer([emb, head, *mid.parameters()], dist.group.WORLD, 2, bucket_bytes=1,
                          tied=[([emb, head], dist.group.WORLD)])
    for micro in range(2):
        if micro == 1:
            reducer.arm()   # before the last backward, as the executor does
        _loss(emb, head, mid, _batch(rank, micro)).backward()
    reducer.reduce()

    # the same math in one process, with one tensor for the embedding and the head
    w = emb.detach().clone().requires_grad_()
    ref_mid = nn.Linear(WIDTH, WIDTH)
    ref_mid.load_state_dict(mid.state_dict())
    for replica in range(2):
        for micro in range(2):
            _loss(w, w, ref_mid, _batch(replica, micro)).backward()
    torch.testing.assert_close(emb.grad, w.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(head.grad, emb.grad), "tied copies must get the same bits"
    assert head.grad.data_ptr() != emb.grad.data_ptr(), "scaling one copy's grad must not scale the other's"
    for got, want in zip(mid.parameters(), ref_mid.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def _frozen(rank: int) -> None:
    """Partial fine-tuning: the tied embedding/head frozen, and the middle layer's bias frozen
    and later unfrozen. A frozen tensor's hook once failed every D > 1 run, and the tied sum
    gave the frozen copies a zero gradient that AdamW's weight decay still applied."""
    emb = nn.Parameter(torch.randn(VOCAB, WIDTH), requires_grad=False)
    head = nn.Parameter(emb.detach().clone(), requires_grad=False)
    mid = nn.Linear(WIDTH, WIDTH)
    mid.bias.requires_grad_(False)
    reducer = GradReducer([emb, head, *mid.parameters()], dist.group.WORLD, 2, bucket_bytes=1,
                          tied=[([emb, head], dist.group.WORLD)])
    ref_mid = nn.Linear(WIDTH, WIDTH)
    ref_mid.load_state_dict(mid.state_dict())
    ref_mid.bias.requires_grad_(False)
    for unfrozen in (False, True):
        if unfrozen:   # the script unfreezes a layer between steps
            for q in (mid.bias, ref_mid.bias):
                q.requires_grad_(True)
            for q in (*mid.parameters(), *ref_mid.parameters()):
                q.grad = None
        reducer.arm()
        _loss(emb, head, mid, _batch(rank, 0)).backward()
        reducer.reduce()
        for replica in range(2):
            _loss(emb, head, ref_mid, _batch(replica, 0)).backward()
        assert emb.grad is None and head.grad is None, "a frozen tied weight got a gradient"
        torch.testing.assert_close(mid.weight.grad, ref_mid.weight.grad, rtol=1e-6, atol=1e-7)
        if unfrozen:
            torch.testing.assert_close(mid.bias.grad, ref_mid.bias.grad, rtol=1e-6, atol=1e-7)
        else:
            assert mid.bias.grad is None


@pytest.mark.slow
@pytest.mark.parametrize("replica", [_in_group(_tied), _in_group(_frozen)], ids=["tied", "frozen"])
def test_tied_copies_on_one_stage_are_summed_then_all_reduced(replica):
    ctx = mp.get_context("fork")   # no second import of torch
    port, = free_ports(1)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=replica, args=(rank, port, w), daemon=True) for rank, (_, w) in enumerate(pipes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # 3.12+: fork of a threaded process
        for p in procs:
            p.start()
    try:
        for rank, (r, _) in enumerate(pipes):
            assert r.poll(120), f"replica {rank} did not report"
            said = r.recv()
            assert said == "ok", f"replica {rank}: {said}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


