"""What the profiler's measurements share: its error, medians, device syncs, tensor bytes, the math
library's workspaces, and the fork-and-collect harness that runs helpers (the network's two ends,
a busy host's slots) in forked processes and raises their failures here."""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Sequence

import torch

from trainer.errors import VarunaError

__all__ = ["ProfilerError"]

log = logging.getLogger("varuna")


class ProfilerError(VarunaError, RuntimeError):
    """A measurement could not be taken (a helper process failed or timed out)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _workspace_bytes(device: torch.device) -> int:
    """Device memory the math library holds in this process beyond its tensors: cuBLAS's
    workspaces, one per thread and stream that ran a matrix product (a worker's: its own thread's
    and autograd's backward thread's). Read by freeing them, so call it once the measurements are
    taken; they are made again at the next product. 0 on a CPU, or where this torch cannot free them."""
    if device.type != "cuda":
        return 0
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        log.warning("this torch cannot free cuBLAS's workspaces: the plan leaves them out of each worker's memory")
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    return max(0, before - torch.cuda.memory_allocated(device))


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _fork_and_collect(ctx, target, args: list[tuple], *, timeout_s: float, what: str, who: str,
                      on_exit=None, join_s: float = 5.0) -> list:
    """Fork one process per entry of `args`, running target(*a, conn); each sends one result, or
    its error as a string, which raises ProfilerError here. `on_exit` runs before the children
    are joined (e.g. to release ones that keep working until all have reported)."""
    pipes = [ctx.Pipe(duplex=False) for _ in args]
    procs = [ctx.Process(target=target, args=(*a, w), daemon=True) for a, (_, w) in zip(args, pipes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        for p in procs:
            p.start()
    for _, w in pipes:
        w.close()
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for (r, _), p in zip(pipes, procs):
            if not r.poll(max(0.0, deadline - time.monotonic())):
                raise ProfilerError(f"{what} did not finish within {timeout_s:.0f}s")
            try:
                got = r.recv()
            except EOFError:
                p.join(timeout=5.0)
                raise ProfilerError(f"{who} exited with code {p.exitcode}") from None
            if isinstance(got, str):
                raise ProfilerError(f"{who} failed: {got}")
            results.append(got)
    finally:
        if on_exit is not None:
            on_exit()
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join()
    return results
