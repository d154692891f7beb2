"""A stage's backward in two passes: the input's gradient now, the parameters' gradients later.

Zero-bubble schedules (trainer.planning.schedule, WEIGHT) send the gradient of a stage's input as
soon as it is known and compute the weight gradients in what would be a bubble. Autograd computes
only what the requested inputs need: a matrix product's node asked for its input's gradient
skips the product that gives its weight's. So `backward_input` runs the graph toward the stage's
input alone, retaining it, and records the gradient each "junction" node received: a node on the
way to the input that also leads to parameters. `backward_weight` later restarts autograd at
those junctions with those gradients, toward the parameters alone: a parameter used once is
reached through one junction, and each of its matrix products is computed once in all.

Parameters are grouped by the junctions they are reached from (two groups that share a junction
are one), and each group runs as its own pass: one pass toward every parameter would recompute
the whole chain of input gradients between junctions. Where one junction of a group leads to
another (a parameter used at several depths), a pre-hook hands the later one the gradient
recorded for it, so that nothing is counted twice; the input gradients between them are computed
again. Gradients accumulate into ``.grad`` through the parameters' own accumulators, so hooks on
them (the data-parallel reducer's) fire as after a whole backward.

What it costs beyond the products: autograd walks the whole graph below a pass's junctions
before it runs it, so the weight pass's fixed cost grows with the number of groups times the
stage's graph (measured in review: 17 ms against a whole backward's 3.4 ms for 24 layers of
width 16, where the products cost nothing). The calibration times the passes per segment, so a
stage of many segments is estimated low; on wide layers the products dominate.

Without a stage input that requires a gradient there is nothing to split: `backward_input`
leaves everything to `backward_weight`, which then runs the whole backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from trainer.engine.memory import storage_bytes

__all__ = ["WeightPass", "backward_input", "backward_weight"]


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    junctions: list[Node] = field(default_factory=list)
    grads: dict[Node, tuple] = field(default_factory=dict)


@dataclass
class WeightPass:
    """What `backward_input` leaves for `backward_weight`: the retained graph's way back in."""

    groups: list[_Group]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (output, its gradient): nothing was split

    def held_bytes(self) -> int:
        """Bytes of the gradients recorded for the weight pass (each storage once): what a split
        backward holds beyond the activations until its weight pass."""
        return storage_bytes(g for group in self.groups for grads in group.grads.values() for g in grads
                             if isinstance(g, torch.Tensor))


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root`, mapped to the nodes that feed it its gradient."""
    fed_by: dict[Node, list[Node]] = defaultdict(list)
    seen = {root}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            fed_by[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return fed_by


def _upstream(start: Node, fed_by: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes whose gradient reaches `start` (walking toward the output), not going past `stop`:
    (the nodes walked, the `stop` nodes met)."""
    walked, met = {start}, set()
    queue = deque([start])
    while queue:
        for node in fed_by.get(queue.popleft(), ()):
            if node in stop:
                met.add(node)
            elif node not in walked:
                walked.add(node)
                queue.append(node)
    return walked, met


def _groups(root: Node, input_node: Node, params: Iterable[torch.Tensor]) -> list[_Group] | None:
    fed_by = _consumers(root)
    if input_node not in fed_by:
        return None   # the output does not depend on the input
    to_input, _ = _upstream(input_node, fed_by, set())
    if root not in to_input:
        return None
    by_junction: dict[Node, _Group] = {}
    for p in params:
        node = get_gradient_edge(p).node
        if node not in fed_by:
            continue   # not used by this stage's output: no gradient, as in a whole backward
        _, met = _upstream(node, fed_by, to_input)
        groups = {id(g): g for j in met if (g := by_junction.get(j)) is not None}
        group = _Group()
        for other in groups.values():   # junctions shared: one group
            group.params += other.params
            group.junctions += other.junctions
        group.params.append(p)
        group.junctions += [j for j in met if j not in group.junctions]
        for j in group.junctions:
            by_junction[j] = group
    return list({id(g): g for g in by_junction.values()}.values())


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor | None,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, WeightPass]:
    """The gradient of `stage_input` (None where it has none) and what `backward_weight` needs.
    `grad` is the gradient of `output` (None for a scalar loss)."""
    if output is stage_input:   # a stage that passes its input on: its gradient is the one received
        return grad, WeightPass([])
    if stage_input is None or not stage_input.requires_grad or output.grad_fn is None:
        return None, WeightPass([], whole=(output, grad))
    groups = _groups(output.grad_fn, get_gradient_edge(stage_input).node, [p for p in params if p.requires_grad])
    if groups is None:
        return None, WeightPass([], whole=(output, grad))
    handles = []

    def recorder(group: _Group, junction: Node):
        def record(grad_outputs):
            group.grads[junction] = grad_outputs
        return record

    try:
        for group in groups:
            for j in group.junctions:
                handles.append(j.register_prehook(recorder(group, j)))
        (grad_in,) = torch.autograd.grad(output, stage_input, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, WeightPass(groups)


def backward_weight(pending: WeightPass) -> None:
    """Accumulate the parameters' gradients into their ``.grad``, then free the graph."""
    if pending.whole is not None:
        output, grad = pending.whole
        if output.grad_fn is not None or output.requires_grad:
            torch.autograd.backward(output, grad)
        return
    for group in pending.groups:
        edges, grads = [], []
        for j in group.junctions:
            for i, g in enumerate(group.grads.get(j, ())):
                if g is not None:
                    edges.append(GradientEdge(j, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.junctions) > 1:   # a junction fed by another gets only its recorded gradient
            handles = [j.register_prehook(lambda _, saved=group.grads.get(j): saved) for j in group.junctions]
        try:
            # retained: a graph shared past a junction by two groups must survive the first pass
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
        finally:
            for h in handles:
                h.remove()
    pending.groups.clear()
