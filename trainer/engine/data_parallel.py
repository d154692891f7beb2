"""Gradient reduction across replicas and across the stages that share a tied weight.

The loss is normalised by the global batch size, so gradients are summed, never averaged:
any P x D then computes the same update ([Note: the global batch defines the math] in ARCHITECTURE.md).

Every parameter has exactly one way through the reduction, decided once when the reducer is
built. Untied parameters go through flat buckets whose all-reduce starts while the last
backward is still running. A tied set (tensors that are one tensor in the math: one Parameter
used by several stages, or the Parameters named in `shared_weights`) never enters a bucket:
after the backward its local copies are summed into one gradient, the sum is all-reduced once
over every replica of every stage holding a copy, and each copy gets it. A bucket copies
`.grad` when it starts and writes its result over `.grad` when it ends; were a tied copy in
one, a sum of the copies made in between would be lost, and whether it is depends on when the
autograd hooks fire. Keeping the two sets apart makes that impossible for any hook order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradReducer"]

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


def _wait(work, on_gpu: bool) -> None:
    """`work.wait()`, entered (for gloo) only once the collective is over. A wait inside the C++
    call could not be interrupted: a peer that vanished without a reset would hold this thread
    until the process group's timeout, and the daemon's rescue signal (trainer.engine.control)
    with it. NCCL's wait only orders the streams; polling it would make the CPU wait for the GPU."""
    pause = 20e-6
    while not on_gpu and not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    work.wait()   # raises the collective's error, if it failed


def _unique(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


class GradReducer:
    """Sum-all-reduce of one stage's gradients: over its D replicas, and for each tied set
    over every rank holding a copy of it.

    `params` are the stage's parameters; `tied` lists, per tied set this stage holds a copy
    of, its local copies and the process group of every rank holding one (None when this rank
    is the only one: the copies are only summed). Tied copies are taken out of `params`.

    `arm()` before the step's last backward: each bucket's all-reduce starts (asynchronously:
    gloo and NCCL run it on their own threads) as soon as the last of its gradients has been
    accumulated, overlapping the rest of that backward. `launch()` starts the buckets that
    have not started and the tied sums; `wait()` finishes them all and writes the sums back
    into `.grad`.
    """

    def __init__(self, params: Sequence[nn.Parameter], group, world: int, bucket_bytes: int = _BUCKET_BYTES,
                 *, tied: Sequence[tuple[Sequence[nn.Parameter], object | None]] = ()):
        self.group, self.world = group, world
        self.tied: list[tuple[list[nn.Parameter], object | None]] = []
        tied_ids: set[int] = set()
        for copies, pg in tied:
            copies = _unique(copies)
            if not copies:
                continue
            if any(id(p) in tied_ids for p in copies):
                raise ValueError("a parameter is in two tied sets; tied sets that share a tensor are one set")
            tied_ids.update(id(p) for p in copies)
            self.tied.append((copies, pg))
        self._untied = [p for p in _unique(params) if id(p) not in tied_ids]
        self._bucket_bytes = bucket_bytes
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, object]] = []
        self._pending_tied: list[tuple[list[nn.Parameter], torch.Tensor, object | None]] = []
        self._hooked: set[int] = set()
        self._trainable: tuple[bool, ...] | None = None
        self._armed = False
        self._build()

    def _build(self) -> None:
        """Buckets of the parameters that train now. A frozen one (requires_grad=False: partial
        fine-tuning) has no gradient to sum and can carry no hook; one the script unfreezes later
        joins the buckets at the next `arm()`."""
        self._trainable = tuple(p.requires_grad for p in self._untied)
        trainable = [p for p in self._untied if p.requires_grad]
        self.buckets = _buckets(trainable, self._bucket_bytes) if self.world > 1 else []
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        for bucket in self.buckets:
            for p in bucket:
                if id(p) not in self._hooked:
                    self._hooked.add(id(p))
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        if self._trainable != tuple(p.requires_grad for p in self._untied):
            self._build()
        self._armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        i = self._bucket_of.get(id(p)) if self._armed else None
        if i is None:   # not armed, or frozen since its hook was registered
            return
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._start(i)

    def _start(self, i: int) -> None:
        self._started[i] = True
        bucket = self.buckets[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # The flat copy is the gradient now (wait() gives each parameter its view of it): holding
        # the old `.grad`s until then would keep the stage's gradients twice, which the planner's
        # estimate does not count; this way the reducer adds at most one bucket.
        for p in bucket:
            p.grad = None
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((bucket, flat, work))

    def launch(self) -> None:
        for i in range(len(self.buckets)):
            if not self._started[i]:
                self._start(i)
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        # The backward is over: every copy's gradient is final, so the sum is the whole one.
        # A fresh tensor, so the copies' own `.grad`s are never aliased by the all-reduce.
        for copies, pg in self.tied:
            if not any(p.requires_grad for p in copies):
                # frozen (on every rank alike): no gradient, not a zero one, which weight decay
                # would still apply
                continue
            total = torch.zeros_like(copies[0])
            for p in copies:
                if p.grad is not None:
                    total.add_(p.grad)
            work = dist.all_reduce(total, group=pg, async_op=True) if pg is not None else None
            self._pending_tied.append((copies, total, work))

    def wait(self) -> None:
        for bucket, flat, work in self._pending:
            _wait(work, flat.is_cuda)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p)
                offset += n
        self._pending.clear()
        for copies, total, work in self._pending_tied:
            if work is not None:
                _wait(work, total.is_cuda)
            # a tensor of its own per copy: in-place scaling (unscale, clipping) of one copy's
            # `.grad` must not scale another's a second time
            for i, p in enumerate(copies):
                p.grad = total if i == 0 else total.clone()
        self._pending_tied.clear()

    def reduce(self) -> None:
        self.launch()
        self.wait()

    def release(self) -> None:
        """Drop the process groups (after they were destroyed): the hooks keep this object alive."""
        self.group, self.buckets, self._bucket_of, self.tied = None, [], {}, []
        self._untied, self._trainable = [], ()
