"""A stage's weights from the user's files, so that a worker's memory follows its stage.

A script may build its model on the meta device (`with torch.device("meta"): model = ...`, no
storage at all) and name where its weights are: `Varuna(model, ..., weights=path)`, `path` a
safetensors file or a Hugging Face checkpoint directory (`model.safetensors`, or the shards named
by `model.safetensors.index.json`). The whole model is captured on the meta device; each worker
then gives only its stage's tensors storage on its device and reads their values from the files,
one tensor at a time (`safe_open(...).get_tensor`), never another stage's. A model built on the
CPU may name weights too: its stage's tensors are overwritten from the files.

Names. A file's keys are the names of the model's state_dict, or of one of its submodules' (a
Hugging Face model saved with `save_pretrained` and wrapped by the script: `lm.` in front): the
submodule under which most keys are found is the one the file holds. A tensor with several names
(a head tied to its embedding, which `save_pretrained` writes once) is read under any of them, and
so is a parameter tied to another with `shared_weights`.

Buffers of a meta model the files do not hold (non-persistent ones: rotary frequencies, masks) are
recomputed, since a tensor given storage on its device holds garbage: by the `_init_weights` of a
transformers model above the buffer's module, which is how transformers itself recomputes them
after loading, else by building that one module again on the CPU from the arguments its
`__init__` names and it keeps as attributes, its parameters staying on the meta device.

`tensor_names` maps a stage's keys (the first name of each tensor, what checkpoints and the
layout use) back to every name the tensor has in the user's model: what an export needs too.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from trainer.errors import ConfigError

__all__ = ["WeightsFile", "tensor_names", "on_meta", "load_stage"]

log = logging.getLogger("varuna")

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _safe_open(path: str):
    try:
        from safetensors import safe_open
    except ImportError:   # a declared dependency; an environment built without it says how to fix it
        raise ConfigError("reading weights needs the safetensors package", hint="pip install safetensors") from None
    return safe_open(path, framework="pt", device="cpu")


class WeightsFile:
    """The tensors of a safetensors file or a Hugging Face checkpoint directory, read lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file_of: dict[str, str] = {}
        self.read_keys: list[str] = []   # what this worker read, for its log
        if os.path.isdir(self.path):
            index, single = os.path.join(self.path, INDEX_NAME), os.path.join(self.path, WEIGHTS_NAME)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ConfigError(f"{index} has no weight_map", hint="write it with save_pretrained")
                self._file_of = {k: os.path.join(self.path, v) for k, v in weight_map.items()}
            elif os.path.isfile(single):
                self._file_of = self._keys_of(single)
            else:
                raise ConfigError(f"{self.path} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}",
                                  hint="save the weights with model.save_pretrained(dir) (safetensors is its "
                                       "default), or name a .safetensors file")
        elif os.path.isfile(self.path):
            self._file_of = self._keys_of(self.path)
        else:
            raise ConfigError(f"weights {self.path!r} do not exist",
                              hint="name a .safetensors file or a directory written by save_pretrained")

    @staticmethod
    def _keys_of(path: str) -> dict[str, str]:
        try:
            with _safe_open(path) as f:
                return {k: path for k in f.keys()}
        except ConfigError:
            raise
        except Exception as exc:   # safetensors raises its own kinds for a file it cannot parse
            raise ConfigError(f"cannot read {path} as safetensors: {exc}",
                              hint="write it with safetensors.torch.save_file or save_pretrained") from exc

    def keys(self) -> set[str]:
        return set(self._file_of)

    def read(self, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor on the CPU) for each key, one file open at a time, one tensor at a time."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self._file_of[k], []).append(k)
        for path, wanted in by_file.items():
            with _safe_open(path) as f:
                for k in wanted:
                    self.read_keys.append(k)
                    yield k, f.get_tensor(k)


def tensor_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter and buffer of `model` by its first name (a stage's key: the name checkpoints,
    the layout and `Varuna.named_parameters` use) -> every name it has in the model, first
    included: a tied head and its embedding are one tensor with two names."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return {ns[0]: tuple(ns) for ns in names.values()}


def on_meta(tensors: Iterable[torch.Tensor]) -> bool:
    return any(t.is_meta for t in tensors)


def _prefix(model: nn.Module, names: Iterable[str], keys: set[str], where: str) -> str:
    """The path (with its dot) of the submodule whose state_dict the file holds ('' for the model)."""
    names = list(names)

    def found(prefix: str) -> int:
        return sum(1 for n in names if n.startswith(prefix) and n[len(prefix):] in keys)

    best, score = "", found("")
    for path, _ in model.named_modules():
        if path and (n := found(path + ".")) > score:
            best, score = path + ".", n
    if score == 0:
        raise ConfigError(f"{where} holds none of the model's tensors (it has e.g. {sorted(keys)[:3]}, the model "
                          f"{names[:3]})", hint="name the weights of this model, saved from it or from one of "
                                                "its submodules (save_pretrained, safetensors.torch.save_file)")
    return best


def load_stage(model: nn.Module, named: Mapping[str, torch.Tensor],
               weights: str | os.PathLike[str] | WeightsFile | None,
               device: torch.device, *, tied: Sequence[Sequence[str]] = (),
               holders: Sequence[nn.Module] = ()) -> dict[str, torch.Tensor]:
    """The stage's tensors (`named`, by their first names) with their values from `weights`: those
    on the meta device replaced by new ones on `device`, everywhere `model` and `holders` (the
    stage's graph) hold them, since a meta tensor cannot be given storage in place. `tied`: sets
    of first names that are one tensor in the math (`shared_weights`), any of which the files may
    hold for all of them."""
    if weights is None:
        if on_meta(named.values()):
            raise ConfigError("the model is on the meta device and Varuna was given no weights to fill it with",
                              hint="pass weights='model.safetensors' (or a save_pretrained directory) to Varuna, "
                                   "or build the model on the CPU")
        return dict(named)
    source = weights if isinstance(weights, WeightsFile) else WeightsFile(weights)
    keys = source.keys()
    names = tensor_names(model)
    prefix = _prefix(model, (n for ns in names.values() for n in ns), keys, source.path)
    alternates = {n: [m for m in group if m != n] for group in tied for n in group}
    key_of: dict[str, str] = {}
    missing, recompute = [], []
    for first, t in named.items():
        candidates = [n for m in (first, *alternates.get(first, ())) for n in names.get(m, (m,))]
        key = next((n[len(prefix):] for n in candidates if n.startswith(prefix) and n[len(prefix):] in keys), None)
        if key is not None:
            key_of[first] = key
        elif isinstance(t, nn.Parameter):
            missing.append(first)
        elif t.is_meta:   # a buffer built on the CPU has its value already
            recompute.append(first)
    if missing:
        raise ConfigError(f"{source.path} lacks {len(missing)} of the stage's parameters: {missing[:5]}"
                          f"{' (looked for them without the prefix ' + repr(prefix) + ')' if prefix else ''}",
                          hint="save every parameter of the model (a tied one under any of its names)")
    named = _materialize(named, device, (model, *holders))
    with torch.no_grad():
        for first in recompute:
            _recompute_buffer(model, first, named[first], source.path)
        first_of = {}
        for first, key in key_of.items():
            first_of.setdefault(key, []).append(first)
        for key, value in source.read(first_of):
            for first in first_of[key]:
                t = named[first]
                if tuple(value.shape) != tuple(t.shape):
                    raise ConfigError(f"'{key}' in {source.path} has shape {tuple(value.shape)}, the model's "
                                      f"'{first}' {tuple(t.shape)}", hint="build the model with the configuration "
                                                                          "the weights were saved from")
                t.copy_(value)
    log.info("read %d of the %d tensors in %s for the stage's %d (%.1f MB)", len(source.read_keys), len(keys),
             source.path, len(named), sum(t.numel() * t.element_size() for t in named.values()) / 2**20)
    return named


def _materialize(named: Mapping[str, torch.Tensor], device: torch.device,
                 holders: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """`named` with each meta tensor replaced by an uninitialised one on `device` (one per tensor
    object: tied names stay one tensor), in every module of `holders` too."""
    new_of: dict[int, torch.Tensor] = {}
    out = {}
    for first, t in named.items():
        if t.is_meta and id(t) not in new_of:
            data = torch.empty(t.shape, dtype=t.dtype, device=device)
            new_of[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        out[first] = new_of.get(id(t), t)
    for holder in holders:
        for module in holder.modules():
            for tensors in (module._parameters, module._buffers):
                for key, t in tensors.items():
                    if t is not None and id(t) in new_of:
                        tensors[key] = new_of[id(t)]
    return out


def _recompute_buffer(model: nn.Module, name: str, t: torch.Tensor, source: str) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    if leaf not in getattr(owner, "_non_persistent_buffers_set", ()):
        log.warning("buffer '%s' is not in %s: recomputed as the model's code initialises it", name, source)
    if t.is_floating_point() and _by_init_weights(model, owner_path, owner, t):
        return
    value, why = _by_rebuilding(owner, leaf)
    if value is None:
        raise ConfigError(f"buffer '{name}' is not in {source} and cannot be recomputed: {why}",
                          hint=f"register it with persistent=True and save it with the weights, or keep the "
                               f"arguments of {type(owner).__name__}.__init__ as attributes of the same names")
    if tuple(value.shape) != tuple(t.shape):
        raise ConfigError(f"buffer '{name}' rebuilt from {type(owner).__name__}'s attributes has shape "
                          f"{tuple(value.shape)}, the model's {tuple(t.shape)}",
                          hint="register it with persistent=True and save it with the weights")
    t.copy_(value)


def _by_init_weights(model: nn.Module, owner_path: str, owner: nn.Module, t: torch.Tensor) -> bool:
    """transformers' way: the nearest PreTrainedModel above recomputes its modules' buffers in
    `_init_weights`. Whether it did is seen in the buffer: NaN before, none after."""
    parts = owner_path.split(".") if owner_path else []
    for depth in range(len(parts), -1, -1):
        above = model.get_submodule(".".join(parts[:depth]))
        if callable(getattr(above, "_init_weights", None)) and hasattr(above, "config"):
            t.fill_(float("nan"))
            try:
                above._init_weights(owner)
            except Exception as exc:   # model code of any kind: the next way is tried
                log.info("_init_weights of %s failed on %s: %s", type(above).__name__, type(owner).__name__, exc)
                return False
            return not bool(t.isnan().any())
    return False


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered inside go to the meta device (their initialisation runs there, at
    no cost); buffers stay where they are computed."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _by_rebuilding(owner: nn.Module, leaf: str) -> tuple[torch.Tensor | None, str]:
    """The buffer of a new `type(owner)` built on the CPU from the attributes named like its
    `__init__`'s arguments; (None, why) when it cannot be built so."""
    cls = type(owner)
    kwargs = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        value = getattr(owner, p.name, inspect.Parameter.empty)
        if value is not inspect.Parameter.empty and not isinstance(value, (nn.Module, torch.Tensor)):
            kwargs[p.name] = value
        elif p.default is inspect.Parameter.empty:
            return None, f"{cls.__name__}.__init__ takes '{p.name}', which the module does not keep as an attribute"
    try:
        with _parameters_on_meta(), torch.device("cpu"):
            fresh = cls(**kwargs)
    except Exception as exc:   # model code of any kind
        return None, f"{cls.__name__}(**{sorted(kwargs)}) raised {type(exc).__name__}: {exc}"
    value = fresh._buffers.get(leaf)
    if value is None or value.is_meta:
        return None, f"a new {cls.__name__} has no buffer '{leaf}'"
    return value, ""
