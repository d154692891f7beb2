"""What each micro-batch's loss weighs in the step's loss: its examples, or the tokens its loss averages.

The step's loss is the weighted sum of its micro-batches' losses. Weighted by examples (the
default), that is the global batch's loss when forward averages over examples. A language model's
loss is a mean over the tokens whose label is not -100 (padding, a prompt): micro-batches of the
same number of examples hold different numbers of such tokens, and weighting them by examples
trains a model that depends on the micro-batch size, so on the plan. Weighted by its tokens over
the global batch's (counted on the last stage's replicas, which hold the labels), the step's loss
is the global batch's token mean at any micro-batch size and P x D. [Note: the global batch defines the math]

"auto" reads the captured graph's loss (trainer.graph.loss_form): a cross-entropy mean is
counted as torch counts it, its targets that are not `ignore_index` (a hand-written GPT padding
its targets with -1 was weighed by examples, 2.6e-2 off the plain loop at 2x2), and a summed loss
weighs 1 per micro-batch, so the step's loss is the global batch's sum (it was a quarter of it in
micro-batches of 2 of 8). A Hugging Face model whose graph does not show its loss so plainly is
counted as its loss type says (a causal LM shifts its labels by one; masked LMs, token
classification and sequence-to-sequence models do not). Anything else weighs by examples, with a
warning where a cross-entropy over tokens hides in a larger loss; a script passes `loss_count=`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import fx, nn

from trainer.errors import ConfigError
from trainer.graph.loss_form import SUMMED, read_loss, token_losses

__all__ = ["Counter", "SUMMED", "counter_for", "counts", "step_weights", "token_weights"]

Counter = Callable[[Mapping[str, torch.Tensor]], "int | torch.Tensor | None"]

log = logging.getLogger("varuna")

IGNORE_INDEX = -100   # torch's cross_entropy default and Hugging Face's label for "no loss here"
_ALIGNED = ("ForMaskedLM", "ForTokenClassification", "ForConditionalGeneration")


def _is_hugging_face(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _labels_counter(shift: bool) -> Counter:
    def count(micro: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if "shift_labels" in micro:   # given by the script, already aligned with the logits
            return (micro["shift_labels"] != IGNORE_INDEX).sum()
        labels = micro.get("labels")
        if labels is None or labels.dim() < 2 or labels.is_floating_point():
            return None   # one label per example (or a regression target): its mean is over examples
        return ((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum()
    return count


def _warn_of_token_losses(model: nn.Module, gm: fx.GraphModule) -> None:
    """A token mean Varuna cannot count (inside a larger loss, with class weights, of targets drawn
    at random) is weighed by examples: where its targets hold ignore_index (padding), the model
    trained depends on the micro-batch size."""
    found = token_losses(gm)
    if found:
        log.warning("the loss of %s holds a cross-entropy averaged over its targets that are not ignore_index "
                    "(%s), which Varuna cannot count from the graph (a loss added to it, class weights, targets "
                    "drawn at random): it weighs each micro-batch by its examples, which is the full batch's "
                    "loss only where no target is ignored. If targets hold ignore_index (padding), pass "
                    "loss_count=lambda m: (<the targets> != <ignore_index>).sum() (or loss_count=None to "
                    "silence this); targets forward draws at random (a masked-LM mask) are in no micro-batch "
                    "for loss_count to read: draw them with the batch, before step(), and pass them as an "
                    "input", type(model).__name__, found[0].name)


def counter_for(model: nn.Module, loss_count: Counter | str | None,
                graph: fx.GraphModule | None = None) -> Counter | None:
    """The counter of `loss_count`: "auto" reads the model's captured `graph` (trainer.graph.loss_form),
    else a Hugging Face model's own loss type; None weighs by examples; or the script's callable,
    a micro-batch's tensors by name -> its count."""
    if loss_count is None or callable(loss_count):
        return loss_count
    if loss_count != "auto":
        raise ConfigError(f"loss_count must be 'auto', None or a callable, got {loss_count!r}")
    found = None if graph is None else read_loss(graph)
    if found is not None:
        return found
    if _is_hugging_face(model):
        loss_type = getattr(model, "loss_type", None)
        # None is what Hugging Face's loss_function falls back to a causal LM's from, but also what
        # a model computing its own loss says (XLNet's aligned labels, BertForPreTraining's two
        # losses): that guess only where there is no graph to read
        if loss_type == "ForCausalLM" or (loss_type is None and graph is None):
            return _labels_counter(shift=True)
        if loss_type in _ALIGNED:
            return _labels_counter(shift=False)
    if graph is not None:
        _warn_of_token_losses(model, graph)
    return None


def step_weights(counter: Counter | None, micro: list[Mapping[str, torch.Tensor]], by_examples: list[float],
                 global_count: Callable[[float], float]) -> list[float]:
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


def counts(counter: Counter, micro: list[Mapping[str, torch.Tensor]]) -> list[float] | None:
    """Each micro-batch's count (a number of tokens, or a sum of weights a mean divides by), or
    None where any has none (the step then weighs by examples)."""
    out = []
    for m in micro:
        try:
            c = counter(m)
        except KeyError as exc:
            raise ConfigError(f"loss_count reads {exc} from the micro-batch, which holds only {sorted(m)}",
                              hint="count from the inputs the loss reads (the last stage holds them)") from None
        if c is None:
            return None
        out.append(float(c))
    return out


def token_weights(counted: list[float], total: float) -> list[float]:
    """Each micro-batch's weight: its count over the global batch's (0 where nothing counts: a
    batch whose labels are all ignored has no loss, where a plain loop would give 0/0)."""
    return [c / total if total else 0.0 for c in counted]
