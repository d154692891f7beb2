"""Random numbers keyed by what they act on, not by the process that draws them
([Note: randomness belongs to the sample]).

A draw is a pure function of (seed, step, the example's index in the global batch, the random
op's position in the captured graph, the element's index within the example): the same bits
whatever P x D, micro-batch size, stage cut, recompute or resume produced the call. A
micro-batch holding examples a..b gets the rows of a..b, each computed on its own.

The generator is a counter-based hash in vectorised integer tensor arithmetic: 32-bit words
held in int64 tensors, multiplied only by constants below 2**31 so that no product leaves the
int64 range (the result is then defined, and the same on every device, without relying on
wrap-around). The scalar part of the key (seed, step, op, stream) is mixed once in Python with
splitmix64; each example's index and each element's index are hashed apart and combined by a
final full-size hash, so a draw costs about a dozen integer passes over its output.

Uniforms carry 24 bits (exact in float32, the same bits on CPU and CUDA), dropout masks 16
(a word decides two elements: half the hashing); normals are
Box-Muller over two independent streams and agree across devices to the rounding of their
log/cos. `keyed_randomness` sets the key for the code it wraps: the engine enters it around
every forward and recompute of a micro-batch; a plain loop enters it to reproduce the run.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Draws", "UNKEYED", "keyed_randomness", "drawing", "current_draws", "keyed_words", "keyed_uniform", "keyed_normal",
           "keyed_keep"]

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_U24 = 1.0 / (1 << 24)
# Odd multipliers below 2**31 (a 32-bit word times one stays below 2**63).
_C1, _C2 = 0x7FEB352D, 0x31848BAB
# Normals take two uniform streams, masks one of their own; a draw outside any example (an op
# without a batch dimension) has its own stream, so it never equals example 0's row.
_STREAMS = 4
_NO_EXAMPLE = 2
_KEEP = 3


@dataclass(frozen=True)
class Draws:
    """The key of the draws made while it is current: the job's seed, the step, the global
    index of the micro-batch's first example, and whether the forward trains (dropout is the
    identity when it does not; other random ops draw either way). `examples`, the micro-batch's
    number of examples, tells an op that draws for each token of a flattened batch, (B*T, C)
    with T varying from batch to batch, how many rows each example has; None where unknown."""

    seed: int = 0
    step: int = 0
    example_offset: int = 0
    training: bool = True
    examples: int | None = None

    def __post_init__(self) -> None:
        for name in ("seed", "step", "example_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Draws.{name} must be an int, got {type(value).__name__}")
        if not 0 <= self.seed <= _M64:
            raise ValueError(f"Draws.seed must be in 0..2**64-1, got {self.seed}")
        if self.step < 0:
            raise ValueError(f"Draws.step must be >= 0, got {self.step}")
        if not 0 <= self.example_offset <= _M32:
            raise ValueError(f"Draws.example_offset must be in 0..2**32-1, got {self.example_offset}")
        if self.examples is not None and (isinstance(self.examples, bool) or not isinstance(self.examples, int)
                                          or self.examples < 1):
            raise ValueError(f"Draws.examples must be a positive int or None, got {self.examples!r}")


UNKEYED = Draws()   # in force outside any `drawing`: draws that nothing reproduces (a calibration's)
_CURRENT: contextvars.ContextVar[Draws] = contextvars.ContextVar("varuna_draws", default=UNKEYED)


def current_draws() -> Draws:
    """The key in force; outside any `keyed_randomness`, seed 0, step 0, examples from 0."""
    return _CURRENT.get()


@contextmanager
def drawing(draws: Draws) -> Iterator[Draws]:
    """Make `draws` the key of the random ops run inside."""
    token = _CURRENT.set(draws)
    try:
        yield draws
    finally:
        _CURRENT.reset(token)


def keyed_randomness(seed: int = 0, step: int = 0, example_offset: int = 0, *,
                     training: bool = True, examples: int | None = None):
    """Key the random ops of captured models run inside by (seed, step, example): the micro-batch
    run inside holds the examples example_offset, example_offset + 1, ... of step `step`'s
    global batch (`examples` of them: needed by a model that drops out a flattened batch of
    tokens whose length varies). A context manager:

        with keyed_randomness(seed, step, example_offset=start, examples=len(micro_batch)):
            loss = keyed(**micro_batch)
    """
    return drawing(Draws(seed, step, example_offset, training, examples))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _scalar_key(draws: Draws, op: int, stream: int) -> tuple[int, int]:
    k = _splitmix64(draws.seed)
    for part in (draws.step, op * _STREAMS + stream):
        k = _splitmix64(k ^ part)
    return k & _M32, k >> 32


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 `x` (words in 0..2**32-1), in place."""
    x.bitwise_xor_(x >> 16).mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_C2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _combine(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The full-size hash of every (row, column) pair of two hashed vectors. Their XOR alone
    would keep two rows' difference the same in every column; two multiply-xorshift rounds
    break that. The shifts write into one scratch tensor: a fresh tensor per operation costs
    more than the arithmetic (page faults on every large allocation)."""
    h = torch.bitwise_xor(rows.unsqueeze(1), cols)
    scratch = torch.empty_like(h)
    for c, shift in ((_C1, 16), (_C2, 15)):
        h.mul_(c).bitwise_and_(_M32)
        h.bitwise_xor_(torch.bitwise_right_shift(h, shift, out=scratch))
    return h


def _key(draws: Draws, op: int, stream: int, examples: int | None, per_example: int) -> tuple[int, int, int]:
    """(k0, k1, the first row's example index) of a draw, its sizes checked."""
    if per_example > _M32:
        raise ValueError(f"a random op draws {per_example} elements per example; at most 2**32 are keyed")
    if examples is None:
        return (*_scalar_key(draws, op, _NO_EXAMPLE), 0)
    if draws.example_offset + examples > _M32 + 1:
        raise ValueError(f"examples {draws.example_offset}..{draws.example_offset + examples - 1}: "
                         "global example indices are keyed up to 2**32-1")
    return (*_scalar_key(draws, op, stream), draws.example_offset)


def keyed_words(op: int, stream: int, examples: int | None, per_example: int,
                device: torch.device | str, draws: Draws | None = None) -> torch.Tensor:
    """(examples, per_example) int64 words in 0..2**32-1: row i for the example at global index
    draws.example_offset + i, column j for element j of it. `examples=None` draws one row keyed
    by the op alone (the same for every micro-batch)."""
    k0, k1, first = _key(draws or current_draws(), op, stream, examples, per_example)
    rows = torch.arange(first, first + (examples or 1), dtype=torch.int64, device=device)
    rows = _mix_(rows.bitwise_xor_(k0))
    cols = _mix_(torch.arange(per_example, dtype=torch.int64, device=device).add_(k1).bitwise_and_(_M32))
    return _combine(rows, cols)


def _shaped(words: torch.Tensor, shape: Sequence[int], batch_dim: int | None) -> torch.Tensor:
    if batch_dim is None or batch_dim == 0:
        return words.view(tuple(shape))
    moved = (shape[batch_dim], *shape[:batch_dim], *shape[batch_dim + 1:])
    return words.view(moved).movedim(0, batch_dim)


def _layout(shape: Sequence[int], batch_dim: int | None, rows_per_example: int) -> tuple[int | None, int]:
    numel = math.prod(shape)
    if batch_dim is None:
        return None, numel
    rows = shape[batch_dim]
    if rows % rows_per_example:
        raise ValueError(f"a random op's batch dimension {batch_dim} has {rows} rows, not a multiple of "
                         f"the {rows_per_example} rows per example it was captured with")
    examples = rows // rows_per_example
    return examples, (numel // examples if examples else 0)


def _words(op: int, stream: int, shape: Sequence[int], batch_dim: int | None, rows_per_example: int,
           device) -> torch.Tensor:
    examples, per_example = _layout(shape, batch_dim, rows_per_example)
    if examples == 0 or per_example == 0:
        return torch.zeros(tuple(shape), dtype=torch.int64, device=device)
    return _shaped(keyed_words(op, stream, examples, per_example, device), shape, batch_dim)


def keyed_uniform(op: int, shape: Sequence[int], *, batch_dim: int | None = 0, rows_per_example: int = 1,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  stream: int = 0) -> torch.Tensor:
    """Uniform floats in [0, 1) on a 2**-24 grid, keyed by the current `Draws`: along
    `batch_dim` every `rows_per_example` rows belong to one example of the micro-batch;
    `batch_dim=None` keys by the op alone."""
    words = _words(op, stream, shape, batch_dim, rows_per_example, device)
    return words.bitwise_right_shift_(8).to(dtype).mul_(_U24)


def keyed_normal(op: int, shape: Sequence[int], *, batch_dim: int | None = 0, rows_per_example: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normals (Box-Muller over streams 0 and 1), keyed as `keyed_uniform`."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = _words(op, 0, shape, batch_dim, rows_per_example, device).bitwise_right_shift_(8).add_(1).to(wide)
    u2 = _words(op, 1, shape, batch_dim, rows_per_example, device).bitwise_right_shift_(8).to(wide)
    u1.mul_(_U24)
    u2.mul_(_U24 * 2 * math.pi)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).to(dtype)


def keyed_keep(op: int, shape: Sequence[int], p: float, *, batch_dim: int | None = 0,
               rows_per_example: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bool mask, True with probability 1 - p (to 2**-16), keyed as `keyed_uniform`.

    Each 32-bit word decides two elements (its low and high halves): half the hashing, which is
    most of a mask's cost."""
    examples, per_example = _layout(shape, batch_dim, rows_per_example)
    if examples == 0 or per_example == 0:
        return torch.ones(tuple(shape), dtype=torch.bool, device=device)
    words = keyed_words(op, _KEEP, examples, (per_example + 1) // 2, device)
    threshold = min(int(round(p * (1 << 16))), 1 << 16)
    high = words >> 16
    keep = torch.stack((words.bitwise_and_(0xFFFF) >= threshold, high >= threshold), dim=-1)
    keep = keep.view(1 if examples is None else examples, -1)
    if keep.shape[1] != per_example:
        keep = keep[:, :per_example].contiguous()
    return _shaped(keep, shape, batch_dim)
