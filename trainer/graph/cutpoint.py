"""CutPoint: where a model may be split between two pipeline stages, and the marker op it
becomes in a captured graph."""

from __future__ import annotations

import threading

import torch
from torch import fx, nn

from trainer.errors import PartitionError

__all__ = ["CutPoint", "cut_marker", "is_marker", "marker_name", "capturing"]


@torch.library.custom_op("varuna::cut", mutates_args=())
def cut_marker(x: torch.Tensor, name: str) -> torch.Tensor:
    """Identity that torch.export keeps as one node: in a captured graph it marks CutPoint `name`
    (or an automatic cut after a block). The split replaces it, so this copy only runs while a
    whole graph is timed (`partition.dry_run`); a custom op may not return its input."""
    return x.clone()


@cut_marker.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _cut_backward(ctx, grad: torch.Tensor):
    return grad, None


cut_marker.register_autograd(_cut_backward)


def is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.varuna.cut.default


def marker_name(node: fx.Node) -> str:
    return node.args[1] if len(node.args) > 1 else node.kwargs["name"]


class _Capture(threading.local):
    """Names of the CutPoints met in the forward being captured (None outside a capture)."""

    seen: set[str] | None = None


_capture = _Capture()


class capturing:
    """While a model is being captured, CutPoints emit the marker op; otherwise they are free."""

    def __enter__(self) -> "capturing":
        _capture.seen = set()
        return self

    def __exit__(self, *exc) -> None:
        _capture.seen = None


class CutPoint(nn.Module):
    """Marks a potential stage boundary.

    Identity in eager mode. When the partitioner captures the model, every CutPoint becomes a
    `cut_marker` node; the active ones split the graph into stages. Its input must be one
    tensor whose first dimension is the batch, and each instance is called once per forward:
    the tensor that crosses the boundary is the only value one stage hands to the next.
    """

    _varuna_name = ""   # set to its path in the model by the capture

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise PartitionError(
                f"a CutPoint received {type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of 0 dims'}",
                hint="pass it one tensor whose first dimension is the batch",
            )
        seen = _capture.seen
        if seen is None:
            return x
        name = self._varuna_name
        if name in seen:
            raise PartitionError(
                f"CutPoint '{name}' is called twice in one forward",
                hint="give every boundary its own CutPoint instance",
            )
        seen.add(name)
        return cut_marker(x, name)
