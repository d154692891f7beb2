"""Gradient reduction across replicas (and across the stages that share a tied weight).

The loss is normalised by the global batch size, so gradients are summed, never averaged:
any P x D then computes the same update (DESIGN idea 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradReducer", "TiedReducer"]

_BUCKET_BYTES = 8 * 2**20


def _buckets(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Group same-dtype, same-device parameters into buckets of about `limit` bytes, in
    reverse order so the first bucket holds the layers whose backward finishes first."""
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(list(params)):
        if current and (size + p.numel() * p.element_size() > limit
                        or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        out.append(current)
    return out


class GradReducer:
    """Sum-all-reduce of one stage's gradients over its D replicas, in flat buckets.

    `arm()` before the step's last backward: each bucket's all-reduce starts (asynchronously:
    gloo and NCCL run it on their own threads) as soon as the last of its gradients has been
    accumulated, overlapping the rest of that backward. `launch()` starts the buckets that
    have not started; `wait()` finishes them all and writes the sums back into `.grad`.
    """

    def __init__(self, params: Sequence[nn.Parameter], group, world: int, bucket_bytes: int = _BUCKET_BYTES):
        self.group, self.world = group, world
        self.buckets = _buckets(params, bucket_bytes) if world > 1 else []
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, object]] = []
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        self._armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._start(i)

    def _start(self, i: int) -> None:
        self._started[i] = True
        bucket = self.buckets[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((bucket, flat, work))

    def launch(self) -> None:
        for i in range(len(self.buckets)):
            if not self._started[i]:
                self._start(i)
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)

    def wait(self) -> None:
        for bucket, flat, work in self._pending:
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p)
                offset += n
        self._pending.clear()

    def reduce(self) -> None:
        self.launch()
        self.wait()

    def release(self) -> None:
        """Drop the process group (after it was destroyed): the hooks keep this object alive."""
        self.group, self.buckets, self._bucket_of = None, [], {}


class TiedReducer:
    """Keeps weights that are one tensor in the math (tied embeddings) equal: every owner
    contributes the gradient of its copies, the sum goes back to all of them."""

    def __init__(self, groups: Sequence[tuple[Sequence[nn.Parameter], object | None]]):
        self.groups = [(list(params), pg) for params, pg in groups if params]

    def release(self) -> None:
        self.groups = []

    def reduce(self) -> None:
        for params, pg in self.groups:
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in params)
            if pg is not None:
                dist.all_reduce(total, group=pg)
            for p in params:
                p.grad = total.clone() if len(params) > 1 else total
