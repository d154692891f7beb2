"""A checkpoint out of the store as the user's own model: safetensors files under the names of
the model's `state_dict`, which the user's class loads with `load_state_dict(strict=True)` and,
for a Hugging Face model, `from_pretrained`.

Memory stays bounded by one checkpoint file, never the model: the checkpoint holds one file
per layer (cut-point segment), and each becomes one shard of Hugging Face's sharded layout
(`model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`), read, written and
dropped before the next. A checkpoint of one file gives one `model.safetensors`.

Names come from the record the writer keeps in the manifest (`trainer.checkpoint.model_record`):
each `state_dict` key with the checkpoint name holding its value. A tied tensor is written
under every key the `state_dict` has for it (as a copy: safetensors keeps no shared storage),
so strict loading finds each; `from_pretrained` ties them again. Non-persistent buffers are
left out, as `state_dict` leaves them out.

May import: trainer.checkpoint.reading, .store, .model_record, trainer.errors, torch, safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from trainer.checkpoint import reading
from trainer.checkpoint import store as ckpt_store
from trainer.checkpoint.model_record import MANIFEST_KEY, ModelRecord
from trainer.errors import ANOTHER_MODEL, CheckpointError

__all__ = ["Exported", "export_checkpoint", "SINGLE", "INDEX", "CONFIG"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote, and how to load it."""

    out: str
    step: int
    module: str                   # the submodule exported: "" the whole model, else its prefix ("lm.")
    model_class: str              # the class whose state_dict the files hold
    files: tuple[str, ...]        # written into `out`, shards first
    tensors: int
    total_bytes: int
    largest_read: int             # bytes of the largest checkpoint file read: what the export held at once
    pretrained: bool              # the files are a Hugging Face model's: from_pretrained loads them
    config: bool                  # config.json written (from_pretrained needs no config= then)
    missing: tuple[str, ...]      # state_dict keys the checkpoint has no value for (never used by forward)
    left_out: int                 # state_dict keys outside `module`


def export_checkpoint(store: str, out: str | os.PathLike[str], step: int | None = None, *,
                      module: str | None = None, verify_checksums: bool = True) -> Exported:
    """Write checkpoint `step` of `store` (default: the newest complete one) into the new or
    empty directory `out` as safetensors under the user's parameter names.

    `module`: the submodule whose state_dict to write, by its path in the model given to
    Varuna ("" for that model itself); default the Hugging Face model inside it, if the
    checkpoint recorded one, else the whole model. Only a complete checkpoint is exported;
    CheckpointError says why one is not."""
    out = os.fspath(out)
    _check_empty(out)   # before the checkpoint is read and hashed, which takes a while
    step, ckpt_dir, manifest = _complete(store, step, verify_checksums)
    record = _record_of(manifest, ckpt_dir, step, store)
    prefix = _prefix(record, module)
    names = record.names_under(prefix)
    index: Mapping[str, str] = manifest["meta"].get("index") or {}
    missing = tuple(k for k, c in names.items() if c not in index)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for key, name in names.items():
        if name in index:
            by_file.setdefault(index[name], []).append((key, name))
    if not by_file:
        raise CheckpointError(f"checkpoint {step} in {store} holds none of the tensors of "
                              f"{prefix.rstrip('.') or 'the model'}",
                              hint=f"{ANOTHER_MODEL}; check --module")
    save_file = _safetensors_save()
    _check_empty(out)
    made = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    written: list[str] = []
    try:
        total, largest, weight_map, config = _write_files(out, ckpt_dir, manifest, by_file, record, prefix,
                                                          save_file, written)
    except BaseException as exc:
        # nothing half-written stays behind: a partial export would be refused as a non-empty
        # directory on the next try, or worse, loaded
        _remove(out, written, made)
        reason = _io_reason(exc)
        if reason is None:
            raise
        need = sum(_size(f, manifest) for f in by_file)
        raise CheckpointError(f"writing the export into {out} failed: {reason}; what it had written was removed",
                              hint=f"it needs about {need / 2**20:.1f} MiB there; free some, or export elsewhere"
                              ) from None
    pretrained = prefix == record.pretrained_prefix and record.pretrained_class is not None
    if pretrained:
        model_class = record.pretrained_class
    else:
        model_class = record.model_class + (f" (its submodule {prefix.rstrip('.')})" if prefix else "")
    return Exported(out=out, step=step, module=prefix, model_class=model_class,
                    files=tuple(written), tensors=len(weight_map), total_bytes=total, largest_read=largest,
                    pretrained=pretrained, config=config, missing=missing, left_out=len(record.state_dict) - len(names))


def _write_files(out: str, ckpt_dir: str, manifest: dict, by_file: dict[str, list[tuple[str, str]]],
                 record: ModelRecord, prefix: str, save_file, written: list[str]
                 ) -> tuple[int, int, dict[str, str], bool]:
    """The shards, their index and the config into ``out``; each name goes into ``written`` as
    its file is begun. (total bytes, largest checkpoint file read, weight map, config written)."""
    files = sorted(by_file)
    shard_names = [SINGLE] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map: dict[str, str] = {}
    total = largest = 0
    for fname, shard in zip(files, shard_names):
        largest = max(largest, _size(fname, manifest))
        tensors = _shard(ckpt_dir, fname, by_file[fname])
        written.append(shard)
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors   # one file's tensors at a time
    if len(files) > 1:
        written.append(INDEX)
        _write_json(os.path.join(out, INDEX), {"metadata": {"total_size": total},
                                               "weight_map": dict(sorted(weight_map.items()))})
    config = prefix == record.pretrained_prefix and record.config is not None
    if config:   # written last: a directory with config.json holds a whole export
        written.append(CONFIG)
        _write_json(os.path.join(out, CONFIG), dict(record.config))
    return total, largest, weight_map, config


def _remove(out: str, written: list[str], made: bool) -> None:
    for name in written:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(out, name))
    if made:
        with contextlib.suppress(OSError):
            os.rmdir(out)


_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")


def _io_reason(exc: BaseException) -> str | None:
    """What went wrong writing, in words (a full disk: "No space left on device"), or None for an
    error that is not the file system's."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if type(exc).__name__ == "SafetensorError":   # its text wraps the OS error: "... (os error 28)"
        m = _OS_ERROR.search(str(exc))
        return os.strerror(int(m.group(1) or m.group(2))) if m else str(exc)
    return None


def _complete(store: str, step: int | None, checksums: bool) -> tuple[int, str, dict]:
    """The checkpoint to export, verified complete, with its manifest."""
    if step is None:
        step = ckpt_store.latest_complete(store, verify_checksums=checksums)
        if step is None:
            found = reading.list_checkpoints(store)
            why = ""
            if found:
                try:
                    reading.verify(reading.checkpoint_dir(store, found[-1]), checksums=checksums)
                except CheckpointError as exc:
                    why = f" ({len(found)} there, none complete; the newest, {found[-1]}: {exc})"
            raise CheckpointError(f"no complete checkpoint in {store}{why}",
                                  hint="check the store path, or let the job write a checkpoint first")
    elif step not in (found := reading.list_checkpoints(store)):
        raise CheckpointError(f"no checkpoint {step} in {store}; it has {found or 'none'}",
                              hint="pick one of those, or leave the step out for the newest complete one" if found
                              else "let the job write a checkpoint first (its --checkpoint-every), or check the store")
    ckpt_dir = reading.checkpoint_dir(store, step)
    return step, ckpt_dir, reading.verify(ckpt_dir, checksums=checksums)


def _record_of(manifest: dict, ckpt_dir: str, step: int, store: str) -> ModelRecord:
    doc = manifest["meta"].get(MANIFEST_KEY)
    if doc is None:
        raise CheckpointError(f"checkpoint {step} in {store} does not record the model's parameter names "
                              "(it was written by a varunad release before export)",
                              hint="resume the job with this release and export the next checkpoint it writes")
    try:
        return ModelRecord.from_dict(doc)
    except (TypeError, ValueError) as exc:
        raise reading.broken(ckpt_dir, f"corrupt: its model record is not valid ({exc})") from None


def _prefix(record: ModelRecord, module: str | None) -> str:
    if module is None:
        return record.pretrained_prefix or ""
    prefix = module.strip(".")
    prefix = f"{prefix}." if prefix else ""
    if prefix and not any(k.startswith(prefix) for k in record.state_dict):
        tops = sorted({k.split(".", 1)[0] for k in record.state_dict if "." in k})
        raise CheckpointError(f"{record.model_class} has no parameters or buffers under '{module}'",
                              hint=f"name a submodule that has some, one of {tops[:10]}, or '' for the whole model")
    return prefix


def _check_empty(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} exists and is not an empty directory",
                              hint="export into a new directory (files of an earlier export would mix with these)")


def _size(fname: str, manifest: dict) -> int:
    return next((f["size"] for f in manifest["files"] if f["name"] == fname), 0)


def _shard(ckpt_dir: str, fname: str, wanted: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file under the user's keys (its optimizer state dropped)."""
    content = reading.read_tensors(ckpt_dir, fname)
    pool = {**content.get("params", {}), **content.get("buffers", {})}
    del content
    shard: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, name in wanted:
        t = pool.get(name)
        if not isinstance(t, torch.Tensor):
            raise reading.broken(ckpt_dir, f"corrupt: {fname} lacks {name}, which its manifest's index places there")
        shard[key] = _standalone(t, seen)
    return shard


def _standalone(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """`t` with storage of its own: safetensors refuses tensors that share memory (a tied
    tensor written under two keys, views the checkpoint kept)."""
    t = t.detach()
    storage = t.untyped_storage()
    whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
    if not whole or storage.data_ptr() in seen:
        t = t.clone(memory_format=torch.contiguous_format)
    seen.add(t.untyped_storage().data_ptr())
    return t


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _safetensors_save():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("exporting a checkpoint needs safetensors, which is not installed",
                              hint="pip install safetensors") from None
    return save_file
