"""Slicing a whole model into per-stage modules.

The model is traced once with torch.fx, CutPoints becoming `cut_marker` nodes (for a model
without CutPoints, one marker after each block of its largest nn.Sequential/nn.ModuleList).
Choosing P-1 active markers splits the graph: stage b's module is the backward slice of the
graph from its output (the input of active marker b+1, or the loss) that stops at active marker
b, which becomes the `varuna_activation` input. So a stage never sees other stages' modules,
user code never handles `None`, and a value that would have to cross a cut point other than
through a CutPoint is found and named at partition time, not as a hang at run time.

Nodes that depend only on the batch inputs and on parameters (a tied embedding's weight read
again by the output head, position ids) may land in several stages: they are recomputed where
needed, and any parameter used by several stages is reported as shared, so its gradients are
summed across the stages that own it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from trainer.cutpoint import CutPoint, cut_marker
from trainer.errors import ConfigError, PartitionError

__all__ = ["TracedModel", "StageSlice", "trace_model", "dry_run", "balance", "slice_stages"]

ACTIVATION = "varuna_activation"


class _Tracer(fx.Tracer):
    def __init__(self, auto_blocks: frozenset[str]) -> None:
        super().__init__()
        self._auto_blocks = auto_blocks
        self._seen: set[str] = set()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, CutPoint) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        qualname = self.path_of_module(m)
        if isinstance(m, CutPoint):
            if qualname in self._seen:
                raise PartitionError(
                    f"CutPoint '{qualname}' is called twice in one forward",
                    hint="give every boundary its own CutPoint instance",
                )
            self._seen.add(qualname)
            if len(args) != 1 or kwargs:
                raise PartitionError(f"CutPoint '{qualname}' takes exactly one tensor")
            return self.create_proxy("call_function", cut_marker, args, {"name": qualname})
        out = super().call_module(m, forward, args, kwargs)
        if qualname in self._auto_blocks:
            out = self.create_proxy("call_function", cut_marker, (out,), {"name": f"{qualname}:out"})
        return out


def _auto_blocks(model: nn.Module) -> frozenset[str]:
    """Boundaries between the blocks of the model's largest Sequential/ModuleList."""
    best, best_key = None, (1, 0)
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList)) and len(mod) >= 2:
            key = (len(mod), sum(p.numel() for p in mod.parameters()))
            if key > best_key:
                best, best_key = name, key
    if best is None:
        return frozenset()
    container = model.get_submodule(best)
    prefix = f"{best}." if best else ""
    return frozenset(f"{prefix}{i}" for i in range(len(container) - 1))


@dataclass(frozen=True)
class TracedModel:
    """The whole model as one graph, with its potential cut points in execution order."""

    graph_module: fx.GraphModule
    markers: tuple[fx.Node, ...]
    canonical: dict[int, str]          # id(parameter or buffer) -> its name in the user's model
    input_names: tuple[str, ...]
    auto: bool                          # cut points were inferred from a block container

    @property
    def marker_names(self) -> list[str]:
        return [m.kwargs["name"] for m in self.markers]


def trace_model(model: nn.Module) -> TracedModel:
    has_cutpoints = any(isinstance(m, CutPoint) for m in model.modules())
    auto = frozenset() if has_cutpoints else _auto_blocks(model)
    tracer = _Tracer(auto)
    try:
        graph = tracer.trace(model)
    except PartitionError:
        raise
    except Exception as exc:  # torch.fx raises many kinds for untraceable Python
        raise PartitionError(
            f"cannot trace {type(model).__name__} with torch.fx: {exc}",
            hint="forward must take the batch's tensors as arguments, return the loss, and avoid "
                 "Python control flow that depends on tensor values",
        ) from exc
    gm = fx.GraphModule(tracer.root, graph, class_name=f"Traced{type(model).__name__}")
    markers = tuple(n for n in gm.graph.nodes if n.op == "call_function" and n.target is cut_marker)
    canonical: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(t), name)
    inputs = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder")
    return TracedModel(gm, markers, canonical, inputs, bool(auto))


def _inputs_by_position(traced: TracedModel, inputs: Mapping[str, object]) -> list[object]:
    args = []
    for node in traced.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.target in inputs:
            args.append(inputs[node.target])
        elif node.args:
            args.append(node.args[0])
        else:
            raise ConfigError(f"the batch has no '{node.target}', which the model's forward needs",
                              hint=f"get_batch_fn must return a dict with keys {list(traced.input_names)}")
    return args


class _SegmentTimer(fx.Interpreter):
    """Runs the whole graph, timing each segment between markers and checking their inputs."""

    def __init__(self, gm: fx.GraphModule, batch: int) -> None:
        super().__init__(gm)
        self.batch = batch
        self.stamps: list[float] = []
        self.boundary_bytes: list[int] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op == "call_function" and n.target is cut_marker:
            name = n.kwargs["name"]
            if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != self.batch:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise PartitionError(
                    f"cut point '{name}' receives {shape}, not a tensor whose first dimension is the "
                    f"batch ({self.batch})",
                    hint="a CutPoint's input must be one batch-first tensor",
                )
            self.stamps.append(time.process_time())
            self.boundary_bytes.append(out.numel() * out.element_size())
        return out


@torch.no_grad()
def dry_run(traced: TracedModel, inputs: Mapping[str, torch.Tensor], *, repeats: int = 3) -> list[float]:
    """Median forward CPU seconds of each segment (len(markers) + 1 of them) on a sample batch.
    CPU time, not wall time: other processes on a busy machine cannot make a segment look slow."""
    batch = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    if batch is None:
        raise ConfigError("get_batch_fn returned no batch-first tensor")
    args = _inputs_by_position(traced, inputs)
    runs = []
    for _ in range(repeats):
        timer = _SegmentTimer(traced.graph_module, batch)
        start = time.process_time()
        timer.run(*args)
        stamps = [start, *timer.stamps, time.process_time()]
        runs.append([b - a for a, b in zip(stamps, stamps[1:])])
    return [sorted(col)[len(col) // 2] for col in zip(*runs)]


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
        if node.op == "call_function" and node.target is cut_marker:
            seg += 1
    return out


def slice_stages(traced: TracedModel, cuts: Sequence[int]) -> list[StageSlice]:
    """Split at the markers `cuts` (indices into traced.markers, sorted): one slice per stage."""
    cuts = list(cuts)
    if cuts != sorted(set(cuts)) or any(not 0 <= c < len(traced.markers) for c in cuts):
        raise PartitionError(f"cut points {cuts} are not distinct indices below {len(traced.markers)}")
    gm = traced.graph_module
    active = [traced.markers[c] for c in cuts]
    graph_out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = graph_out.args[0]
    if not isinstance(loss, fx.Node):
        raise PartitionError("forward must return the loss as a single tensor")
    names = dict(zip(traced.markers, traced.marker_names))
    P = len(active) + 1
    ends = [m.args[0] for m in active] + [loss]
    segment_of = _marker_segment(traced)
    slices, placed = [], {}
    for b in range(P):
        entry = active[b - 1] if b else None
        needed = _backward_slice(ends[b], entry, set(active), names, b)
        if entry is not None and entry not in needed:
            raise PartitionError(
                f"stage {b} does not use the tensor of cut point '{names[entry]}'",
                hint="active cut points must lie on one path from the inputs to the loss",
            )
        for node in needed:
            if node.op == "call_module" and node in placed and _tensors_used(gm, node):
                raise PartitionError(
                    f"module '{node.target}' would run in stages {placed[node]} and {b}: its output is "
                    "used after a cut point without passing through it (a skip connection across the cut?)",
                    hint="move the CutPoint so that one tensor carries everything the next layers need",
                )
            placed.setdefault(node, b)
        slices.append(_build_slice(traced, b, needed, entry, ends[b], segment_of, cuts))
    return slices


def _backward_slice(end, entry, active: set, names: dict, stage: int) -> set:
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
                hint="move the CutPoint so that one tensor carries everything the next layers need",
            )
        stack.extend(node.all_input_nodes)
    return needed


def _build_slice(traced, b, needed, entry, end, segment_of, cuts) -> StageSlice:
    gm = traced.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if entry is not None:
        env[entry] = graph.placeholder(ACTIVATION)
    inputs, owned, owned_buffers = [], {}, {}
    for node in gm.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op == "placeholder":
            inputs.append(node.target)
        if node.op == "call_function" and node.target is cut_marker:
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
    bounds = [-1, *cuts, len(traced.markers)]
    segments = tuple(range(bounds[b] + 1, bounds[b + 1] + 1))
    return StageSlice(b, module, tuple(inputs), entry is not None, tuple(owned), tuple(owned_buffers), segments)


def _tensors_used(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return [*mod.parameters(), *mod.buffers()]
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return [obj] if isinstance(obj, torch.Tensor) else []
    return []
