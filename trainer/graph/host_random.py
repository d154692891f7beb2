"""Randomness a captured graph cannot hold: Python's `random`, NumPy's, and `torch.manual_seed`,
called inside forward while the capture runs it.

The capture runs forward once. A draw from Python's or NumPy's generator there is a plain
number by the time the graph exists: fixed into the model for every step, and, unseeded,
different in every worker (a layer dropped on one replica and not on another trains different
models, and a data-parallel group then fails in a collective that names nothing of it). A
`torch.manual_seed` in forward does nothing once captured: the graph's random ops draw by
(seed, step, example, op) ([Note: randomness belongs to the sample]). `watching_host_random`
records each such call with the line of the user's code that made it, for the capture's warning.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import traceback
from collections.abc import Callable, Iterator

import torch

__all__ = ["watching_host_random", "user_line", "innermost_user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTHON = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
           "normalvariate", "betavariate", "expovariate", "triangular")
_NUMPY = ("rand", "randn", "random", "random_sample", "randint", "uniform", "normal", "choice", "shuffle",
          "permutation", "binomial", "poisson", "beta")


def innermost_user_frame(frames: list[traceback.FrameSummary]) -> str:
    """file:line and code of the innermost of `frames` in the user's code (not torch's, not this
    package's, not the random module's), or ""."""
    for f in reversed(frames):
        if not f.filename.startswith((_TORCH_DIR, _HERE, "<")) and "/random.py" not in f.filename:
            return f"{f.filename}:{f.lineno} `{(f.line or '').strip()}`"
    return ""


def user_line() -> str:
    """file:line of the innermost frame of the user's code on the stack, or ""."""
    return innermost_user_frame(traceback.extract_stack()[:-2])


@contextlib.contextmanager
def watching_host_random(found: list[str]) -> Iterator[None]:
    """Within the block, append "<function> at <file:line>" to `found` for each call of a
    generator the capture cannot key; the functions work as before."""
    patched: list[tuple[object, str, Callable]] = []

    def watch(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if not callable(original):
            return

        def watched(*args, **kwargs):
            found.append(f"{label} at {user_line() or 'an unknown place'}")
            return original(*args, **kwargs)

        setattr(owner, name, watched)
        patched.append((owner, name, original))

    for name in _PYTHON:
        watch(random, name, f"random.{name}")
    numpy = sys.modules.get("numpy")   # only if the script uses it: importing it here costs time
    if numpy is not None:
        for name in _NUMPY:
            watch(numpy.random, name, f"numpy.random.{name}")
    watch(torch, "manual_seed", "torch.manual_seed")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
