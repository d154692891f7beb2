"""What a checkpoint records of the user's model, so that its weights can leave the store again
under the names the user's own class expects (`trainer.checkpoint.export`).

A checkpoint keys each tensor by its canonical name: the first name the model gives it among
its parameters and buffers. The user's `state_dict` differs from that set in two ways: a
tied tensor appears under each of its names (GPT-2's `lm_head.weight` is
`transformer.wte.weight`), and a non-persistent buffer does not appear at all. So the record
is the `state_dict`'s own keys, each with the canonical name that holds its value, plus
where a Hugging Face model sits inside the user's module (a script usually wraps one in a
module whose forward returns the loss) and that model's config, for `from_pretrained`.

The record is built from the model before it is partitioned, when every tensor still has its
identity; it holds names and plain values only, never tensors.

May import: trainer.errors and the standard library (never torch: the record is plain data).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelRecord", "record_model", "MANIFEST_KEY"]

MANIFEST_KEY = "model"   # the manifest's meta[MANIFEST_KEY] holds ModelRecord.to_dict()


@dataclass(frozen=True)
class ModelRecord:
    """The user's model as an export needs it: names, not tensors."""

    # the model's state_dict keys in its order -> the checkpoint's name for each value
    state_dict: Mapping[str, str]
    model_class: str                  # "module.QualName" of the model handed to Varuna
    # where a Hugging Face (transformers) model sits: "" for the model itself, "lm." for a
    # wrapper's `lm` attribute; None when there is none (or several side by side)
    pretrained_prefix: str | None = None
    pretrained_class: str | None = None
    config: Mapping[str, Any] | None = field(default=None)   # that model's config, as config.json holds it

    def __post_init__(self) -> None:
        if not isinstance(self.state_dict, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.state_dict.items()):
            raise ValueError("ModelRecord.state_dict must map non-empty names to non-empty names")
        if not isinstance(self.model_class, str) or not self.model_class:
            raise ValueError(f"ModelRecord.model_class must be a non-empty string, got {self.model_class!r}")
        if self.pretrained_prefix is not None:
            if not isinstance(self.pretrained_prefix, str) or (self.pretrained_prefix
                                                               and not self.pretrained_prefix.endswith(".")):
                raise ValueError(f"ModelRecord.pretrained_prefix must be '' or end with '.', "
                                 f"got {self.pretrained_prefix!r}")
            if not isinstance(self.pretrained_class, str) or not self.pretrained_class:
                raise ValueError("ModelRecord.pretrained_class must name the class of the model at pretrained_prefix")
        if self.config is not None and not isinstance(self.config, Mapping):
            raise ValueError(f"ModelRecord.config must be a JSON object, got {type(self.config).__name__}")

    def names_under(self, prefix: str) -> dict[str, str]:
        """The state_dict of the submodule at `prefix` ("" the whole model, else ending in '.'):
        its own keys -> the checkpoint's names."""
        return {k[len(prefix):]: v for k, v in self.state_dict.items() if k.startswith(prefix)}

    def to_dict(self) -> dict[str, Any]:
        return {"state_dict": dict(self.state_dict), "model_class": self.model_class,
                "pretrained_prefix": self.pretrained_prefix, "pretrained_class": self.pretrained_class,
                "config": dict(self.config) if self.config is not None else None}

    @classmethod
    def from_dict(cls, doc: object) -> ModelRecord:
        """Parse a manifest's record; ValueError says what is wrong with it."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"the model record is a {type(doc).__name__}, not an object")
        known = {"state_dict", "model_class", "pretrained_prefix", "pretrained_class", "config"}
        return cls(**{k: v for k, v in doc.items() if k in known})


def record_model(model: Any, canonical: Mapping[int, str]) -> ModelRecord:
    """The record of `model` (an nn.Module), whose tensors `canonical` names by id (the graph
    capture's own names: `trainer.graph.capture.TracedModel.canonical`)."""
    names = {}
    for key, t in model.state_dict(keep_vars=True).items():
        # a tensor the capture never saw (a module's extra state) is not in the checkpoint either
        if id(t) in canonical:
            names[key] = canonical[id(t)]
    prefix, inner = _pretrained(model.named_modules())
    config = _config_of(inner) if inner is not None else None
    return ModelRecord(state_dict=names, model_class=_class_name(model),
                       pretrained_prefix=prefix if inner is not None else None,
                       pretrained_class=_class_name(inner) if inner is not None else None, config=config)


def _is_pretrained(module: Any) -> bool:
    """A transformers PreTrainedModel, told by what from_pretrained needs (transformers is not
    imported here: most models are not Hugging Face's)."""
    config = getattr(module, "config", None)
    return callable(getattr(module, "save_pretrained", None)) and callable(getattr(config, "to_json_string", None))


def _pretrained(named_modules: Iterable[tuple[str, Any]]) -> tuple[str, Any]:
    """The outermost Hugging Face model inside, with its prefix; ("", None) when there is none,
    or when there are several side by side (which one the user means is theirs to say)."""
    found: list[tuple[str, Any]] = []
    for name, module in named_modules:   # parents come before their children
        if any(p == "" or name.startswith(p + ".") for p, _ in found):
            continue   # inside one already found
        if _is_pretrained(module):
            found.append((name, module))
    if len(found) != 1:
        return "", None
    name, module = found[0]
    return (f"{name}." if name else ""), module


def _config_of(module: Any) -> dict[str, Any] | None:
    """The model's config as `save_pretrained` writes config.json (architectures set)."""
    try:
        doc = json.loads(module.config.to_json_string(use_diff=False))
    except (TypeError, ValueError, AttributeError):
        return None   # a config that cannot be written: the export says to pass one
    if not isinstance(doc, dict):
        return None
    doc["architectures"] = [type(module).__name__]
    return doc


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
