"""What each micro-batch's loss weighs in the step's loss: its examples, or the tokens its loss averages.

The step's loss is the weighted sum of its micro-batches' losses. Weighted by examples (the
default), that is the global batch's loss when forward averages over examples. A language model's
loss is a mean over the tokens whose label is not -100 (padding, a prompt): micro-batches of the
same number of examples hold different numbers of such tokens, and weighting them by examples
trains a model that depends on the micro-batch size, so on the plan. Weighted by its tokens over
the global batch's (counted on the last stage's replicas, which hold the labels), the step's loss
is the global batch's token mean at any micro-batch size and P x D. [Note: the global batch defines the math]

A Hugging Face model given its `labels` is counted as its own loss function counts (`loss_type`:
a causal LM shifts its labels by one, the default a Hugging Face model falls back to; masked LMs,
token classification and sequence-to-sequence models do not). Any other model is read from its
captured graph (`counter_from_graph`): a loss that is one `cross_entropy`/`nll_loss` (times a
constant) averaging over targets computed from the batch alone is counted as torch counts it, the
targets that are not its `ignore_index` (a hand-written GPT padding its targets with -1 was
weighed by examples, 2.6e-2 off the plain loop at 2x2); one with `reduction="sum"` weighs 1 per
micro-batch, so the step's loss is the global batch's sum (it was a quarter of it in micro-batches
of 2 of 8). A script passes `loss_count=` for a loss the graph does not show so plainly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import fx, nn

from trainer.errors import ConfigError
from trainer.graph.cutpoint import is_marker

__all__ = ["Counter", "SUMMED", "counter_for", "counter_from_graph", "counts", "step_weights", "token_weights"]

Counter = Callable[[Mapping[str, torch.Tensor]], "int | torch.Tensor | None"]

log = logging.getLogger("varuna")

IGNORE_INDEX = -100   # torch's cross_entropy default and Hugging Face's label for "no loss here"
_SHIFTED = (None, "ForCausalLM")   # None: what Hugging Face's loss_function falls back to
_ALIGNED = ("ForMaskedLM", "ForTokenClassification", "ForConditionalGeneration")


def _is_hugging_face(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _warn_of_wrapped(model: nn.Module) -> None:
    """A Hugging Face model inside the script's own module is not counted by itself: its loss
    (when the wrapper returns it) averages over tokens, weighed here by examples, so the model
    trained would depend on the micro-batch size the planner picks. Said once, at start-up."""
    inner = next(((name, m) for name, m in model.named_modules() if name and _is_hugging_face(m)), None)
    if inner is None:
        return
    name, m = inner
    loss_type = getattr(m, "loss_type", None)
    if loss_type not in _SHIFTED and loss_type not in _ALIGNED:
        return
    shift = loss_type in _SHIFTED
    log.warning("%s wraps the Hugging Face %s (as '%s'), whose loss averages over the tokens whose label is not "
                "-100; with loss_count='auto' Varuna counts only a Hugging Face model given as it is, so it "
                "weighs each micro-batch by its examples, and where labels hold -100 (padding, prompts) the "
                "model trained depends on the micro-batch size. If forward returns that loss, pass "
                "loss_count=lambda m: (m['labels']%s != -100).sum() (or loss_count=None to silence this)",
                type(model).__name__, type(m).__name__, name, "[:, 1:]" if shift else "")


def _labels_counter(shift: bool) -> Counter:
    def count(micro: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if "shift_labels" in micro:   # given by the script, already aligned with the logits
            return (micro["shift_labels"] != IGNORE_INDEX).sum()
        labels = micro.get("labels")
        if labels is None or labels.dim() < 2 or labels.is_floating_point():
            return None   # one label per example (or a regression target): its mean is over examples
        return ((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum()
    return count


class _Summed:
    """The counter of a loss that sums over its examples or tokens: every micro-batch weighs 1."""

    def __call__(self, micro: Mapping[str, torch.Tensor]) -> None:
        return None

    def __repr__(self) -> str:
        return "SUMMED"


SUMMED = _Summed()

_aten = torch.ops.aten
# losses whose arguments are (input, target, weight, reduction, ignore_index, ...)
_TOKEN_LOSSES = {_aten.cross_entropy_loss.default, _aten.nll_loss.default, _aten.nll_loss_nd.default,
                 _aten.nll_loss2d.default}
_SCALINGS = {_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar}
_MEAN, _SUM = 1, 2   # torch's reduction enum


def _argument(node: fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _loss_node(gm: fx.GraphModule) -> fx.Node | None:
    """The node of the graph's loss, past multiplications and divisions by constants."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    while isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    node = out
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SCALINGS:
        a, b = node.args[:2]
        if isinstance(a, fx.Node) and isinstance(b, (int, float)):
            node = a
        elif node.target in (_aten.mul.Tensor, _aten.mul.Scalar) and isinstance(a, (int, float)) \
                and isinstance(b, fx.Node):
            node = b
        else:
            return None
    return node if isinstance(node, fx.Node) else None


def _from_batch(gm: fx.GraphModule, target: fx.Node) -> tuple[fx.GraphModule, list[str]] | None:
    """`target`'s computation as a graph of its own, with the batch inputs it reads; None where
    it reads a weight or crosses a cut (it is no function of the batch alone)."""
    needed, todo = set(), [target]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        if n.op == "get_attr" or (n.op == "call_function" and is_marker(n)):
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    graph, env = fx.Graph(), {}
    names = []
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda x: env[x])
            if n.op == "placeholder":
                names.append(str(n.target))
    graph.output(env[target])
    return fx.GraphModule(torch.nn.Module(), graph), names


class _TargetCounter:
    """Counts a micro-batch's targets that are not the loss's ignore_index, as torch's mean does."""

    def __init__(self, targets: fx.GraphModule, names: Sequence[str], ignore_index: int) -> None:
        self.targets, self.names, self.ignore_index = targets, tuple(names), ignore_index

    def __call__(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if any(n not in micro for n in self.names):
            return None
        with torch.no_grad():
            return (self.targets(*[micro[n] for n in self.names]) != self.ignore_index).sum()


def counter_from_graph(gm: fx.GraphModule) -> Counter | None:
    """The counter the captured graph's loss implies (see the module's docstring), or None: a loss
    averaged over examples, or one the graph does not show as one token loss of the batch."""
    node = _loss_node(gm)
    if node is None or node.op != "call_function" or node.target not in _TOKEN_LOSSES:
        return None
    reduction = _argument(node, 3, "reduction", _MEAN)
    if reduction == _SUM:
        return SUMMED
    if reduction != _MEAN or _argument(node, 2, "weight", None) is not None:
        return None   # per-element (the script reduces), or class weights: its mean is not a count
    target = node.args[1]
    found = _from_batch(gm, target) if isinstance(target, fx.Node) else None
    if found is None or target.meta.get("val") is not None and target.meta["val"].is_floating_point():
        return None   # probabilities as targets: the mean is over examples
    return _TargetCounter(*found, int(_argument(node, 4, "ignore_index", IGNORE_INDEX)))


def counter_for(model: nn.Module, loss_count: Counter | str | None,
                graph: fx.GraphModule | None = None) -> Counter | None:
    """The counter of `loss_count` ("auto": a Hugging Face model's own, else the one its captured
    `graph` implies; None: weigh by examples; or the script's callable, a micro-batch's tensors by
    name -> its count)."""
    if loss_count is None or callable(loss_count):
        return loss_count
    if loss_count != "auto":
        raise ConfigError(f"loss_count must be 'auto', None or a callable, got {loss_count!r}")
    if not _is_hugging_face(model):
        found = None if graph is None else counter_from_graph(graph)
        if found is None:
            _warn_of_wrapped(model)
        return found
    loss_type = getattr(model, "loss_type", None)
    if loss_type in _SHIFTED:
        return _labels_counter(shift=True)
    if loss_type in _ALIGNED:
        return _labels_counter(shift=False)
    return None


def step_weights(counter: Counter | None, micro: list[Mapping[str, torch.Tensor]], by_examples: list[float],
                 global_count: Callable[[int], int]) -> list[float]:
    """Each micro-batch's weight: by its examples (`by_examples`), 1 for a summed loss, or by its
    count over the global batch's (`global_count` adds up every replica's)."""
    if counter is None:
        return by_examples
    if counter is SUMMED:
        return [1.0] * len(micro)
    counted = counts(counter, micro)
    if counted is None:
        return by_examples
    return token_weights(counted, global_count(sum(counted)))


def counts(counter: Counter, micro: list[Mapping[str, torch.Tensor]]) -> list[int] | None:
    """Each micro-batch's count, or None where any has none (the step then weighs by examples)."""
    out = []
    for m in micro:
        try:
            c = counter(m)
        except KeyError as exc:
            raise ConfigError(f"loss_count reads {exc} from the micro-batch, which holds only {sorted(m)}",
                              hint="count from the inputs the loss reads (the last stage holds them)") from None
        if c is None:
            return None
        out.append(int(c))
    return out


def token_weights(counted: list[int], total: int) -> list[float]:
    """Each micro-batch's weight: its count over the global batch's (0 where nothing counts: a
    batch whose labels are all ignored has no loss, where a plain loop would give 0/0)."""
    return [c / total if total else 0.0 for c in counted]
