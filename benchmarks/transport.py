"""Tensor transport throughput: protocol frames over ZeroMQ vs a raw TCP socket vs gloo send/recv.

Two processes on loopback TCP. The parent sends, a spawned child receives. For each tensor size
(64 KiB .. 64 MiB) and each contender, the parent tells the child (over a pipe) to expect `count`
tensors, then sends them back to back; the time runs from the first send to the child's "done".
One unmeasured pass warms everything up; then each cell is measured `--repeats` times, contenders
in a rotating order. Reported: the median GB/s of each cell; each ratio is the median, over repeats,
of the two contenders' rates measured back to back (so both saw the same background load); and the
CPU seconds per GB of both processes, all threads included (robust to other load, unlike GB/s).

Contenders (each receive delivers a fresh tensor, as a pipeline worker needs one per micro-batch):

- ours        send_tensor / recv_tensor over PUSH/PULL, plaintext (the trainer's socket setup)
- ours_curve  the same with CURVE authentication and encryption (protocol.security)
- raw         socket.sendall / recv_into into a fresh buffer allocated like ours (numpy, huge pages)
- raw_reuse   the same into one preallocated buffer: a bound, since it allocates nothing
- gloo        torch.distributed send / recv (gloo, TCP init on 127.0.0.1, world 2) into a fresh buffer

Run:  python benchmarks/transport.py [--quick] [--repeats N]
The last line is  `bench transport: ratio_1MiB_plus=<min ours/raw over sizes >= 1 MiB>
vs_gloo=<min ours/gloo over the same sizes> curve_gbps=<min GB/s of the CURVE stream over them>`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.frames import recv_tensor, send_tensor  # noqa: E402
from protocol.security import Security, SecurityConfig, generate_key_pair, load_public_key  # noqa: E402
from trainer.launch import free_ports  # noqa: E402

__all__ = ["main"]

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
CONTENDERS = ("ours", "ours_curve", "raw", "raw_reuse", "gloo")
_FRAME = dict(job="bench", epoch=1, stage=0, micro_batch=0, direction="act")


def _cpu_s() -> float:
    # User + system time of every thread of this process (ZeroMQ's I/O thread included).
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fresh(nbytes: int) -> torch.Tensor:
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("raw peer closed the connection")
        got += k


def _setup_security(keys: Path, me: str) -> Security:
    return Security(SecurityConfig(secret_key_file=str(keys / f"{me}.key_secret"), allowed_keys_dir=str(keys)))


def _receiver(ctl, ports: list[int], keys: str) -> None:
    torch.set_num_threads(1)
    p_plain, p_curve, p_raw, p_gloo = ports
    ctx = zmq.Context()
    security = _setup_security(Path(keys), "receiver")
    pulls = {}
    for name, port, secure in (("ours", p_plain, False), ("ours_curve", p_curve, True)):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        if secure:
            security.apply_stream_server(sock)
        sock.bind(f"tcp://127.0.0.1:{port}")
        pulls[name] = sock
    listener = socket.create_server(("127.0.0.1", p_raw))
    ctl.send("listening")
    raw, _ = listener.accept()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{p_gloo}", rank=1, world_size=2)
    reuse: dict[int, torch.Tensor] = {}
    while True:
        cmd = ctl.recv()
        if cmd[0] == "quit":
            break
        _, contender, size, count = cmd
        if contender == "raw_reuse":
            reuse.setdefault(size, _fresh(size))
        ctl.send("ready")
        cpu = _cpu_s()
        last = None
        for _ in range(count):
            if contender in pulls:
                _, last = recv_tensor(pulls[contender])
            elif contender in ("raw", "raw_reuse"):
                last = reuse[size] if contender == "raw_reuse" else _fresh(size)
                _recv_exact(raw, memoryview(last.numpy()))
            else:
                last = _fresh(size)
                dist.recv(last, src=0)
        ctl.send(("done", bytes(last.view(torch.uint8)[-8:].numpy()), _cpu_s() - cpu))
    dist.destroy_process_group()
    raw.close()
    security.close()
    ctx.destroy(linger=0)


def _sender(ctl, ports: list[int], keys: Path):
    p_plain, p_curve, p_raw, p_gloo = ports
    ctx = zmq.Context()
    security = _setup_security(keys, "sender")
    security.add_peer(f"tcp://127.0.0.1:{p_curve}", load_public_key(keys / "receiver.key"))
    pushes = {}
    for name, port, secure in (("ours", p_plain, False), ("ours_curve", p_curve, True)):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        endpoint = f"tcp://127.0.0.1:{port}"
        if secure:
            security.apply_stream_client(sock, endpoint)
        sock.connect(endpoint)
        pushes[name] = sock
    if ctl.recv() != "listening":
        raise RuntimeError("receiver failed to start")
    raw = socket.create_connection(("127.0.0.1", p_raw))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{p_gloo}", rank=0, world_size=2)
    tensors = {size: torch.randn(size // 4) for size in SIZES}

    def run(contender: str, size: int, count: int) -> tuple[float, float]:
        """(GB/s, CPU seconds per GB of both processes) of one cell."""
        t = tensors[size]
        ctl.send(("run", contender, size, count))
        if ctl.recv() != "ready":
            raise RuntimeError("receiver out of step")
        cpu = _cpu_s()
        start = time.perf_counter()
        if contender in pushes:
            for _ in range(count):
                send_tensor(pushes[contender], t, **_FRAME)
        elif contender in ("raw", "raw_reuse"):
            view = memoryview(t.numpy()).cast("B")
            for _ in range(count):
                raw.sendall(view)
        else:
            for _ in range(count):
                dist.send(t, dst=1)
        status, tail, receiver_cpu = ctl.recv()
        elapsed = time.perf_counter() - start
        sender_cpu = _cpu_s() - cpu
        if status != "done" or tail != bytes(t.view(torch.uint8)[-8:].numpy()):
            raise RuntimeError(f"{contender} delivered wrong bytes")
        gb = count * size / 1e9
        return gb / elapsed, (sender_cpu + receiver_cpu) / gb

    def close() -> None:
        ctl.send(("quit",))
        dist.destroy_process_group()
        raw.close()
        security.close()
        ctx.destroy(linger=1000)

    return run, close


def _measure(run, repeats: int, target_bytes: int, min_count: int,
             budget_s: float) -> dict[tuple[str, int], list[tuple[float, float]]]:
    # One unmeasured pass first: connections, handshakes, and the growth of each allocator's heap to
    # hold `count` tensors in flight are paid once per process, not per tensor.
    started = time.perf_counter()
    for size in SIZES:
        for contender in CONTENDERS:
            run(contender, size, max(min_count, target_bytes // size))
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(repeats):
        if r >= 2 and time.perf_counter() - started > budget_s:
            print(f"time budget spent: {r} repeats instead of {repeats}")
            break
        for size in SIZES:
            k = (r + SIZES.index(size)) % len(CONTENDERS)
            for contender in CONTENDERS[k:] + CONTENDERS[:k]:   # rotate who goes first
                count = max(min_count, target_bytes // size)
                cells.setdefault((contender, size), []).append(run(contender, size, count))
    return cells


def _size_name(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def _paired(cells, a: str, b: str, size: int) -> float:
    # Median over repeats of a/b measured back to back: both saw the same background load.
    return statistics.median(x[0] / y[0] for x, y in zip(cells[(a, size)], cells[(b, size)]))


def _report(cells) -> tuple[float, float, float]:
    rate = {key: statistics.median(v[0] for v in vals) for key, vals in cells.items()}
    cpu = {key: statistics.median(v[1] for v in vals) for key, vals in cells.items()}
    pairs = (("ours", "raw"), ("ours", "raw_reuse"), ("ours", "gloo"), ("ours_curve", "raw"))
    heads = ("size", "ours", "curve", "raw", "raw_reuse", "gloo", "ours/raw", "ours/reuse", "ours/gloo", "curve/raw")
    print("throughput, GB/s (median over repeats); ratios: median of back-to-back pairs")
    print("".join(f"{h:>11}" for h in heads))
    ratio, vs_gloo, curve = float("inf"), float("inf"), float("inf")
    for size in SIZES:
        ratios = [_paired(cells, a, b, size) for a, b in pairs]
        row = [rate[(c, size)] for c in CONTENDERS] + ratios
        print(f"{_size_name(size):>11}" + "".join(f"{x:>11.2f}" for x in row))
        if size >= MiB:
            ratio, vs_gloo = min(ratio, ratios[0]), min(vs_gloo, ratios[2])
            curve = min(curve, rate[("ours_curve", size)])
    print("CPU seconds per GB moved, sender + receiver (all threads), median")
    print("".join(f"{h:>11}" for h in heads[:6]))
    for size in SIZES:
        print(f"{_size_name(size):>11}" + "".join(f"{cpu[(c, size)]:>11.2f}" for c in CONTENDERS))
    spread = max((max(v[0] for v in vals) - min(v[0] for v in vals)) / rate[key] for key, vals in cells.items())
    print(f"largest spread (max-min)/median of a cell over its repeats: {spread:.0%}"
          f"{'  (noisy: other processes share the CPUs?)' if spread > 0.5 else ''}")
    return ratio, vs_gloo, curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer bytes and repeats; stops repeating after ~30 s so it ends within a minute")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per cell (default 5 quick, 9 full)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    target, min_count = (64 * MiB, 4) if args.quick else (384 * MiB, 8)
    budget_s = 30.0 if args.quick else 1e9
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    ports = free_ports(4)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp)
        generate_key_pair(keys, "sender")
        generate_key_pair(keys, "receiver")
        mpc = mp.get_context("spawn")
        ctl, child_ctl = mpc.Pipe()
        child = mpc.Process(target=_receiver, args=(child_ctl, ports, str(keys)), daemon=True)
        child.start()
        started = time.perf_counter()
        run, close = _sender(ctl, ports, keys)
        cells = _measure(run, repeats, target, min_count, budget_s)
        close()
        child.join(30)
    repeats = len(next(iter(cells.values())))
    print(f"{len(SIZES)} sizes x {len(CONTENDERS)} contenders x {repeats} repeats, "
          f"~{target // MiB} MiB per cell, {time.perf_counter() - started:.0f}s, {os.cpu_count()} CPUs")
    ratio, vs_gloo, curve = _report(cells)
    print(f"bench transport: ratio_1MiB_plus={ratio:.2f} vs_gloo={vs_gloo:.2f} curve_gbps={curve:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
