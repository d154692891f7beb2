"""What a calibration is of: the model's fingerprint, the device kind, and the file it is saved in."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import fx, nn

from trainer.errors import ConfigError
from trainer.graph.partition import TracedModel, capture_model

__all__ = ["model_fingerprint", "device_kind_of", "calibration_path"]


def _target_name(node: fx.Node) -> str:
    fn = node.target
    if node.op == "call_function" and hasattr(fn, "__qualname__") and not isinstance(fn, torch._ops.OperatorBase):
        return f"{getattr(fn, '__module__', '')}.{fn.__qualname__}"   # operator.getitem and the like
    return str(fn)   # aten ops print as 'aten.linear.default'; no address in either


def model_fingerprint(model: nn.Module, *, traced: TracedModel | None = None,
                      sample: Mapping[str, torch.Tensor] | None = None, precision: str = "fp32") -> str:
    """A stable hex digest of what decides the model's costs: the names, shapes and dtypes of its
    parameters and buffers, its captured graph's op sequence (aten ops with their constant
    arguments, so layer settings such as a dropout rate count), its cut points and the
    precision. Weights' values do not count. Give the captured model, or a sample batch to
    capture it with."""
    if traced is None:
        if sample is None:
            raise ConfigError("model_fingerprint needs the captured model or a sample batch to capture it with")
        traced = capture_model(model, sample)
    h = hashlib.sha256()
    h.update(f"precision={precision}\n".encode())
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    gm = traced.graph_module
    for node in gm.graph.nodes:
        consts = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (int, float, str, bool, type(None)))]
        h.update(f"{node.op}|{_target_name(node)}|{consts}\n".encode())
    h.update(("markers=" + ",".join(traced.marker_names)).encode())
    return h.hexdigest()[:32]


def device_kind_of(device: torch.device, slots: int = 1) -> str:
    """The CUDA device's name (e.g. 'NVIDIA H200'), or 'cpu' for a host running one CPU worker
    and 'cpu-<n>slots' for a CPU slot of a host running n workers at once (they share its cores'
    time, caches and memory bandwidth, so a slot is slower than a lone worker)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type if slots <= 1 else f"{device.type}-{slots}slots"


def calibration_path(out_folder: str | os.PathLike[str], fingerprint: str, device_kind: str) -> Path:
    kind = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind)
    return Path(out_folder) / f"calibration-{fingerprint}-{kind}.json"
