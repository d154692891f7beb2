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
token classification and sequence-to-sequence models do not). A script passes `loss_count=` to
`Varuna` for a model of its own whose loss is such a mean.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from trainer.errors import ConfigError

__all__ = ["Counter", "counter_for", "counts", "token_weights"]

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


def counter_for(model: nn.Module, loss_count: Counter | str | None) -> Counter | None:
    """The counter of `loss_count` ("auto": a Hugging Face model's own, else none; None: weigh by
    examples; or the script's callable, a micro-batch's tensors by name -> its count)."""
    if loss_count is None or callable(loss_count):
        return loss_count
    if loss_count != "auto":
        raise ConfigError(f"loss_count must be 'auto', None or a callable, got {loss_count!r}")
    if not _is_hugging_face(model):
        _warn_of_wrapped(model)
        return None
    loss_type = getattr(model, "loss_type", None)
    if loss_type in _SHIFTED:
        return _labels_counter(shift=True)
    if loss_type in _ALIGNED:
        return _labels_counter(shift=False)
    return None


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
