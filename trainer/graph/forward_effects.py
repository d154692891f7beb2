"""What forward does that a captured graph does not keep, found while the capture runs it.

* A custom `torch.autograd.Function`: torch.export traces its forward, and the graph is then
  differentiated as that forward is, so its own backward never runs. Where that backward is the
  forward's gradient (a fused op) nothing changes; where it is not (a straight-through
  estimator, gradient reversal or scaling) the model trains differently at every layout, 1 x 1
  included, without an error. `torch.library.custom_op` with `register_autograd` keeps it.
* A Python attribute forward changes (`self.calls += 1` for an annealed temperature): the
  capture runs forward once, so the graph holds the value of that one call for good.
* A buffer forward replaces (`self.ema = 0.9 * self.ema + ...`) rather than updates in place
  (`self.ema.mul_(0.9).add_(...)`): the replacement never reaches the module's buffer.

`watching_forward` records each of these, with the line of the user's code where it can, for
the capture's warning. Torch's own Functions are left out: their backward is their forward's
gradient. The reentrant checkpoint's is refused: it runs its function under no_grad, so the
captured graph holds those layers without gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.graph.host_random import user_line

__all__ = ["watching_forward"]

_PLAIN = (bool, int, float, str)
_REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction


def _state(model: nn.Module) -> dict[tuple[str, str], object]:
    """(module path, attribute) -> a plain value, or the identity of a buffer."""
    out: dict[tuple[str, str], object] = {}
    for path, m in model.named_modules():
        for k, v in vars(m).items():
            if not k.startswith("_") and type(v) in _PLAIN:
                out[path, k] = v
        for k, b in m._buffers.items():
            if b is not None:
                out[path, k] = ("buffer", id(b))
    return out


@contextlib.contextmanager
def watching_forward(model: nn.Module, found: list[str]) -> Iterator[None]:
    """Within the block, record in `found` each custom autograd.Function forward applies and,
    at its end, each attribute or buffer of `model` that the block changed or replaced."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls is _REENTRANT_CHECKPOINT:
            raise ConfigError(
                f"torch.utils.checkpoint with use_reentrant=True at {user_line() or 'an unknown place'}: it runs its "
                "function without gradients and differentiates it again in backward, which a captured graph "
                "cannot do (the checkpointed layers would get no gradient)",
                hint="pass use_reentrant=False to torch.utils.checkpoint (Hugging Face: "
                     "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), "
                     "or drop it: Varuna already recomputes each stage's activations in backward")
        if not cls.__module__.startswith(("torch.", "trainer.")):
            found.append(f"the custom autograd.Function {cls.__qualname__} at {user_line() or 'an unknown place'}: "
                         "the capture differentiates its forward, so its own backward never runs")
        return original.__func__(cls, *args, **kwargs)

    # compared inside the call: export puts the module's attributes back once it has traced it
    seen: dict[str, dict] = {}

    def note(when: str) -> None:   # a hook returns None: anything else would replace forward's arguments
        seen.setdefault(when, _state(model))

    hooks = [model.register_forward_pre_hook(lambda m, a: note("before")),
             model.register_forward_hook(lambda m, a, out: note("after"))]
    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original
        for h in hooks:
            h.remove()
    before, after = seen.get("before", {}), seen.get("after", {})
    for (path, name), value in before.items():
        now = after.get((path, name), value)
        where = f"{path}.{name}" if path else name
        if isinstance(value, tuple) and now != value:
            found.append(f"forward replaces the buffer {where} with a new tensor: the captured model never "
                         "updates it (update it in place: .mul_(), .add_(), .copy_())")
        elif not isinstance(value, tuple) and now != value:
            found.append(f"forward changes {where} ({value!r} -> {now!r}): the capture runs forward once, so the "
                         "captured model keeps the value of that one call for good")
