"""The buffers a captured module writes in place when it runs: BatchNorm's running statistics and
its count of batches, or any buffer a model updates in its forward.

Running a forward twice for one micro-batch (a recompute before its backward; an evaluation that
must not change the model) would apply such a write twice. The executor saves these buffers
around that second run, so that training keeps exactly the writes an eager loop makes, once per
micro-batch, and an evaluation none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn

__all__ = ["written_buffers", "writes", "writes_input", "region_writes", "norm_in_training", "batch_statistics", "BufferSnapshot"]


# Norm ops that update their running statistics (arguments 3 and 4) in place when argument 5
# (`training`, or instance norm's `use_input_stats`) is true, whether or not their schema says so:
# `aten.batch_norm`, what torch.export keeps of nn.BatchNorm in a training graph, does not.
_NORM_OPS = ("batch_norm", "instance_norm")
_NORM_FLAGS = ("training", "use_input_stats")


def norm_in_training(node: fx.Node) -> bool:
    """Whether `node` is a norm op that normalises with the batch's statistics and updates its
    running ones."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return (any(op in schema.name for op in _NORM_OPS) and len(schema.arguments) > 5
            and schema.arguments[5].name in _NORM_FLAGS and len(node.args) > 5 and node.args[5] is True)


def batch_statistics(gm: fx.GraphModule) -> int:
    """How many norms of `gm` normalise with the statistics of the batch they are given (BatchNorm
    in training; instance norm's are each example's own): the model they train depends on the
    micro-batch size."""
    return sum(norm_in_training(n) and "batch_norm" in n.target._schema.name for n in gm.graph.nodes)


def writes(node: fx.Node) -> list[fx.Node]:
    """The arguments of `node` that its op's schema marks as written."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def _is_view(node: fx.Node) -> bool:
    """Whether `node`'s result shares its first argument's storage without writing it (a slice,
    a view, a transpose)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    out = schema.returns[0].alias_info if schema.returns else None
    return first is not None and not first.is_write and out is not None


def writes_input(gm: fx.GraphModule, name: str) -> bool:
    """Whether `gm` writes its input `name` in place, or a view of it (`h.mul_(2)`, `h[:, 0] += 1`
    on what a stage receives), or hands it to a region export keeps as one op (which may)."""
    start = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name), None)
    if start is None:
        return False
    aliases, todo = {start}, [start]
    while todo:
        for user in todo.pop().users:
            if isinstance(user.target, torch._ops.HigherOrderOperator) or any(a in aliases for a in writes(user)):
                return True
            if _is_view(user) and user.args[0] in aliases and user not in aliases:
                aliases.add(user)
                todo.append(user)
    return False


def region_writes(node: fx.Node) -> list[fx.Node]:
    """The operands that a region export keeps as one op (`torch.no_grad()` in forward becomes a
    `wrap_with_set_grad_enabled` of a subgraph) writes in place: an EMA or a counter a model
    updates under no_grad. Unseen, such an update was dropped from every stage (nothing reads
    its result) or applied again by a recompute (an outside probe)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    owner = node.graph.owning_module
    at = next((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
               and isinstance(_attr(owner, a.target), fx.GraphModule)), None)
    if at is None:
        return []
    sub = _attr(owner, node.args[at].target)
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return [arg for arg, ph in zip(node.args[at + 1:], inputs) if isinstance(arg, fx.Node)
            and writes_input(sub, ph.target)]


def _attr(owner: object, target: str) -> object:
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _written(node: fx.Node) -> list[fx.Node]:
    running = [a for a in node.args[3:5] if isinstance(a, fx.Node)] if norm_in_training(node) else []
    return running + [a for a in writes(node) + region_writes(node) if a not in running]


def written_buffers(module: nn.Module) -> tuple[str, ...]:
    """Names (attribute paths in `module`) of the buffers its graph writes; () for a module that is
    not a graph (nothing known, nothing saved)."""
    if not isinstance(module, fx.GraphModule):
        return ()
    names: list[str] = []
    for node in module.graph.nodes:
        for dest in _written(node):
            if dest.op == "get_attr" and dest.target not in names:
                names.append(dest.target)
    return tuple(names)


class BufferSnapshot:
    """Copies of some of a module's buffers, to put back later. Looked up by name each time:
    loading weights may replace a module's tensor objects."""

    def __init__(self, module: nn.Module, names: tuple[str, ...]) -> None:
        self._module, self._names = module, names
        with torch.no_grad():
            self._saved = [self._get(n).clone() for n in names]

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        owner, _, leaf = name.rpartition(".")
        return (self._module.get_submodule(owner) if owner else self._module), leaf

    def _get(self, name: str) -> torch.Tensor:
        return getattr(*self._owner(name))

    def restore(self) -> None:
        """Write the saved values back into the module's buffers (outside any autograd graph)."""
        with torch.no_grad():
            for name, value in zip(self._names, self._saved):
                self._get(name).copy_(value)

    @contextlib.contextmanager
    def in_place_of_current(self) -> Iterator[None]:
        """Run with the saved copies as the module's buffers, then put the module's own tensors
        back, untouched. Not a copy in and out: a backward may have saved the buffers the run
        reads (BatchNorm's does), and writing into those would fail its version check."""
        current = [self._owner(n) + (self._get(n),) for n in self._names]
        for (owner, leaf, _), saved in zip(current, self._saved):
            setattr(owner, leaf, saved)
        try:
            yield
        finally:
            for owner, leaf, tensor in current:
                setattr(owner, leaf, tensor)
