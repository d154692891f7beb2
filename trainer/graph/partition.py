"""Slicing a whole captured model into per-stage modules.

The model is captured once (`trainer.graph.capture.capture_model`, torch.export), CutPoints becoming
`varuna::cut` marker nodes (for a model without CutPoints, one marker after each block of its
largest nn.Sequential/nn.ModuleList). Choosing P-1 active markers splits the graph: stage b's
module is the backward slice of the graph from its output (the input of active marker b+1, or
the loss) that stops at active marker b, which becomes the `varuna_activation` input. So a
stage never sees other stages' parameters, user code never handles `None`, and a value that
would have to cross a cut point other than through a CutPoint is found and named at partition
time, not as a hang at run time.

Nodes that depend only on the batch inputs or only on parameters (an attention mask, position
ids, a tied embedding's weight read again by the output head) may land in several stages: they
are recomputed where needed, and any parameter used by several stages is reported as shared,
so its gradients are summed across the stages that own it. A node that combines parameters
with the batch is computed by one stage only. A buffer update (BatchNorm's running
statistics) runs in the stage of the layer that computes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from trainer.errors import ConfigError, PartitionError
from trainer.graph.capture import TracedModel, capture_model
from trainer.graph.cutpoint import is_marker, marker_name

__all__ = ["TracedModel", "StageSlice", "capture_model", "dry_run", "balance", "slice_stages", "ACTIVATION"]

ACTIVATION = "varuna_activation"


def _inputs_by_position(traced: TracedModel, inputs: Mapping[str, object]) -> list[object]:
    missing = [n for n in traced.input_names if n not in inputs]
    if missing:
        raise ConfigError(f"the batch has no {missing}, which the model's forward needs",
                          hint=f"get_batch_fn must return a dict with keys {list(traced.input_names)}")
    return [inputs[n] for n in traced.input_names]


class _SegmentTimer(fx.Interpreter):
    """Runs the whole graph, timing each segment between markers and checking their inputs."""

    def __init__(self, gm: fx.GraphModule, batch: int, clock=time.process_time) -> None:
        super().__init__(gm)
        self.batch = batch
        self.clock = clock
        self.stamps: list[float] = []
        self.boundary_bytes: list[int] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if is_marker(n):
            name = marker_name(n)
            if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != self.batch:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise PartitionError(
                    f"cut point '{name}' receives {shape}, not a tensor whose first dimension is the "
                    f"batch ({self.batch})",
                    hint="a CutPoint's input must be one batch-first tensor",
                )
            self.stamps.append(self.clock())
            self.boundary_bytes.append(out.numel() * out.element_size())
        return out


@torch.no_grad()
def dry_run(traced: TracedModel, inputs: Mapping[str, torch.Tensor], *, repeats: int = 3) -> list[float]:
    """Median forward CPU seconds of each segment (len(markers) + 1 of them) on a sample batch.
    CPU time, not wall time: other processes on a busy machine cannot make a segment look slow.
    Buffers the forward updates (BatchNorm statistics) are put back: timing is not training.
    A model on the meta device (materialized stage by stage from its weights) has nothing to
    time: its segments are weighed by their floating-point operations instead."""
    batch = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    if batch is None:
        raise ConfigError("get_batch_fn returned no batch-first tensor")
    args = _inputs_by_position(traced, inputs)
    gm = traced.graph_module
    if any(t.is_meta for t in (*gm.parameters(), *gm.buffers())):
        return _segment_flops(gm, [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], batch)
    saved = [(t, t.clone()) for t in gm.buffers()]
    runs = []
    try:
        for _ in range(repeats):
            timer = _SegmentTimer(gm, batch)
            start = time.process_time()
            timer.run(*args)
            stamps = [start, *timer.stamps, time.process_time()]
            runs.append([b - a for a, b in zip(stamps, stamps[1:])])
    finally:
        for t, old in saved:
            t.copy_(old)
    return [sorted(col)[len(col) // 2] for col in zip(*runs)]


def _segment_flops(gm: fx.GraphModule, args: list[object], batch: int) -> list[float]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        timer = _SegmentTimer(gm, batch, clock=counter.get_total_flops)
        timer.run(*args)
    stamps = [0, *timer.stamps, counter.get_total_flops()]
    # a segment of no counted work (an embedding lookup) still costs something
    return [float(b - a) + 1.0 for a, b in zip(stamps, stamps[1:])]


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Indices of the stages-1 markers that split segments into contiguous groups with the
    smallest bottleneck (the slowest stage); ties go to the earliest split."""
    n_markers = len(costs) - 1
    if stages < 1:
        raise ConfigError(f"pipeline depth must be >= 1, got {stages}")
    if stages - 1 > n_markers:
        raise PartitionError(
            f"{stages} stages need {stages - 1} cut points, the model has {n_markers}",
            hint=f"use at most {n_markers + 1} stages, or add CutPoint()s to the model",
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(costs)
    inf = float("inf")
    # best[k][i]: smallest bottleneck covering segments [0, i) with k groups.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], choice[k][i] = v, j
    cuts, i = [], n
    for k in range(stages, 0, -1):
        i = choice[k][i]
        if k > 1:
            cuts.append(i - 1)   # the group starts after segment i-1, i.e. at marker i-1
    return sorted(cuts)


@dataclass(frozen=True)
class StageSlice:
    """One stage's module and what it touches."""

    stage: int
    module: fx.GraphModule
    input_names: tuple[str, ...]        # batch inputs it reads (besides the activation)
    takes_activation: bool
    owned: tuple[str, ...]              # canonical names of parameters it uses, in a stable order
    owned_buffers: tuple[str, ...]
    segments: tuple[int, ...]           # potential-cut-point segments this stage covers


def _marker_segment(traced: TracedModel) -> dict[fx.Node, int]:
    seg, out = 0, {}
    for node in traced.graph_module.graph.nodes:
        out[node] = seg
        if is_marker(node):
            seg += 1
    return out


def _mixes_weights_and_batch(traced: TracedModel) -> set[fx.Node]:
    """Nodes computed from both a trainable parameter and the batch (or an activation): work
    that must run in one stage only. What depends on one side only is cheap to recompute."""
    gm = traced.graph_module
    weights, data = set(), set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if any(isinstance(t, nn.Parameter) and t.requires_grad for t in _tensors_used(gm, node)):
                weights.add(node)
        elif node.op == "placeholder":
            data.add(node)
        else:
            ins = node.all_input_nodes
            if any(i in weights for i in ins):
                weights.add(node)
            if any(i in data for i in ins):
                data.add(node)
    return weights & data


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else ""
    return f"'{node.name}'" + (f" (in module '{module}')" if module else "")


def slice_stages(traced: TracedModel, cuts: Sequence[int]) -> list[StageSlice]:
    """Split at the markers `cuts` (indices into traced.markers, sorted): one slice per stage."""
    cuts = list(cuts)
    if cuts != sorted(set(cuts)) or any(not 0 <= c < len(traced.markers) for c in cuts):
        raise PartitionError(f"cut points {cuts} are not distinct indices below {len(traced.markers)}")
    gm = traced.graph_module
    active = [traced.markers[c] for c in cuts]
    graph_out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = graph_out.args[0]
    names = dict(zip(traced.markers, traced.marker_names))
    P = len(active) + 1
    ends = [m.args[0] for m in active] + [loss]
    entries = [None, *active]
    segment_of = _marker_segment(traced)
    bounds = [-1, *cuts, len(traced.markers)]
    stage_of_segment = {s: b for b in range(P) for s in range(bounds[b] + 1, bounds[b + 1] + 1)}
    hint = _skip_hint(traced)
    needed = [_backward_slice(ends[b], entries[b], set(active), names, b, hint) for b in range(P)]
    for mut in traced.mutations:   # a buffer update runs in the segment that computes it
        b = stage_of_segment[segment_of[mut]]
        needed[b] |= _backward_slice(mut, entries[b], set(active), names, b, hint)
    once = _mixes_weights_and_batch(traced)
    placed: dict[fx.Node, int] = {}
    slices = []
    for b in range(P):
        entry = entries[b]
        if entry is not None and entry not in needed[b]:
            raise PartitionError(
                f"stage {b} does not use the tensor of cut point '{names[entry]}'",
                hint="active cut points must lie on one path from the inputs to the loss",
            )
        for node in needed[b]:
            if node in once and node in placed and node is not entry:
                raise PartitionError(
                    f"{_where(node)} would be computed in stages {placed[node]} and {b}: its output is "
                    "used after a cut point without passing through it (a skip connection across the cut?)",
                    hint=hint,
                )
            placed.setdefault(node, b)
        slices.append(_build_slice(traced, b, needed[b], entry, ends[b], bounds))
    return slices


def _skip_hint(traced: TracedModel) -> str:
    if not traced.auto:
        return "move the CutPoint so that one tensor carries everything the next layers need"
    # nobody placed these cuts: say where they came from, and that this model cannot be cut there
    return ("the cut points were placed automatically, after each block of the model's largest "
            "nn.Sequential/nn.ModuleList, and this model passes its blocks more than one tensor (an "
            "encoder's output to a decoder, a bias every layer reads): it cannot be pipelined at those "
            "places. Add CutPoint()s where one tensor carries everything the later layers need, or train "
            "it with one stage per replica (P=1)")


def _backward_slice(end, entry, active: set, names: dict, stage: int, hint: str) -> set:
    needed, stack = set(), [end]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if node is entry:
            continue
        if node in active:
            raise PartitionError(
                f"stage {stage} needs a value computed before cut point '{names[node]}' that does not "
                "pass through the cut point just before it (a skip connection across a cut?)",
                hint=hint,
            )
        stack.extend(node.all_input_nodes)
    return needed


def _build_slice(traced, b, needed, entry, end, bounds) -> StageSlice:
    gm = traced.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if entry is not None:
        env[entry] = graph.placeholder(ACTIVATION)
        env[entry].meta = dict(entry.meta)
    inputs, owned, owned_buffers = [], {}, {}
    for node in gm.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op == "placeholder":
            inputs.append(node.target)
        if is_marker(node):
            env[node] = env[node.args[0]]   # an inactive cut point is the identity
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        for t in _tensors_used(gm, node):
            name = traced.canonical.get(id(t))
            if name is None:
                continue
            (owned if isinstance(t, nn.Parameter) else owned_buffers)[name] = True
    graph.output(env[end])
    module = fx.GraphModule(gm, graph, class_name=f"Stage{b}")
    segments = tuple(range(bounds[b] + 1, bounds[b + 1] + 1))
    return StageSlice(b, module, tuple(inputs), entry is not None, tuple(owned), tuple(owned_buffers), segments)


def _tensors_used(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The parameter, buffer or constant a get_attr node reads (nothing for other nodes)."""
    if node.op != "get_attr":
        return []
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return [obj] if isinstance(obj, torch.Tensor) else []
