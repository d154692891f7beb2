"""Optimizer-step timing: what the engine's STEP costs for each segment's parameters, the
optimizer state it keeps and the temporaries it allocates and frees on the way (step_bytes), with
the script's optimizer or a stand-in (AdamW)."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.engine.precision import squared_norms
from trainer.profiler.common import _median, _nbytes, _sync

__all__ = ["OptimizerFactory", "measure_steps", "step_bytes_add"]


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _engine_step(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """What the engine's STEP does for these parameters besides its all-reduces: the squared
    gradient norms (the engine's own function, so the two cannot drift apart), the finiteness
    check on their sum, then the optimizer's step."""
    math.isfinite(sum(squared_norms([p.grad for p in params if p.grad is not None])))
    optimizer.step()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                total += _nbytes(v)
    return total


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors made inside the mode that are still alive, and their peak: what a
    step allocates, counted tensor by tensor, whatever the allocator keeps of it once freed (glibc's
    heap, CUDA's cache) and without resetting the device's peak statistics, which the calibration
    run's own meter reads. An output whose storage an input already had (a view, an in-place op)
    is not new; a storage is freed when the last tensor seen holding it is."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._holders: dict[int, list[int]] = {}   # storage address -> [tensors alive, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            entry = self._holders.get(ptr)
            if entry is None:
                if not ptr or ptr in inputs:
                    continue
                entry = self._holders[ptr] = [0, t.untyped_storage().nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr: int) -> None:
        entry = self._holders[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._holders[ptr]
            self.live -= entry[1]


def _step_bytes(copies: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """The temporaries of one STEP (its state already made): the most it held at once beyond
    what it kept."""
    with _LiveBytes() as live:
        _engine_step(copies, optimizer)
    return max(0, live.peak - live.live)


def step_bytes_add(factory: OptimizerFactory | None, device: torch.device | str = "cpu",
                   side: int = 32) -> bool:
    """Whether this optimizer holds the temporaries of all its tensors at once (a foreach step:
    a stage's add up over its segments) or one tensor's at a time (a for-loop step: a stage's are
    its largest segment's): its step over two equal matrices against its step over one. An
    optimizer that cannot step such small matrices is taken to add them up: the larger estimate."""
    factory = factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    device = torch.device(device)

    def temporaries(n: int) -> int:
        ps = [torch.zeros(side, side, device=device, requires_grad=True) for _ in range(n)]
        for p in ps:
            p.grad = torch.full_like(p, 1e-3)
        opt = factory(ps)
        _engine_step(ps, opt)   # the state, made at the first step, is kept, not temporary
        return _step_bytes(ps, opt)

    try:
        one = temporaries(1)
        return one == 0 or temporaries(2) > 1.5 * one
    except Exception:   # the user's optimizer, whatever it raises on a probe
        return True


def measure_steps(groups: Sequence[Sequence[nn.Parameter]], factory: OptimizerFactory | None, *,
                  optimizer_factor: float = 2.0, repeats: int = 5, warmup: int = 2,
                  device: torch.device | str = "cpu") -> list[tuple[float, int, int]]:
    """(step seconds, optimizer-state bytes, step temporaries' bytes) per parameter group, on
    copies of the parameters with random gradients. Without a factory, AdamW's step is timed and
    the state is `optimizer_factor` x the parameter bytes. On CPU the groups' repeats are
    interleaved (like `measure_segments`), which holds every group's copies at once; on a GPU one
    group at a time. The temporaries are counted on one more step, after the timed ones."""
    device = torch.device(device)
    given = factory is not None
    factory = factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    gen = torch.Generator().manual_seed(0)

    def setup(group):
        copies = []
        for p in group:
            c = p.detach().clone().requires_grad_(True)
            c.grad = torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(1e-3).to(device, p.dtype)
            copies.append(c)
        return copies, factory(copies) if copies else None

    def timed(copies, opt) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _engine_step(copies, opt)
        _sync(device)
        return time.perf_counter() - t0

    def result(group, copies, opt, times) -> tuple[float, int, int]:
        if opt is None:
            return 0.0, 0, 0
        temporaries = _step_bytes(copies, opt)
        if given:   # measured, 0 included: plain SGD keeps no state
            return _median(times), _state_bytes(opt), temporaries
        return _median(times), int(round(optimizer_factor * sum(_nbytes(p) for p in group))), temporaries

    if device.type == "cpu":
        states = [setup(g) for g in groups]
        times: list[list[float]] = [[] for _ in groups]
        for r in range(warmup + repeats):
            for i, (copies, opt) in enumerate(states):
                if opt is not None:
                    t = timed(copies, opt)
                    if r >= warmup:
                        times[i].append(t)
        return [result(g, copies, opt, ts) for g, (copies, opt), ts in zip(groups, states, times)]
    out = []
    for group in groups:
        copies, opt = setup(group)
        ts = [timed(copies, opt) for _ in range(warmup + repeats)][warmup:] if opt is not None else []
        out.append(result(group, copies, opt, ts))
        del copies, opt
    return out


def _optimizer_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory building an optimizer of the same class and settings over other parameters."""
    cls, defaults = type(optimizer), dict(optimizer.defaults)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        try:
            return cls(params, **defaults)
        except TypeError:  # a constructor that does not take all of its defaults back
            return cls(params, lr=defaults.get("lr", 1e-3))

    return make
