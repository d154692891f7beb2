"""A stage's module for evaluation: what `model.eval()` would run.

The captured graph is the training graph: torch.export bakes a module's train/eval mode into the
ops, so a BatchNorm in it normalises with the micro-batch's statistics and updates the running
ones. An evaluation runs a copy of the stage's graph in which every norm op reads its running
statistics instead (its `training` argument false) and nothing writes a buffer. Dropout needs no
copy: its keyed ops read the executor's `training` flag ([Note: randomness belongs to the sample]).

The copy shares the stage's tensors; the executor builds it again when the stage's tensor
objects change (a weight load may replace them).
"""

from __future__ import annotations

from torch import fx, nn

from trainer.graph.written import norm_in_training, writes

__all__ = ["evaluation_module"]


def evaluation_module(module: nn.Module) -> nn.Module:
    """`module` itself where its graph has nothing that evaluates differently; else the copy."""
    if not isinstance(module, fx.GraphModule):
        return module
    if not any(norm_in_training(n) or _updates_a_buffer(n) for n in module.graph.nodes):
        return module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        if _updates_a_buffer(node):
            continue   # a count, a write-back of new statistics: not in an evaluation
        copy = graph.node_copy(node, lambda n: env[n])
        if norm_in_training(node):
            copy.args = (*copy.args[:5], False, *copy.args[6:])
        env[node] = copy
    graph.eliminate_dead_code()
    return fx.GraphModule(module, graph, class_name=f"{type(module).__name__}Eval")


def _updates_a_buffer(node: fx.Node) -> bool:
    """An in-place write into buffers that nothing reads the result of (an activation's in-place
    op, a relu_, is the computation itself and stays)."""
    dests = writes(node)
    return bool(dests) and not node.users and not norm_in_training(node) and all(d.op == "get_attr" for d in dests)
