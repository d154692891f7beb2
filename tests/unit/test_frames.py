"""protocol.frames: tensors of every dtype and shape cross real sockets intact; bad frames are refused."""

from __future__ import annotations

import gc
import math
import random

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import MessageValueError, ProtocolError
from protocol.frames import (
    CHUNK_BYTES,
    DIRECTIONS,
    DTYPES,
    TensorHeader,
    recv_tensor,
    send_tensor,
)
from protocol.messages import PROTOCOL_VERSION

META = dict(job="job-1", epoch=3, stage=1, micro_batch=5, direction="act")
TIMEOUT_MS = 5000


def _pair(ctx: zmq.Context, kind: str):
    if kind == "inproc":
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind(f"inproc://frames-{random.getrandbits(64)}")
    else:   # the trainer's setup: PUSH -> PULL over TCP, no high-water mark
        a, b = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        a.setsockopt(zmq.SNDHWM, 0)
        b.setsockopt(zmq.RCVHWM, 0)
        a.bind("tcp://127.0.0.1:*")
    b.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))
    return a, b


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="module")
def inproc(ctx):
    return _pair(ctx, "inproc")


@pytest.fixture(scope="module")
def tcp(ctx):
    return _pair(ctx, "tcp")


def _recv(sock):
    assert sock.poll(TIMEOUT_MS), "nothing arrived"
    return recv_tensor(sock)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).view(torch.bool).reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)   # every bit pattern, NaNs included


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, so that NaN payloads and -0.0 count too.
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check(sent: torch.Tensor, header: TensorHeader, got: torch.Tensor, **meta) -> None:
    meta = {**META, **meta}
    assert (header.job, header.epoch, header.stage, header.micro_batch, header.direction) == (
        meta["job"], meta["epoch"], meta["stage"], meta["micro_batch"], meta["direction"])
    assert header.dtype == str(sent.dtype).removeprefix("torch.")
    assert header.shape == tuple(sent.shape) and header.nbytes == sent.numel() * sent.element_size()
    assert got.dtype == sent.dtype and got.shape == sent.shape and got.device.type == "cpu"
    assert got.is_contiguous()
    assert _same_bytes(got, sent)


# --- round trips -----------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), shape=shapes, seed=st.integers(0, 2**32 - 1),
       transpose=st.booleans(), direction=st.sampled_from(DIRECTIONS), micro_batch=st.integers(0, 2**31 - 1))
def test_round_trip_every_dtype_and_shape(inproc, dtype, shape, seed, transpose, direction, micro_batch):
    t = _random_tensor(DTYPES[dtype], shape, seed)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)   # non-contiguous
    a, b = inproc
    send_tensor(a, t, **{**META, "direction": direction, "micro_batch": micro_batch})
    header, got = _recv(b)
    _check(t, header, got, direction=direction, micro_batch=micro_batch)


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16", "int64", "bool", "uint8"]),
       extra=st.integers(-3, 3 * CHUNK_BYTES), seed=st.integers(0, 2**32 - 1))
def test_multi_frame_round_trip_over_tcp(tcp, dtype, extra, seed):
    itemsize = DTYPES[dtype].itemsize
    numel = max(1, (CHUNK_BYTES + extra) // itemsize)
    t = _random_tensor(DTYPES[dtype], (numel,), seed)
    a, b = tcp
    send_tensor(a, t, **META)
    header, got = _recv(b)
    _check(t, header, got)


@pytest.mark.parametrize("tensor", [
    torch.tensor(3.5),
    torch.tensor(True),
    torch.empty(0),
    torch.empty(3, 0, 2, dtype=torch.bfloat16),
    torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, ::2, 1:],
    torch.arange(4 * CHUNK_BYTES // 4, dtype=torch.float32).reshape(1024, -1).t(),
    torch.randn(CHUNK_BYTES // 2).to(torch.bfloat16),
    torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj(),
    torch.ones(3, dtype=torch.complex64).conj().imag,
    torch.randn(4, 4, requires_grad=True) * 2,
], ids=["0dim", "0dim-bool", "empty", "empty-3d", "strided", "multi-frame-transposed", "bf16-1MiB", "conj",
        "neg-view", "requires-grad"])
def test_round_trip_edge_cases(tcp, tensor):
    a, b = tcp
    send_tensor(a, tensor, **META)
    header, got = _recv(b)
    _check(tensor.detach().resolve_conj().resolve_neg(), header, got)


def test_received_tensors_are_usable_and_writable(tcp):
    a, b = tcp
    for n in (3, 1000, CHUNK_BYTES // 4, CHUNK_BYTES // 4 + 1):
        send_tensor(a, torch.ones(n), **META)
        _, got = _recv(b)
        got.add_(1)   # in place: the buffer must be ours and writable
        assert torch.all(got == 2)
        assert got.data_ptr() % got.element_size() == 0


def test_sender_keeps_memory_alive_after_the_caller_drops_it(tcp):
    a, b = tcp
    t = torch.arange(3 * CHUNK_BYTES // 8, dtype=torch.float64)
    expected = t.clone()
    send_tensor(a, t, **META)
    del t
    gc.collect()
    junk = [torch.full((CHUNK_BYTES // 8,), -1.0, dtype=torch.float64) for _ in range(8)]  # reuse freed memory
    _, got = _recv(b)
    assert torch.equal(got, expected)
    assert junk[0][0] == -1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_arrive_on_cpu(tcp):
    a, b = tcp
    t = torch.randn(5, 7, device="cuda").t()
    send_tensor(a, t, **META)
    _, got = _recv(b)
    assert got.device.type == "cpu" and torch.equal(got, t.cpu())


def test_noblock_on_an_empty_socket_raises_again(ctx):
    _, b = _pair(ctx, "inproc")
    with pytest.raises(zmq.Again):
        recv_tensor(b, zmq.NOBLOCK)


# --- refused on send --------------------------------------------------------------------------------

@pytest.mark.parametrize("make, meta, words", [
    (lambda: torch.ones(2), dict(direction="fwd"), "direction"),
    (lambda: torch.ones(2), dict(epoch=-1), "epoch"),
    (lambda: torch.ones(2), dict(stage=True), "bool"),
    (lambda: torch.ones(2), dict(job=""), "job"),
    (lambda: torch.ones(2), dict(micro_batch=-1), "micro_batch"),
    pytest.param(lambda: torch.ones(2, dtype=torch.complex32), {}, "cannot be sent",
                 marks=pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")),
    (lambda: torch.ones(2).to_sparse(), {}, "dense"),
])
def test_send_refuses_bad_arguments(ctx, make, meta, words):
    a, b = _pair(ctx, "inproc")
    with pytest.raises(MessageValueError, match=words):
        send_tensor(a, make(), **{**META, **meta})
    assert not b.poll(0)   # nothing half-sent


# --- refused on receive ------------------------------------------------------------------------------

def _header(**over):
    body = dict(job="j", epoch=0, stage=0, micro_batch=0, direction="act", dtype="float32", shape=[2], nbytes=8)
    nframes = over.pop("nframes", 1)
    body.update(over)
    return msgpack.packb([PROTOCOL_VERSION, "tensor", body, nframes])


BAD_MESSAGES = {
    "not-msgpack": [b"\xc1", b"\x00" * 8],
    "wrong-layout": [msgpack.packb([PROTOCOL_VERSION, "tensor", {}]), b"\x00" * 8],
    "wrong-version": [msgpack.packb([2, "tensor", {}, 1]), b"\x00" * 8],
    "float-version": [msgpack.packb([1.0, "tensor", msgpack.unpackb(_header())[2], 1]), b"\x00" * 8],
    "wrong-tag": [msgpack.packb([PROTOCOL_VERSION, "ping", {}, 1]), b"\x00" * 8],
    "nbytes-vs-shape": [_header(nbytes=12), b"\x00" * 12],
    "unknown-dtype": [_header(dtype="float128", nbytes=32), b"\x00" * 32],
    "bad-direction": [_header(direction="sideways"), b"\x00" * 8],
    "negative-dim": [_header(shape=[-2]), b"\x00" * 8],
    "bool-nframes": [_header(nframes=True), b"\x00" * 8],
    "too-few-parts": [_header(shape=[CHUNK_BYTES // 2], nbytes=2 * CHUNK_BYTES, nframes=2), b"\x00" * CHUNK_BYTES],
    "too-many-parts": [_header(), b"\x00" * 8, b"\x00" * 8],
    "part-too-short": [_header(), b"\x00" * 7],
    "part-too-long": [_header(), b"\x00" * 9],
    "chunk-wrong-size": [_header(shape=[CHUNK_BYTES // 2], nbytes=2 * CHUNK_BYTES, nframes=2),
                         b"\x00" * (CHUNK_BYTES - 1), b"\x00" * (CHUNK_BYTES + 1)],
    "nframes-disagrees": [_header(nframes=2), b"\x00" * 4, b"\x00" * 4],
    "data-missing": [_header()],
    "empty-with-data": [_header(shape=[0], nbytes=0, nframes=0), b"\x00"],
    "bool-not-0-1": [_header(dtype="bool", shape=[4], nbytes=4), b"\x00\x01\x02\x01"],
    "huge-claim": [_header(dtype="uint8", shape=[2**40], nbytes=2**40, nframes=2**20), b"\x00" * 8],
}


@pytest.mark.parametrize("name", list(BAD_MESSAGES))
def test_recv_refuses_bad_frames_and_stays_in_sync(inproc, name):
    a, b = inproc
    a.send_multipart(BAD_MESSAGES[name])
    assert b.poll(TIMEOUT_MS)
    with pytest.raises(ProtocolError):
        recv_tensor(b)
    # The refused message was consumed whole: the next one arrives intact.
    t = torch.arange(5.0)
    send_tensor(a, t, **META)
    header, got = _recv(b)
    assert torch.equal(got, t) and header.micro_batch == META["micro_batch"]


def test_mutated_headers_raise_only_protocol_error(inproc):
    a, b = inproc
    rng = random.Random(99)
    good = _header(shape=[2, 1], nbytes=8)
    refused = 0
    for _ in range(1500):
        head = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(max(1, len(head)))
            if rng.random() < 0.5 and head:
                head[i] = rng.randrange(256)
            else:
                del head[i:]
                head += rng.randbytes(rng.randint(0, 4))
        a.send_multipart([bytes(head), b"\x00" * 8])
        try:
            header, got = recv_tensor(b)
        except ProtocolError:
            refused += 1
        else:
            assert got.numel() * got.element_size() == header.nbytes
    assert refused > 1000
    assert not b.poll(0)   # every message consumed whole


# --- the header value object ------------------------------------------------------------------------

def test_header_validates_itself():
    h = TensorHeader(job="j", epoch=0, stage=2, micro_batch=1, direction="grad", dtype="bfloat16",
                     shape=[3, 4], nbytes=24)
    assert h.shape == (3, 4)
    with pytest.raises(MessageValueError, match="needs 24"):
        TensorHeader(job="j", epoch=0, stage=2, micro_batch=1, direction="grad", dtype="bfloat16",
                     shape=(3, 4), nbytes=48)
    with pytest.raises(MessageValueError, match="not supported"):
        TensorHeader(job="j", epoch=0, stage=0, micro_batch=0, direction="act", dtype="float128",
                     shape=(), nbytes=16)
    with pytest.raises(TypeError):
        TensorHeader("j", 0, 0, 0, "act", "float32", (), 4)  # type: ignore[misc]


def test_dtypes_cover_the_required_ones():
    assert {"float32", "float16", "bfloat16", "int64", "bool"} <= set(DTYPES)


# --- header caches ----------------------------------------------------------------------------------

def test_send_cache_never_bypasses_validation(ctx):
    a, b = _pair(ctx, "inproc")
    t = torch.ones(2)
    send_tensor(a, t, **META)   # now cached under META's values
    _recv(b)
    # True == 1 and 3.0 == 3 hash alike: they must not reuse the bytes sent for 1 and 3
    for bad, words in ((dict(stage=True), "bool"), (dict(epoch=3.0), "integer"), (dict(micro_batch=-1), "micro_batch")):
        with pytest.raises(MessageValueError, match=words):
            send_tensor(a, t, **{**META, **bad})
    assert not b.poll(0)


def test_receive_cache_keeps_refusing_bad_headers(inproc):
    a, b = inproc
    good = _header(shape=[2], nbytes=8)
    for _ in range(3):   # the second and third hit the cache and decode alike
        a.send_multipart([good, b"\x00" * 8])
        header, got = _recv(b)
        assert (header.job, header.epoch, header.shape, got.shape) == ("j", 0, (2,), (2,))
    for bad in (_header(shape=[2], nbytes=12), _header(direction="sideways")):
        for _ in range(2):   # a refused header is never cached
            a.send_multipart([bad, b"\x00" * 8])
            assert b.poll(TIMEOUT_MS)
            with pytest.raises(ProtocolError):
                recv_tensor(b)
    # a cached header with the wrong number of data bytes is still refused
    a.send_multipart([good, b"\x00" * 4])
    assert b.poll(TIMEOUT_MS)
    with pytest.raises(ProtocolError):
        recv_tensor(b)
    assert not b.poll(0)


def test_header_caches_are_bounded(inproc):
    from protocol import frames
    a, b = inproc
    for mb in range(frames._CACHE_ENTRIES + 10):
        send_tensor(a, torch.ones(1), **{**META, "micro_batch": mb})
        header, _ = _recv(b)
        assert header.micro_batch == mb
    assert 0 < len(frames._SENT) <= frames._CACHE_ENTRIES
    assert 0 < len(frames._RECEIVED) <= frames._CACHE_ENTRIES


# --- through the trainer's PeerChannel ----------------------------------------------------------------

def test_peer_channel_drops_stale_epochs_and_times_out(ctx):
    import time

    from trainer.engine.comm import PeerChannel
    from trainer.errors import WorkerError

    port = random.randrange(20000, 60000)
    chan = None
    for _ in range(20):
        try:
            chan = PeerChannel(bind=f"tcp://127.0.0.1:{port}", prev=None, nxt=None, job="job-1", epoch=3,
                               stage=1, timeout_s=60)
            break
        except zmq.ZMQError:
            port = random.randrange(20000, 60000)
    assert chan is not None
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(2):   # the second round hits the header caches on both sides
            send_tensor(push, torch.full((2,), 1.0), **{**META, "stage": 0, "epoch": 2})   # stale epoch
            send_tensor(push, torch.full((2,), 2.0), **{**META, "stage": 2})               # wrong sender
            send_tensor(push, torch.full((2,), 3.0), **{**META, "stage": 0, "micro_batch": 7})  # early
            send_tensor(push, torch.full((2,), 4.0), **{**META, "stage": 0})
            assert torch.equal(chan.recv("act", 5), torch.full((2,), 4.0))
            assert torch.equal(chan.recv("act", 7), torch.full((2,), 3.0))   # kept while waiting for 5
        chan.timeout_s = 0.3
        start = time.perf_counter()
        with pytest.raises(WorkerError, match="within"):
            chan.recv("act", 6)   # stale and misdirected frames never satisfy a wait
        assert 0.25 < time.perf_counter() - start < 5
    finally:
        push.close(linger=0)
        chan.close()


def test_peer_channels_exchange_step_statistics_with_any_worker():
    # Stage 2 is no neighbour of stage 0; its statistics reach it anyway, named by its rank, and
    # wait in the early queue while stage 0 waits for something else.
    from trainer.engine.comm import PeerChannel
    from trainer.launch import free_ports

    eps = [f"tcp://127.0.0.1:{p}" for p in free_ports(3)]
    chans = [PeerChannel(bind=eps[r], prev=eps[r - 1] if r else None, nxt=eps[r + 1] if r < 2 else None,
                         job="job-1", epoch=0, stage=r, rank=r, timeout_s=10,
                         stats_peers={0: eps[0]} if r else {1: eps[1], 2: eps[2]}) for r in range(3)]
    try:
        chans[2].send_stats(0, torch.tensor([2.0], dtype=torch.float64))
        chans[1].send("grad", 4, torch.ones(3))
        chans[1].send_stats(0, torch.tensor([1.0], dtype=torch.float64))
        assert torch.equal(chans[0].recv("grad", 4), torch.ones(3))
        assert chans[0].recv_stats(1).item() == 1.0 and chans[0].recv_stats(2).item() == 2.0
        for r in (1, 2):
            chans[0].send_stats(r, torch.tensor([3.0], dtype=torch.float64))
            assert chans[r].recv_stats(0).item() == 3.0
        assert all(not q for c in chans for q in c._early.values())   # nothing stray was left behind
    finally:
        for c in chans:
            c.close()


def test_a_peer_that_sends_and_closes_is_read_before_it_counts_as_dead(monkeypatch):
    """Stage 0 sends the step's statistics and moves on, closing its channel: the connection stage
    2 sends on drops while the message may still be on its way over the one it receives on. The
    message is read; a peer that closed without sending still fails the wait, after the grace."""
    import threading
    import time

    from trainer.engine import comm
    from trainer.engine.comm import PeerChannel
    from trainer.errors import WorkerError
    from trainer.launch import free_ports

    monkeypatch.setattr(comm, "_BROKEN_GRACE_S", 2.0)   # wide margins on a loaded machine
    eps = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    # the waiting side last: its peer already listens, and the connection's handshake is seen all
    # the same (a monitor attached after connecting missed it, and then the drop too)
    first = PeerChannel(bind=eps[0], prev=None, nxt=None, job="job-1", epoch=0, stage=0, rank=0, timeout_s=30,
                        stats_peers={2: eps[1]})
    waiting = PeerChannel(bind=eps[1], prev=None, nxt=None, job="job-1", epoch=0, stage=2, rank=2, timeout_s=30,
                          stats_peers={0: eps[0]})
    waiting._wake_ms = 20   # check the connections often: the drop is seen long before the message comes
    late = zmq.Context.instance().socket(zmq.PUSH)
    late.connect(eps[1])
    try:
        waiting.send_stats(0, torch.tensor([1.0], dtype=torch.float64))   # its connection to stage 0 is up
        assert first.recv_stats(2).item() == 1.0
        first.close()   # stage 0 moves on: stage 2's connection to it drops

        def send_late():
            time.sleep(0.5)   # the message still on its way
            send_tensor(late, torch.tensor([3.0], dtype=torch.float64),
                        **{**META, "stage": 0, "epoch": 0, "direction": "stats", "micro_batch": 0})

        sender = threading.Thread(target=send_late)
        sender.start()
        assert waiting.recv_stats(0).item() == 3.0
        sender.join()
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=f"the connection to the worker at {eps[0]} broke"):
            waiting.recv_stats(0)   # nothing more comes: the drop counts once the grace is over
        assert time.perf_counter() - start < 10
    finally:
        late.close(linger=0)
        waiting.close()


_SEND_AND_EXIT = """
import signal, sys, torch
from trainer.engine import comm
from trainer.engine.comm import PeerChannel
comm._CLOSE_LINGER_MS = 20_000   # the mechanism under test, not the production bound on a dead peer
bind, peer = sys.argv[1], sys.argv[2]
chan = PeerChannel(bind=bind, prev=None, nxt=None, job="job-1", epoch=0, stage=0, rank=0, timeout_s=30,
                   stats_peers={2: peer})
rang = []
signal.signal(signal.SIGALRM, lambda *_: rang.append(1))   # a handler of the script's own
chan.send_stats(2, torch.arange(8 << 20, dtype=torch.float64))   # 64 MiB: many writes of the I/O thread
signal.setitimer(signal.ITIMER_REAL, 0.002)   # a signal while the close waits for them
chan.close()
assert rang, "the signal was lost"
"""


def test_what_a_worker_sends_before_it_closes_and_exits_arrives():
    """A worker's last message (its step's statistics) goes out before its process ends, however
    little time its I/O thread has had (pyzmq never terminates a context at interpreter exit) and
    though a signal the script handles comes while the close waits for it."""
    import subprocess
    import sys

    from trainer.engine.comm import PeerChannel
    from trainer.launch import free_ports

    eps = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    waiting = PeerChannel(bind=eps[1], prev=None, nxt=None, job="job-1", epoch=0, stage=2, rank=2, timeout_s=60)
    try:
        sender = subprocess.run([sys.executable, "-c", _SEND_AND_EXIT, eps[0], eps[1]], capture_output=True,
                                text=True, timeout=120)
        assert sender.returncode == 0, sender.stderr
        got = waiting.recv_stats(0)
        assert got.numel() == 8 << 20 and got[-1].item() == (8 << 20) - 1
    finally:
        waiting.close()
