"""Exported programs kept on disk, so that a VM's next worker for the same model does not export it again.

A morph restarts every worker, and each captures the model with torch.export before its first
step: about half a second of a restart on a small model, more where several workers share a
VM's cores. The program a capture exports depends on the model's code and structure, the sample
batch's shapes and the libraries, not on the weights' values, so a daemon gives its workers a
directory per job bundle (`WorkerAssignment.capture_cache`) and a capture there is saved once and
loaded by the next worker of that job on that VM.

What is saved is the exported program with its parameters and buffers replaced by tensors
without storage ("meta"): the loaded program's graph is then given the model's own tensors by
name (`trainer.graph.capture`), so a cached capture costs disk for the graph alone and can never
put stale weights in a model. Lifted constants (tensors forward creates) keep their values.

The key (`cache_key`) is everything the export read that could differ between two runs of one
bundle: the script's arguments and environment (the worker's own variables aside), every module's
class source (and the version of the package defining it), name, training flag and settings
(its extra_repr and plain attributes: heads, eps, rates; a Hugging Face model's config), each
parameter's and buffer's name, shape, dtype, device and gradient flag, the sample's tensor shapes and dtypes and the constant arguments, the
torch version and this package's capture code. The batch's size is not in it: the capture's batch
dimension is dynamic, so one program serves every micro-batch size. The bundle's own files are the directory's key
(the daemon names it by the bundle's digest). A program that fails to load (a partial write, a
torch that reads it differently) is logged and exported again, and written over.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

__all__ = ["FORMAT", "cache_key", "forget", "load", "save"]

log = logging.getLogger("varuna")

FORMAT = 1   # of what is saved; a change makes every earlier entry a miss
_CODE = ("capture.py", "capture_cache.py", "cutpoint.py")   # this package's code that shapes a capture
# variables that differ between a job's workers (VARUNA_: rank, epoch, ports), that torch sets
# itself while exporting (its compiler's cache directory), or that systemd sets per start of the
# daemon: not what a model's code reads
_NOT_READ = ("VARUNA_", "TORCHINDUCTOR_", "TRITON_", "INVOCATION_ID", "JOURNAL_STREAM", "SYSTEMD_EXEC_PID")


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):   # defined in a REPL or a C extension: its name must do
        return f"{cls.__module__}.{cls.__qualname__}"


def _own_code() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in _CODE:
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        # not the batch's size: the capture's batch dimension is dynamic (a capture that fixes
        # it is refused), so one program serves every micro-batch size a plan may choose
        return f"tensor(batch, {', '.join(map(str, value.shape[1:]))}):{value.dtype}"
    return repr(value)


def _settings(m: nn.Module) -> str:
    """A module's settings that are not tensors: what its forward may read beside its weights
    (heads, eps, a dropout rate, a flag). Its extra_repr, and every plain value among its attributes."""
    plain = (bool, int, float, str, type(None))
    found = {}
    for k, v in vars(m).items():
        if k.startswith("_"):
            continue
        if isinstance(v, plain):
            found[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v):
            found[k] = list(v)
    try:
        extra = m.extra_repr()
    except Exception:   # a user's extra_repr that fails says nothing, and must not stop the capture
        extra = ""
    return json.dumps(found, sort_keys=True, default=repr) + "|" + extra


def _version(module_name: str) -> str:
    top = module_name.partition(".")[0]
    mod = sys.modules.get(top)
    return str(getattr(mod, "__version__", "")) if mod is not None else ""


def cache_key(model: nn.Module, inputs: Mapping[str, object], fixed: Mapping[str, object]) -> str:
    """The hex digest a capture of `model` on `inputs` (with the constant arguments `fixed`) is kept under."""
    h = hashlib.sha256()

    def line(*parts: object) -> None:
        h.update(("\x1f".join(map(str, parts)) + "\n").encode())

    line("format", FORMAT, torch.__version__, _own_code())
    line("argv", json.dumps(sys.argv[1:]))
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and os.path.isfile(main):
        line("script", hashlib.sha256(Path(main).read_bytes()).hexdigest())
    line("env", json.dumps(sorted((k, v) for k, v in os.environ.items() if not k.startswith(_NOT_READ))))
    classes: dict[type, None] = {}
    for name, m in model.named_modules():
        classes.setdefault(type(m))
        line("module", name, type(m).__module__, type(m).__qualname__, m.training, _settings(m))
        config = getattr(m, "config", None)   # a Hugging Face model's: attention kind, sizes, flags
        if config is not None and hasattr(config, "to_json_string"):
            line("config", name, config.to_json_string(use_diff=False),
                 getattr(config, "_attn_implementation", None))
    for cls in classes:
        line("class", _source(cls), _version(cls.__module__))
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        line("tensor", name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad, isinstance(t, nn.Parameter))
    for name in sorted(inputs):
        line("input", name, _describe(inputs[name]))
    for name in sorted(fixed):
        line("fixed", name, _describe(fixed[name]))
    return h.hexdigest()[:40]


def _path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / f"capture-{key}.pt2"


def load(cache_dir: str | os.PathLike[str], key: str):
    """The exported program kept under `key`, or None (none kept, or one that does not load)."""
    path = _path(cache_dir, key)
    if not path.is_file():
        return None
    try:
        return torch.export.load(path)
    except Exception as exc:   # a partial write, another torch: any failure means export again
        log.warning("capture: the cached program %s does not load (%s: %s); exporting the model again",
                    path, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return None


def _without_storage(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def save(cache_dir: str | os.PathLike[str], key: str, ep, model: nn.Module) -> Path | None:
    """Keep `ep` under `key`, its parameters and the model's buffers as meta tensors; written to a
    temporary file and renamed, so a reader sees the whole program or none. Returns the path, or
    None where it could not be written (logged: a cache never stops a worker)."""
    path = _path(cache_dir, key)
    owned = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    state, constants, example = ep._state_dict, ep._constants, ep._example_inputs
    try:
        ep._state_dict = {k: _without_storage(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        ep._constants = {k: _without_storage(v) if k in owned and isinstance(v, torch.Tensor) else v
                         for k, v in constants.items()}
        ep._example_inputs = None   # the sample batch: training data has no place in a cache
        path.parent.mkdir(parents=True, exist_ok=True)
        _sweep(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".capture-", suffix=".pt2")   # torch.export wants .pt2
        os.close(fd)
        try:
            torch.export.save(ep, tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path
    except Exception as exc:
        log.warning("capture: could not keep the exported program in %s (%s: %s)", cache_dir, type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    finally:
        ep._state_dict, ep._constants, ep._example_inputs = state, constants, example


_STALE_S = 600   # a temporary this old is a writer's that was killed, not one still writing


def _sweep(directory: Path) -> None:
    """Remove the temporaries of writers killed mid-write (a morph kills workers while they start)."""
    now = time.time()
    for tmp in directory.glob(".capture-*.pt2"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_S:
                tmp.unlink()


def forget(cache_dir: str | os.PathLike[str], key: str) -> None:
    """Drop the program kept under `key` (it loaded, but the capture could not use it)."""
    with contextlib.suppress(FileNotFoundError):
        _path(cache_dir, key).unlink()
