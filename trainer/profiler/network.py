"""Network helpers: a link's and an all-reduce's costs measured between two helper processes on
loopback with the engine's own transports (PeerChannel, GradReducer over gloo), and the affine
fit ``latency + bytes / bandwidth`` (also used by trainer.linkprobe across hosts)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from protocol.frames import CHUNK_BYTES
from trainer.launch import free_ports
from trainer.planning.calibration import LinkCost
from trainer.profiler.common import ProfilerError, _fork_and_collect, _median

__all__ = ["fit_affine", "measure_network"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)
_LINK_SIZES = (1 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
_ALLREDUCE_SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
_AR_PARAM_NUMEL = 1 << 18   # 1 MiB of fp32 per parameter when the all-reduce is timed
_ONE_FRAME = CHUNK_BYTES   # larger messages go in several parts


def fit_affine(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(a, b) with t ~ a + b * n, least squares in relative error, a >= 0 and b > 0."""
    w = [1.0 / max(t, 1e-9) ** 2 for t in times]
    sw = sum(w)
    sn = sum(wi * n for wi, n in zip(w, sizes))
    st = sum(wi * t for wi, t in zip(w, times))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = sw * snn - sn * sn
    a, b = (0.0, 0.0) if det == 0 else ((st * snn - sn * snt) / det, (sw * snt - sn * st) / det)
    if a < 0:
        a = 0.0
        b = snt / snn if snn else 0.0
    if b <= 0:  # no measurable size dependence: a very fast link
        b = 1e-12
    return a, b


def _network_main(argv: Sequence[str]) -> None:
    """Entry point of one network helper process: `rank ports sizes ar_sizes repeats warmup`
    as JSON in argv[0]; rank 0 prints its timings as one JSON line."""
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    res = _network_measure(spec["rank"], spec["ports"], spec["sizes"], spec["ar_sizes"],
                           spec["repeats"], spec["warmup"])
    print(json.dumps(res), flush=True)


def _network_measure(rank, ports, sizes, ar_sizes, repeats, warmup) -> dict[str, list[float]]:
    import torch.distributed as dist

    from trainer.engine.comm import PeerChannel
    from trainer.net.netaddr import bound_gloo_backend

    ep = [f"tcp://127.0.0.1:{p}" for p in ports[:2]]
    chan = PeerChannel(bind=ep[rank], prev=ep[0] if rank else None, nxt=None if rank else ep[1],
                       job="profile", epoch=0, stage=rank, timeout_s=60.0)
    link: list[float] = []
    send_cpu: list[float] = []
    recv_cpu: list[float] = []
    pair_cpu: list[float] = []   # the whole process's CPU (ZeroMQ's I/O thread too) per round trip
    mb = 0
    for n in sizes:
        x = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        times, sends = [], []
        for r in range(warmup + repeats):
            if rank == 0:
                if r == warmup:
                    cpu0 = time.process_time()
                t0 = time.perf_counter()
                chan.send("act", mb, x)
                t1 = time.perf_counter()
                chan.recv("grad", mb)
                if r >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
                    sends.append(t1 - t0)
            else:
                y = chan.recv("act", mb)
                chan.send("grad", mb, y)
            mb += 1
        if rank == 0:
            pair_cpu.append((time.process_time() - cpu0) / repeats)
        # A receive of a message that has already arrived: the CPU the receiving stage spends.
        pause = 4 * _median(times) + 2e-3 if rank == 0 else 0.0
        recvs = []
        for r in range(warmup + repeats):
            if rank == 0:
                chan.send("act", mb, x)
                time.sleep(pause)
                t0 = time.perf_counter()
                chan.recv("grad", mb)
                if r >= warmup:
                    recvs.append(time.perf_counter() - t0)
            else:
                chan.send("grad", mb, chan.recv("act", mb))
            mb += 1
        if rank == 0:
            link.append(_median(times))
            send_cpu.append(_median(sends))
            recv_cpu.append(_median(recvs))
    # Let the last echo leave before closing.
    if rank == 1:
        chan.recv("act", mb)
    else:
        chan.send("act", mb, torch.zeros(1))
    chan.close()

    # The engine's own reduction (GradReducer: flat buckets, concatenated, summed, written back),
    # over gradients of layer-sized parameters, so that its copies and bucketing are timed too.
    from trainer.engine.data_parallel import GradReducer

    store = dist.TCPStore("127.0.0.1", ports[2], 2, rank == 0, timeout=timedelta(seconds=60))
    # bound to loopback: the host name's address may need a DNS lookup (trainer.net.netaddr)
    dist.init_process_group(bound_gloo_backend("127.0.0.1"), store=store, rank=rank, world_size=2)
    try:
        ar: list[float] = []
        for n in ar_sizes:
            numel = max(n // 4, 1)
            params = [nn.Parameter(torch.zeros(min(_AR_PARAM_NUMEL, numel - i)))
                      for i in range(0, numel, _AR_PARAM_NUMEL)]
            reducer = GradReducer(params, None, 2)
            times = []
            for r in range(warmup + repeats):
                for q in params:
                    q.grad = torch.ones_like(q)
                dist.barrier()
                t0 = time.perf_counter()
                reducer.reduce()
                if r >= warmup:
                    times.append(time.perf_counter() - t0)
            ar.append(_median(times))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # rank 1's lists of the link are empty: only rank 0 times
    return {"link": link, "send_cpu": send_cpu, "recv_cpu": recv_cpu, "pair_cpu": pair_cpu, "allreduce": ar}


def _network_child(spec: dict, conn) -> None:
    try:
        torch.set_num_threads(1)
        conn.send(_network_measure(spec["rank"], spec["ports"], spec["sizes"], spec["ar_sizes"],
                                   spec["repeats"], spec["warmup"]))
    except BaseException as exc:  # reported to the parent, which raises
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _run_helpers_forked(specs: list[dict], timeout_s: float) -> list[dict]:
    """Fork (no import of torch again, no re-run of the caller's main module, like DataLoader
    workers); each helper sends back its timings or its error."""
    return _fork_and_collect(mp.get_context("fork"), _network_child, [(spec,) for spec in specs],
                             timeout_s=timeout_s, what="network measurement", who="network helper")


def _run_helpers_spawned(specs: list[dict], timeout_s: float) -> list[dict]:
    """Fresh interpreters (where fork is unavailable); plain subprocesses rather than
    multiprocessing, so the caller's main module is never re-imported."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from trainer.profiler.network import _network_main; _network_main(sys.argv[1:])"
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for spec in specs]
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ProfilerError(f"network measurement did not finish within {timeout_s:.0f}s") from None
            if p.returncode:
                tail = err.decode(errors="replace").strip().splitlines()[-5:]
                raise ProfilerError(f"network helper exited with code {p.returncode}: " + " | ".join(tail))
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def measure_network(*, sizes: Sequence[int] = _LINK_SIZES, allreduce_sizes: Sequence[int] = _ALLREDUCE_SIZES,
                    repeats: int = 7, warmup: int = 2, timeout_s: float = 120.0,
                    io_threads_busy: bool = False) -> tuple[LinkCost, LinkCost]:
    """(send cost, all-reduce cost) between two helper processes on loopback: a PeerChannel
    ping-pong (one way = half the round trip) and the engine's gradient all-reduce (GradReducer
    over gloo) at D = 2, each fitted.
    Needs no launcher and leaves the caller's process groups and sockets alone.

    The per-message overheads are the send call's time and a receive of an arrived message.
    `io_threads_busy` (CPU workers that fill the host's cores) counts ZeroMQ's I/O threads as
    well: their CPU then competes with the stages' compute, so the receive overhead becomes what
    the process spends per round trip (one message each way) beyond the send call."""
    ports = free_ports(3)
    specs = [{"rank": r, "ports": ports, "sizes": list(sizes), "ar_sizes": list(allreduce_sizes),
              "repeats": repeats, "warmup": warmup} for r in range(2)]
    # A forked helper would inherit this process's default process group, if it has one; it
    # initialises its own.
    import torch.distributed as dist

    forkable = "fork" in mp.get_all_start_methods() and not (dist.is_available() and dist.is_initialized())
    run = _run_helpers_forked if forkable else _run_helpers_spawned
    got = run(specs, timeout_s)[0]
    a, b = fit_affine(list(sizes), got["link"])
    # The stages' own CPU per message, from the sizes that fit one frame (larger ones add copies
    # that scale with the bytes, which the bandwidth term covers); the rest of the one-way time
    # (the fit's constant, which includes both) is in flight.
    small = [i for i, n in enumerate(sizes) if n <= _ONE_FRAME] or [0]
    send_oh = _median([got["send_cpu"][i] for i in small])
    recv_oh = _median([got["recv_cpu"][i] for i in small])
    if io_threads_busy:
        recv_oh = max(recv_oh, _median([got["pair_cpu"][i] for i in small]) - send_oh)
    link = LinkCost(latency_s=max(0.0, a - send_oh - recv_oh), bandwidth_Bps=1.0 / b,
                    send_overhead_s=send_oh, recv_overhead_s=recv_oh)
    a, b = fit_affine(list(allreduce_sizes), got["allreduce"])
    allreduce = LinkCost(latency_s=a / 2, bandwidth_Bps=1.0 / b)   # ring at D=2: n / bw + 2 * latency
    return link, allreduce
