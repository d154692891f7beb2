"""Measure the link between two hosts over the transports training uses.

``python -m trainer.linkprobe SPEC`` runs one side (SPEC is JSON: rank 0 or 1, the two hosts'
bind addresses, ``ports`` = [rank 0's stream port, rank 1's stream port, rank 0's rendezvous
port]). Both sides: activations-sized tensors over a ZeroMQ PeerChannel (rank 1 echoes), then
gloo all-reduces over a group bound to those addresses (trainer.net.netaddr, trainer.net.rendezvous).
Rank 0 prints one JSON line: the link's latency and bandwidth (fit of half round trips) and the
all-reduce's (fit of its times), as ``trainer.planning.calibration.LinkCost`` fields.

Brief by construction: sizes grow until one message takes ``max_message_s`` (a 10 Mbit/s link
stops at 256 KiB), so a probe costs about a second whatever the link. Streams are plaintext:
the link is measured here; what CURVE costs each side's CPU is in the calibration's overheads.

Above the engine (it measures a link with the engine's own transports, trainer.engine.comm) and
beside the profiler, whose affine fit it shares; trainer.net below the engine never imports it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["measure", "main"]

_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def measure(rank: int, hosts: Sequence[str], ports: Sequence[int], *, repeats: int = 3, warmup: int = 1,
            max_message_s: float = 0.15, timeout_s: float = 30.0) -> dict[str, float] | None:
    import torch
    import torch.distributed as dist

    from trainer.engine.comm import PeerChannel
    from trainer.net.netaddr import bound_gloo_backend
    from trainer.net.rendezvous import RendezvousStore

    torch.set_num_threads(1)
    ep = [f"tcp://{_bracket(hosts[0])}:{ports[0]}", f"tcp://{_bracket(hosts[1])}:{ports[1]}"]
    store = RendezvousStore(hosts[0], ports[2], is_server=rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(bound_gloo_backend(hosts[rank]), store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    chan = PeerChannel(bind=ep[rank], prev=ep[0] if rank else None, nxt=None if rank else ep[1],
                       job="linkprobe", epoch=0, stage=rank, timeout_s=timeout_s)
    try:
        sizes, link, ar = [], [], []
        mb = 0
        for n in _SIZES:
            x = torch.zeros(n // 4)
            times = []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                if rank == 0:
                    chan.send("act", mb, x)
                    chan.recv("grad", mb)
                else:
                    chan.send("grad", mb, chan.recv("act", mb))
                times.append((time.perf_counter() - t0) / 2)
                mb += 1
            t_link = _median(times[warmup:])
            ar_times = []
            for r in range(warmup + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                ar_times.append(time.perf_counter() - t0)
            t_ar = _median(ar_times[warmup:])
            # both sides must agree on whether to go on: rank 0's times decide
            go = torch.tensor([1.0 if max(t_link, t_ar) < max_message_s else 0.0])
            dist.broadcast(go, src=0)
            sizes.append(n)
            link.append(t_link)
            ar.append(t_ar)
            if go.item() == 0.0:
                break
        dist.barrier()
    finally:
        chan.close()
        dist.destroy_process_group()
        store.close()
    if rank != 0:
        return None
    lat, bw = _line(sizes, link)
    ar_lat, ar_bw = _line(sizes, ar)
    # LinkCost.allreduce_s for 2 replicas: n / bandwidth + 2 * latency
    return {"latency_s": lat, "bandwidth_Bps": bw, "allreduce_latency_s": ar_lat / 2, "allreduce_Bps": ar_bw,
            "sizes": sizes, "link_s": link, "allreduce_s": ar}


def _line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(latency, bandwidth): the bandwidth from the two largest messages' difference (a token
    bucket lets a burst through at line rate, so small messages overstate a capped link; the
    difference of two large ones cancels it), the latency from the smallest message."""
    from trainer.profiler.network import fit_affine

    if len(sizes) >= 2 and times[-1] > times[-2]:
        bw = (sizes[-1] - sizes[-2]) / (times[-1] - times[-2])
    else:
        bw = 1.0 / fit_affine(sizes, times)[1]
    return max(0.0, times[0] - sizes[0] / bw), bw


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: Sequence[str] | None = None) -> int:
    spec = json.loads((sys.argv[1:] if argv is None else list(argv))[0])
    result = measure(int(spec["rank"]), spec["hosts"], spec["ports"], timeout_s=float(spec.get("timeout_s", 30)))
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
