"""What a captured graph's loss is, read from the graph: a mean over the targets a cross-entropy
does not ignore, a sum over the batch, or neither (trainer.graph.loss_weights weighs each
micro-batch by it).

* A token mean: the loss is one `cross_entropy`/`nll_loss` with the mean reduction and no class
  weights, times constants (`* 2`, `/ accum`, `.float()`, `-(-x)`), whose targets are computed
  from the batch alone: no weight, no cut, no random draw (an MLM mask drawn in forward would be
  counted with another draw than forward's). Its counter runs that computation on a micro-batch
  and counts the targets that are not its `ignore_index`, as torch's mean does.
* A masked mean: a sum as below divided by a scalar computed from the batch alone (`(loss *
  mask).sum() / mask.sum()`, a summed cross-entropy over `(t != -100).sum()`): its counter is
  that divisor.
* A sum: every term of the loss (added or subtracted, times constants) is a loss op with the sum
  reduction, or a `.sum()` to a scalar, and reads the batch (a VAE's summed BCE plus its KL term).
  A term of the weights alone (a penalty) would count once per micro-batch, so it is neither.
* Neither: anything else. A loss over examples needs nothing; `token_losses` finds a token loss
  inside a larger expression (a loss plus an auxiliary one), for the warning that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx, nn

from trainer.graph.cutpoint import is_marker
from trainer.graph.keyed_random import draws

__all__ = ["SUMMED", "TargetCounter", "read_loss", "token_losses"]


class _Summed:
    """read_loss's answer for a summed loss: a counter by which every micro-batch weighs 1."""

    def __call__(self, micro: Mapping[str, torch.Tensor]) -> None:
        return None

    def __repr__(self) -> str:
        return "SUMMED"


SUMMED = _Summed()

_aten = torch.ops.aten
# the losses whose mean is over their targets that are not ignore_index (torch's enum: 1 mean, 2 sum)
_TOKEN_LOSSES = {_aten.cross_entropy_loss.default, _aten.nll_loss.default, _aten.nll_loss_nd.default,
                 _aten.nll_loss2d.default}
_MEAN, _SUM = 1, 2
_SAME_VALUE = {_aten.to.dtype, _aten._to_copy.default, _aten.clone.default, _aten.alias.default,
               _aten.neg.default, _aten.contiguous.default}
_SCALE = {_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar}
_TERMS = {_aten.add.Tensor, _aten.sub.Tensor}
_FLOORS = {_aten.clamp.default, _aten.clamp_min.default, _aten.clip.default}
_COPIES = {_aten.lift_fresh_copy.default, _aten.detach.default, _aten.detach_.default, _aten.clone.default,
           _aten._to_copy.default, _aten.to.dtype}


def _scalar_val(n: object) -> bool:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _constant(gm: fx.GraphModule, n: object) -> bool:
    """A Python number, or a tensor forward made (not a weight) holding one number."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return True
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _COPIES:
        n = n.args[0]   # torch.tensor(4.0) in forward: a lifted constant, copied and detached
    if not (isinstance(n, fx.Node) and n.op == "get_attr"):
        return False
    t = _attribute(gm, n.target)
    return isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.numel() == 1


def _attribute(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _unscaled(gm: fx.GraphModule, node: object) -> object:
    """`node` past what does not change what a loss is a mean or a sum of: constant factors,
    dtype conversions, negation, and the mean or sum of a scalar."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in _SAME_VALUE and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif node.target in (_aten.mean.default, _aten.sum.default) and _scalar_val(node.args[0]):
            node = node.args[0]
        elif node.target in _SCALE and _constant(gm, node.args[1]) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif node.target in (_aten.mul.Tensor, _aten.mul.Scalar) and _constant(gm, node.args[0]) \
                and isinstance(node.args[1], fx.Node):
            node = node.args[1]
        else:
            break
    return node


def _reduction(node: fx.Node) -> int | None:
    """The op's `reduction` argument (None: it has none)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "reduction":
            if len(node.args) > i:
                return node.args[i]
            return node.kwargs.get("reduction", arg.default_value)
    return None


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _reads_batch(node: fx.Node) -> bool:
    return any(n.op == "placeholder" for n in _ancestors(node))


def _summed(gm: fx.GraphModule, node: object) -> bool:
    node = _unscaled(gm, node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in _TERMS:
        alpha = node.kwargs.get("alpha", 1)
        return isinstance(alpha, (int, float)) and all(_summed(gm, a) for a in node.args[:2])
    full_sum = node.target in (_aten.sum.default, _aten.sum.dim_IntList) and _scalar_val(node) \
        and not _scalar_val(node.args[0])
    return (full_sum or _reduction(node) == _SUM) and _reads_batch(node)


def _from_batch(gm: fx.GraphModule, target: fx.Node) -> tuple[fx.GraphModule, list[str]] | None:
    """`target`'s computation as a graph of its own and the batch inputs it reads; None where it
    reads a weight, crosses a cut or draws at random (it is no function of the batch alone)."""
    needed = _ancestors(target)
    for n in needed:
        if n.op == "get_attr" and not _constant(gm, n) or n.op == "call_function" and (is_marker(n) or draws(n)):
            return None
    graph, env, names = fx.Graph(), {}, []
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda x: env[x])
            if n.op == "placeholder":
                names.append(str(n.target))
    graph.output(env[target])
    return fx.GraphModule(gm, graph), names


class TargetCounter:
    """Counts a micro-batch's targets that are not the loss's ignore_index, as torch's mean does
    (`ignore_index` None: the computed value is the count, a masked mean's divisor)."""

    def __init__(self, targets: fx.GraphModule, names: Sequence[str], ignore_index: int | None) -> None:
        self.targets, self.names, self.ignore_index = targets, tuple(names), ignore_index
        self._device: torch.device | None = None

    def _on(self, device: torch.device) -> None:
        """Devices the capture recorded (meta for a model built on it, the CPU for one captured
        there and trained on a GPU) made the micro-batch's, and the constants moved there."""
        if device == self._device:
            return
        for node in self.targets.graph.nodes:
            swap = lambda v: device if isinstance(v, torch.device) else v   # noqa: E731
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if node.op == "get_attr":
                owner, _, leaf = node.target.rpartition(".")
                module = self.targets.get_submodule(owner) if owner else self.targets
                setattr(module, leaf, getattr(module, leaf).to(device))
        self.targets.recompile()
        self._device = device

    def __call__(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if any(n not in micro for n in self.names):
            return None
        inputs = [micro[n] for n in self.names]
        if inputs:
            self._on(inputs[0].device)
        with torch.no_grad():
            value = self.targets(*inputs)
            return value if self.ignore_index is None else (value != self.ignore_index).sum()


def _token_mean(gm: fx.GraphModule, node: fx.Node) -> TargetCounter | None:
    if node.target not in _TOKEN_LOSSES or _reduction(node) != _MEAN:
        return None
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    target = node.args[1]
    if weight is not None or not isinstance(target, fx.Node):
        return None   # class weights: its mean divides by their sum, not a count
    val = target.meta.get("val")
    if isinstance(val, torch.Tensor) and val.is_floating_point():
        return None   # probabilities as targets: the mean is over examples
    found = _from_batch(gm, target)
    if found is None:
        return None
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    return TargetCounter(*found, int(ignore))


def read_loss(gm: fx.GraphModule) -> TargetCounter | _Summed | None:
    """A counter for a token mean, SUMMED for a summed loss, or None (see the module's docstring)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    while isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    node = _unscaled(gm, out)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if _summed(gm, node):
        return SUMMED
    if node.target is _aten.div.Tensor and isinstance(node.args[1], fx.Node) and _scalar_val(node.args[1]) \
            and _summed(gm, node.args[0]):
        divisor = node.args[1]
        # `.clamp(min=1)` keeps a micro-batch of no token at 0/1: counted as 1, it would take a
        # token's share from the others; its loss is 0 either way
        while divisor.op == "call_function" and divisor.target in _FLOORS and isinstance(divisor.args[0], fx.Node):
            divisor = divisor.args[0]
        found = _from_batch(gm, divisor)
        return None if found is None else TargetCounter(*found, None)
    return _token_mean(gm, node)


def token_losses(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's cross-entropy/NLL means over more targets than examples (a token each)."""
    batch = {str(n.meta["val"].shape[0]) for n in gm.graph.nodes if n.op == "placeholder"
             and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()}
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _TOKEN_LOSSES and _reduction(n) == _MEAN:
            val = n.args[1].meta.get("val") if isinstance(n.args[1], fx.Node) else None
            if isinstance(val, torch.Tensor) and not (val.dim() == 1 and str(val.shape[0]) in batch):
                found.append(n)
    return found
