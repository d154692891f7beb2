"""Mixed precision: autocast contexts and the dynamic loss scaler for fp16."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

from trainer.errors import ConfigError

__all__ = ["Precision", "LossScaler", "autocast", "squared_norms"]

Precision = Literal["fp32", "fp16", "bf16"]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(precision: Precision, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling (halve on overflow, double after `growth_interval` clean steps),
    or a fixed scale. The overflow decision itself is agreed across all workers by the caller."""

    def __init__(self, loss_scale: float | str = "dynamic", init_scale: float = 2.0**20,
                 min_scale: float = 1.0, growth_interval: int = 1000) -> None:
        if loss_scale != "dynamic" and not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ConfigError(f"loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}")
        if min_scale <= 0 or init_scale < min_scale:
            raise ConfigError(f"need 0 < min_loss_scale <= init_loss_scale, got {min_scale}, {init_scale}")
        self.dynamic = loss_scale == "dynamic"
        self.scale = float(init_scale if self.dynamic else loss_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


def squared_norms(grads: list[torch.Tensor]) -> list[float]:
    """Each gradient's squared L2 norm, with one fused kernel for all of them: the overflow check
    of the loss scaler and gradient clipping both start from these. Each tensor's norm is taken
    in float32, as torch's clip_grad_norm_ takes it (a half-precision norm would overflow at
    65504; one past float32's 3.4e38, a norm over 1.8e19 squared, reads as an overflow, as it
    would there), then squared in float64, where the caller sums them. Accumulating in float64
    took 20x as long on a CPU, a tenth of a pipeline stage's step. A float64 gradient keeps its
    own precision."""
    if not grads:
        return []
    wide = any(g.dtype == torch.float64 for g in grads)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64 if wide else torch.float32)
    return torch.stack(norms).double().pow(2).tolist()
