"""Optimizer-step timing: what the engine's STEP costs for each segment's parameters, and the
optimizer state it keeps, with the script's optimizer or a stand-in (AdamW)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from trainer.engine.precision import squared_norms
from trainer.profiler.common import _median, _nbytes, _sync

__all__ = ["OptimizerFactory", "measure_steps"]


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


def measure_steps(groups: Sequence[Sequence[nn.Parameter]], factory: OptimizerFactory | None, *,
                  optimizer_factor: float = 2.0, repeats: int = 5, warmup: int = 2,
                  device: torch.device | str = "cpu") -> list[tuple[float, int]]:
    """(step seconds, optimizer-state bytes) per parameter group, on copies of the parameters
    with random gradients. Without a factory, AdamW's step is timed and the state is
    `optimizer_factor` x the parameter bytes. On CPU the groups' repeats are interleaved (like
    `measure_segments`), which holds every group's copies at once; on a GPU one group at a time."""
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

    def result(group, opt, times) -> tuple[float, int]:
        if opt is None:
            return 0.0, 0
        if given:   # measured, 0 included: plain SGD keeps no state
            return _median(times), _state_bytes(opt)
        return _median(times), int(round(optimizer_factor * sum(_nbytes(p) for p in group)))

    if device.type == "cpu":
        states = [setup(g) for g in groups]
        times: list[list[float]] = [[] for _ in groups]
        for r in range(warmup + repeats):
            for i, (copies, opt) in enumerate(states):
                if opt is not None:
                    t = timed(copies, opt)
                    if r >= warmup:
                        times[i].append(t)
        return [result(g, opt, ts) for g, (_, opt), ts in zip(groups, states, times)]
    out = []
    for group in groups:
        copies, opt = setup(group)
        ts = [timed(copies, opt) for _ in range(warmup + repeats)][warmup:] if opt is not None else []
        out.append(result(group, opt, ts))
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
