"""What a Varuna checkpoint holds, per layer (DESIGN idea 2); `ckpt_store` does the file work.

Every tensor is saved under its name in the user's model, in the file of the layer (cut-point
segment) that first uses it, together with its optimizer state. The manifest's `index` maps
each name to its file, so a worker of any later plan reads only the files of its own layers.
Per-worker facts that do not depend on the plan (iteration, loss scale, learning-rate schedule,
optimizer hyperparameters, RNG) go into `meta.pt`, written by rank 0.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn

from trainer import ckpt_store
from trainer.errors import CheckpointError

__all__ = ["save", "load", "agree"]

log = logging.getLogger("varuna.checkpoint")

META = "meta.pt"


def _my_files(v) -> dict[str, dict]:
    """The files this worker writes: its stage is the lowest owner of their tensors; with
    D replicas, replica 0 writes all of them (or, sharded, every D-th file each)."""
    layout = v.layout
    all_files = sorted(set(layout.files.values()))
    files: dict[str, dict] = {}
    for name, t in v._named.items():
        if layout.writer_stage(name) != v.stage:
            continue
        fname = layout.files[name]
        writer = all_files.index(fname) % v.data_depth if v._shard_checkpoint else 0
        if writer != v.replica:
            continue
        content = files.setdefault(fname, {"params": {}, "buffers": {}, "optim": {}})
        if isinstance(t, nn.Parameter):
            content["params"][name] = t.detach().cpu()
            state = v.optimizer.state.get(t) if v.optimizer is not None else None
            if state:
                content["optim"][name] = {k: (s.detach().cpu() if torch.is_tensor(s) else s)
                                          for k, s in state.items()}
        else:
            content["buffers"][name] = t.detach().cpu()
    return files


def _meta(v, iteration: int) -> dict:
    groups = []
    if v.optimizer is not None:
        for g in v.optimizer.param_groups:
            groups.append({k: val for k, val in g.items() if k != "params"})
    return {
        "iteration": iteration,
        "scaler": v.scaler.state_dict(),
        "param_groups": groups,
        "lr_scheduler": v.lr_scheduler.state_dict() if v.lr_scheduler is not None else None,
        "rng": torch.get_rng_state(),
    }


def save(v, store: str, iteration: int, *, tmpdir: str | None = None, shard: bool = False) -> str:
    start = time.perf_counter()
    v._shard_checkpoint = shard
    final_dir = ckpt_store.checkpoint_dir(store, iteration)
    write_dir = ckpt_store.checkpoint_dir(tmpdir, iteration) if tmpdir else final_dir
    entries = [ckpt_store.write_tensors(write_dir, fname, content)
               for fname, content in sorted(_my_files(v).items())]
    if v.rank == 0:
        entries.append(ckpt_store.write_tensors(write_dir, META, _meta(v, iteration)))
    if tmpdir:
        for e in entries:
            _copy_file(write_dir, final_dir, e.name)
        shutil.rmtree(write_dir, ignore_errors=True)
    gathered: list[list | None] = [None] * v.assignment.world_size
    dist.all_gather_object(gathered, entries)
    if v.rank == 0:
        meta = {"P": v.pipeline_depth, "D": v.data_depth, "cuts": list(v.cuts),
                "index": dict(sorted(v.layout.files.items()))}
        ckpt_store.write_manifest(final_dir, [e for es in gathered for e in es], meta, iteration=iteration)
    dist.barrier()
    log.info("rank %d: checkpoint %d written to %s in %.2fs", v.rank, iteration, final_dir,
             time.perf_counter() - start)
    return final_dir


def _copy_file(src_dir: str, dst_dir: str, name: str) -> None:
    os.makedirs(dst_dir, exist_ok=True)
    tmp = posixpath.join(dst_dir, f".{name}.copying.{os.getpid()}")
    shutil.copyfile(posixpath.join(src_dir, name), tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, posixpath.join(dst_dir, name))


def agree(v, fn):
    """Run `fn` on rank 0 and hand every rank its result, or the same exception."""
    box: list[object] = [None]
    if v.rank == 0:
        try:
            box[0] = fn()
        except Exception as exc:   # every rank must raise it, not only rank 0
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def load(v, store: str, iteration: int | None, *, check_complete: bool = True) -> int:
    start = time.perf_counter()
    if iteration is None:
        iteration = agree(v, lambda: ckpt_store.latest_complete(store, verify_checksums=check_complete))
        if iteration is None:
            raise CheckpointError(f"no complete checkpoint in {store}",
                                  hint="train from scratch, or point global_store at the job's store")
    ckpt_dir = ckpt_store.checkpoint_dir(store, iteration)
    manifest = agree(v, lambda: ckpt_store.verify(ckpt_dir, checksums=check_complete))
    index = manifest["meta"]["index"]
    missing = sorted(n for n in v._named if n not in index)
    if missing:
        raise CheckpointError(f"checkpoint {iteration} has no {missing[:5]}",
                              hint="it was written by a different model")
    for fname in sorted({index[n] for n in v._named}):
        content = ckpt_store.read_tensors(ckpt_dir, fname)
        for kind in ("params", "buffers"):
            for name, saved in content.get(kind, {}).items():
                if name in v._named:
                    _copy_into(v._named[name], saved, name, iteration)
        if v.optimizer is not None:
            for name, state in content.get("optim", {}).items():
                if name in v._named:
                    p = v._named[name]
                    v.optimizer.state[p] = {k: (s.to(p.device) if torch.is_tensor(s) else s)
                                            for k, s in state.items()}
    meta = ckpt_store.read_tensors(ckpt_dir, META)
    _restore_meta(v, meta, iteration)
    dist.barrier()
    log.info("rank %d: loaded checkpoint %d (written by %sx%s) in %.2fs", v.rank, iteration,
             manifest["meta"].get("P"), manifest["meta"].get("D"), time.perf_counter() - start)
    return iteration


def _copy_into(t: torch.Tensor, saved: torch.Tensor, name: str, iteration: int) -> None:
    if saved.shape != t.shape:
        raise CheckpointError(f"checkpoint {iteration}: {name} has shape {tuple(saved.shape)}, "
                              f"the model's is {tuple(t.shape)}", hint="it was written by a different model")
    with torch.no_grad():
        t.copy_(saved)


def _restore_meta(v, meta: dict, iteration: int) -> None:
    if v.optimizer is not None and meta["param_groups"]:
        if len(meta["param_groups"]) != len(v.optimizer.param_groups):
            raise CheckpointError(f"checkpoint {iteration} has {len(meta['param_groups'])} optimizer "
                                  f"parameter groups, this optimizer {len(v.optimizer.param_groups)}")
        for group, saved in zip(v.optimizer.param_groups, meta["param_groups"]):
            group.update(saved)
    if v.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        v.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    v.scaler.load_state_dict(meta["scaler"])
    torch.set_rng_state(meta["rng"])
    v.iteration = int(meta["iteration"])
