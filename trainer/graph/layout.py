"""Which stage owns which tensor, and which checkpoint file each tensor lives in.

A tensor's *layer* is the cut-point segment where the captured graph first uses it: a property
of the model, not of the plan. Checkpoint files are named by layer and hold tensors by their
names in the user's model, so a checkpoint written by any P x D loads into any other
([Note: state per layer] in ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainer.errors import ConfigError
from trainer.graph.cutpoint import is_marker
from trainer.graph.partition import StageSlice, TracedModel, _tensors_used

__all__ = ["Layout", "build_layout"]


@dataclass(frozen=True)
class Layout:
    layer: dict[str, int]                    # canonical tensor name -> layer (segment) index
    owners: dict[str, tuple[int, ...]]       # canonical name -> stages that use it
    tied: tuple[tuple[str, ...], ...]        # sets of names that are one tensor in the math
    files: dict[str, str]                    # canonical name -> checkpoint file name
    # tensors of the model's state_dict that forward never uses: stage 0 keeps them untrained, so
    # checkpoints and exports hold the whole state_dict (a checkpoint without them still loads)
    untrained: frozenset[str] = frozenset()

    def writer_stage(self, name: str) -> int:
        return self.owners[name][0]

    def tied_set(self, name: str) -> tuple[str, ...] | None:
        return next((t for t in self.tied if name in t), None)


def build_layout(traced: TracedModel, slices: Sequence[StageSlice],
                 shared_weights: Sequence[tuple[str, str]] = (), aliases: Mapping[str, str] | None = None,
                 state: Iterable[str] = ()) -> Layout:
    """`aliases` maps every parameter name of the model (tied duplicates too) to its canonical name;
    `state`: the canonical names of the model's state_dict, those no stage uses going to stage 0."""
    layer: dict[str, int] = {}
    seg = 0
    for node in traced.graph_module.graph.nodes:
        for t in _tensors_used(traced.graph_module, node):
            name = traced.canonical.get(id(t))
            if name is not None:
                layer.setdefault(name, seg)
        if is_marker(node):
            seg += 1
    owners: dict[str, list[int]] = {}
    for sl in slices:
        for name in (*sl.owned, *sl.owned_buffers):
            owners.setdefault(name, []).append(sl.stage)
    params = {n for sl in slices for n in sl.owned}
    untrained = frozenset(n for n in state if n not in owners)
    for name in sorted(untrained):
        owners[name] = [0]
        layer.setdefault(name, 0)
    # Buffers several stages read (rotary frequencies) are copies, not weights to keep equal.
    tied = _tied_sets({n: s for n, s in owners.items() if n in params}, shared_weights, aliases or {})
    # One writer per file: tensors of one layer written by different stages get split files.
    writers: dict[int, set[int]] = {}
    for name, stages in owners.items():
        writers.setdefault(layer[name], set()).add(stages[0])
    files = {}
    for name, stages in owners.items():
        lay = layer[name]
        files[name] = f"layer_{lay:03d}.pt" if len(writers[lay]) == 1 else f"layer_{lay:03d}_s{stages[0]}.pt"
    return Layout(layer, {k: tuple(v) for k, v in owners.items()}, tied, files, untrained)


def _tied_sets(owners, shared_weights, alias) -> tuple[tuple[str, ...], ...]:
    """Tensors used by several stages are tied automatically; `shared_weights` pairs
    (Varuna's argument) tie distinct parameters, given by any of their names."""
    for a, b in shared_weights:
        for n in (a, b):
            if n not in alias:
                close = sorted(k for k in alias if n.split(".")[-1] in k)[:5]
                raise ConfigError(f"shared weight '{n}' is not a parameter of the model",
                                  hint=f"similar names: {close}" if close else "check model.named_parameters()")
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for a, b in shared_weights:
        ra, rb = find(alias[a]), find(alias[b])
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[str, list[str]] = {}
    for name in owners:
        groups.setdefault(find(name), []).append(name)
    return tuple(tuple(sorted(g)) for g in groups.values() if len(g) > 1 or len(owners[g[0]]) > 1)
