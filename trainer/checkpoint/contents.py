"""What a Varuna checkpoint holds, per layer ([Note: state per layer] in ARCHITECTURE.md); `ckpt_store` does the file work.

Every tensor is saved under its name in the user's model, in the file of the layer (cut-point
segment) that first uses it, together with its optimizer state. The manifest's `index` maps
each name to its file, so a worker of any later plan reads only the files of its own layers.
Per-worker facts that do not depend on the plan (iteration, loss scale, learning-rate schedule,
optimizer hyperparameters, RNG) go into `meta.pt`, written by rank 0.

Staged checkpoints (a `tmpdir`, as in Varuna's API): each worker writes its files to a local
directory, which takes the state as it is now, and a background thread copies them into the
store while training goes on. No collective can run in that thread (it would interleave with
the training's own), so completion travels through the store: each worker, once its files are
in place, writes a record naming them (`ckpt_store.write_writer_record`); rank 0's thread
waits for all of them and only then writes the manifest. Until then the checkpoint is
incomplete and never loaded. One staged checkpoint is in flight at a time; the next one, an
on-demand one and `close` wait for it.

Under the daemon every checkpoint carries the plan epoch it was written in, and rank 0 of an
epoch fences the store when it chooses where to resume (`resume_point`): a checkpoint an older
epoch commits past that point, a cut-off incarnation's late write, is refused and never loaded
(`fences.superseded`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import posixpath
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import fences, reading
from trainer.checkpoint import store as ckpt_store
from trainer.checkpoint.model_record import MANIFEST_KEY as MODEL_RECORD
from trainer.checkpoint.storage import storage_for
from trainer.errors import ANOTHER_MODEL, CheckpointError, StoreOutage
from trainer.planning.parallel import ParallelPlan

__all__ = ["save", "load", "agree", "resume_point", "Upload", "Checkpointed", "stage_files", "meta_of",
           "manifest_meta", "epoch_of", "META", "LOSSES"]

log = logging.getLogger("varuna.checkpoint")

META = "meta.pt"
LOSSES = "losses"   # manifest meta: the epoch that trained the steps before the checkpoint, and their losses


class _Placement(Protocol):
    epoch: int            # the plan epoch (0 outside the daemon)
    world_size: int
    keep_checkpoints: int  # complete checkpoints a rescue's commit leaves in the store


class _Layout(Protocol):
    files: Mapping[str, str]   # tensor name -> the file of the layer that first uses it
    untrained: frozenset[str]  # names forward never uses (a checkpoint may lack them)

    def writer_stage(self, name: str) -> int: ...


class Checkpointed(Protocol):
    """What this module reads of a worker (`trainer.engine.varuna.Varuna` is one): where it sits in
    the P x D grid, the tensors its stage owns, and the training state beside them. `load`
    writes the tensors, the optimizer's state and `iteration` back."""

    rank: int
    stage: int
    replica: int
    plan: ParallelPlan
    cuts: Sequence[Any]
    layout: _Layout
    assignment: _Placement
    device: torch.device
    optimizer: torch.optim.Optimizer | None
    scaler: Any                # LossScaler: state_dict / load_state_dict
    lr_scheduler: Any | None
    iteration: int
    # optional: trainer.checkpoint.model_record.ModelRecord, the user's names kept for an export

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """Every parameter and buffer this stage owns, by its name in the user's model."""
        ...


class _Ranked(Protocol):
    rank: int


def stage_files(v: Checkpointed, shard: bool = False, *, any_replica: bool = False) -> dict[str, dict]:
    """The files this worker writes: its stage is the lowest owner of their tensors; with
    D replicas, replica 0 writes all of them (or, sharded, every D-th file each). `any_replica`:
    all of its stage's files, whichever replica it is (a rescue, trainer.checkpoint.rescue)."""
    layout = v.layout
    all_files = sorted(set(layout.files.values()))
    files: dict[str, dict] = {}
    for name, t in v.named_tensors().items():
        if layout.writer_stage(name) != v.stage:
            continue
        fname = layout.files[name]
        writer = all_files.index(fname) % v.plan.D if shard else 0
        if writer != v.replica and not any_replica:
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


def meta_of(v: Checkpointed, iteration: int) -> dict:
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
        # dropout on a GPU draws from the device's generator, not the CPU's
        "cuda_rng": torch.cuda.get_rng_state(v.device) if v.device.type == "cuda" else None,
    }


def epoch_of(v: Checkpointed) -> int | None:
    """The plan epoch this worker runs in (None outside the daemon: its checkpoints are not fenced)."""
    return v.assignment.epoch or None


def resume_point(v: Checkpointed, store: str) -> int | None:
    """The newest complete checkpoint to resume from (None: none), agreed by every rank; rank 0
    fences the store with it first, so that nothing an older epoch commits later is loaded."""
    def choose() -> int | None:
        newest = ckpt_store.latest_complete(store)
        if epoch_of(v) is not None:
            fences.write_epoch_fence(store, epoch_of(v), newest)
        return newest
    return agree(v, choose)


def save(v: Checkpointed, store: str, iteration: int, *, tmpdir: str | None = None,
         shard: bool = False) -> tuple[str, Upload | None]:
    """Write checkpoint `iteration`; collective. Returns its directory in the store and, with
    `tmpdir`, the background `Upload` that copies it there from where it was staged (the caller
    keeps it and waits for it before the next one); without, None: it was written in place.
    Refused (CheckpointError on every rank) when a newer epoch has fenced it out."""
    start = time.perf_counter()
    final_dir = reading.checkpoint_dir(store, iteration)
    epoch = epoch_of(v)

    def not_superseded(then):
        fences.refuse_superseded(store, epoch, iteration)
        return then()

    if tmpdir:
        # The same name from every rank; a record of an earlier, dead run is never counted.
        token = agree(v, lambda: not_superseded(lambda: uuid.uuid4().hex))
        # per rank: the workers of a VM share the tmpdir, and each removes its own when copied
        stage_dir = reading.checkpoint_dir(os.path.join(tmpdir, f"rank{v.rank}"), iteration)
        entries = _write_mine(v, stage_dir, iteration, shard)
        stalled = time.perf_counter() - start
        upload = Upload(stage_dir, final_dir, entries, iteration=iteration, token=token, rank=v.rank,
                           world=v.assignment.world_size, meta=manifest_meta(v) if v.rank == 0 else None,
                           stalled_s=stalled, epoch=epoch)
        log.info("rank %d: checkpoint %d staged in %s in %.2fs; copying it to %s in the background", v.rank,
                 iteration, stage_dir, stalled, final_dir)
        return final_dir, upload
    if epoch is not None:
        agree(v, lambda: not_superseded(lambda: None))
    # A store outage on one worker's files must end the checkpoint on every worker, the same
    # way: each says how its share went, and nobody commits what a peer could not write.
    mine: list[reading.FileEntry] | StoreOutage
    written: list[reading.FileEntry] = []
    try:
        mine = _write_mine(v, final_dir, iteration, shard, written)
    except StoreOutage as exc:
        mine = exc.at_step(iteration)
    gathered: list[list | StoreOutage | None] = [None] * v.assignment.world_size
    dist.all_gather_object(gathered, mine)
    outage = next((g for g in gathered if isinstance(g, StoreOutage)), None)
    if outage is not None:
        _forget(final_dir, written)
        raise outage
    entries = [e for es in gathered for e in es]
    try:   # agree, not a barrier: a manifest rank 0 could not write fails the checkpoint on every rank
        agree(v, lambda: ckpt_store.write_manifest(final_dir, entries, manifest_meta(v), iteration=iteration,
                                                   epoch=epoch))
    except StoreOutage:
        _forget(final_dir, written)
        raise
    log.info("rank %d: checkpoint %d written to %s in %.2fs", v.rank, iteration, final_dir,
             time.perf_counter() - start)
    return final_dir, None


def _write_mine(v: Checkpointed, directory: str, iteration: int, shard: bool,
                written: list[reading.FileEntry] | None = None) -> list[reading.FileEntry]:
    """This worker's files of checkpoint `iteration`, each appended to `written` once it is in place."""
    entries = [] if written is None else written
    for fname, content in sorted(stage_files(v, shard).items()):
        entries.append(ckpt_store.write_tensors(directory, fname, content))
    if v.rank == 0:
        entries.append(ckpt_store.write_tensors(directory, META, meta_of(v, iteration)))
    return entries


def _forget(directory: str, written: list[reading.FileEntry]) -> None:
    """Remove the files a checkpoint that will never be committed left: a full store needs the
    space back (each file was written by this worker alone; a read-only store keeps them)."""
    storage = storage_for(directory)
    for e in written:
        with contextlib.suppress(OSError):
            storage.remove(posixpath.join(directory, e.name))


def manifest_meta(v: Checkpointed) -> dict:
    meta = {"P": v.plan.P, "D": v.plan.D, "cuts": list(v.cuts),
            "index": dict(sorted(v.layout.files.items()))}
    # the user's state_dict names, for an export (trainer.checkpoint.export); a worker that was
    # never given its model's record (a test's stand-in) writes a checkpoint that only loads
    record = getattr(v, "model_record", None)
    if record is not None:
        meta[MODEL_RECORD] = record.to_dict()
    # the losses of the steps before it: where the daemon holding them dies before it writes them
    # into the loss history, nobody trains them again (varunad.control.resume gives them back)
    recent, epoch = getattr(v, "recent_losses", ()), epoch_of(v)
    if recent and epoch is not None:
        # a diverged step's NaN as null: the manifest is strict JSON, and a NaN in it failed every
        # checkpoint of a diverged job (varunad.control.resume reads null back as NaN)
        meta[LOSSES] = {"epoch": epoch, "steps": [[step, loss if math.isfinite(loss) else None]
                                                  for step, loss in recent if step < v.iteration]}
    return meta


# Rank 0 gives the other workers this long to put their files in place before it leaves the
# checkpoint incomplete (they copy as fast as the store takes it; a dead one never will).
COMMIT_TIMEOUT_S = float(os.environ.get("VARUNA_CHECKPOINT_COMMIT_TIMEOUT", "1800"))


class Upload:
    """One staged checkpoint on its way into the store, in a daemon thread (see the module doc)."""

    def __init__(self, stage_dir: str, final_dir: str, entries: list[reading.FileEntry], *, iteration: int,
                 token: str, rank: int, world: int, meta: dict | None, timeout_s: float = COMMIT_TIMEOUT_S,
                 stalled_s: float = 0.0, epoch: int | None = None) -> None:
        self.iteration, self.final_dir, self.epoch = iteration, final_dir, epoch
        self.stalled_s = stalled_s   # what staging cost the training thread
        self.error: BaseException | None = None
        # This worker's own files and record: in place, or `share_error` says why not. Set before
        # rank 0 waits for the others', so that the workers can tell each other how theirs went.
        self.shared = threading.Event()
        self.share_error: BaseException | None = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(stage_dir, entries, token, rank, world, meta, timeout_s),
            name=f"varuna-upload-{iteration}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the upload has ended (its error, if any, is in `error`)."""
        self._thread.join(timeout)
        return self.done()

    def abandon(self) -> None:
        """Stop waiting for the other workers' files: one of them could not write its share (a
        store that refused it), so the checkpoint stays incomplete."""
        self._abandoned.set()

    def _run(self, stage_dir, entries, token, rank, world, meta, timeout_s) -> None:
        start = time.perf_counter()
        copied: list[reading.FileEntry] = []
        try:
            # a newer epoch may have started while this one staged: then not a file is copied
            fences.refuse_superseded(posixpath.dirname(self.final_dir.rstrip("/")), self.epoch, self.iteration)
            for e in entries:
                ckpt_store.copy_file(stage_dir, self.final_dir, e)
                copied.append(e)
            ckpt_store.write_writer_record(self.final_dir, token, rank, entries)
            self.shared.set()
            if meta is not None:
                self._commit(token, world, meta, timeout_s)
            log.info("rank %d: checkpoint %d copied to %s in %.2fs", rank, self.iteration, self.final_dir,
                     time.perf_counter() - start)
        except BaseException as exc:   # kept for the training thread, which raises or logs it
            self.error = exc
            if not self.shared.is_set():
                self.share_error = exc
            if isinstance(exc, StoreOutage) or self._abandoned.is_set():   # never committed: give the space back
                _forget(self.final_dir, copied)
            log.error("rank %d: staged checkpoint %d did not reach %s: %s", rank, self.iteration,
                      self.final_dir, exc)
        finally:
            self.shared.set()
            shutil.rmtree(stage_dir, ignore_errors=True)

    def _commit(self, token: str, world: int, meta: dict, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            records = ckpt_store.read_writer_records(self.final_dir, token)
            if set(range(world)) <= set(records):
                break
            if self._abandoned.is_set():
                raise CheckpointError(f"checkpoint {self.iteration}: another worker could not write its files into "
                                      f"{self.final_dir}; it stays incomplete",
                                      hint="that worker's log says why (a full or read-only store?); the next "
                                           "checkpoint tries again")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(records))
                raise CheckpointError(f"checkpoint {self.iteration}: ranks {missing} did not finish copying "
                                      f"their files into {self.final_dir}; it stays incomplete",
                                      hint="a worker died or the store is too slow; the previous checkpoint "
                                           "is the one a resume loads")
            self._abandoned.wait(0.1)
        ckpt_store.write_manifest(self.final_dir, [e for r in sorted(records) for e in records[r]], meta,
                                  iteration=self.iteration, epoch=self.epoch)


def agree(v: _Ranked, fn):
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


def load(v: Checkpointed, store: str, iteration: int | None, *, check_complete: bool = True) -> int:
    start = time.perf_counter()
    if iteration is None:
        iteration = agree(v, lambda: ckpt_store.latest_complete(store, verify_checksums=check_complete))
        if iteration is None:
            raise CheckpointError(f"no complete checkpoint in {store}{_why_none(store, check_complete)}",
                                  hint="train from scratch, or point global_store at the job's store")
    ckpt_dir = reading.checkpoint_dir(store, iteration)
    manifest = agree(v, lambda: reading.verify(ckpt_dir, checksums=check_complete))
    index = manifest["meta"]["index"]
    group_of = {id(q): g for g in v.optimizer.param_groups for q in g["params"]} if v.optimizer is not None else {}
    named = v.named_tensors()
    # a checkpoint of an older release has no tensors forward never uses: they keep their values
    missing = sorted(n for n in named if n not in index and n not in v.layout.untrained)
    if missing:
        raise CheckpointError(f"checkpoint {iteration} has no {missing[:5]}",
                              hint=ANOTHER_MODEL)
    for fname in sorted({index[n] for n in named if n in index}):
        content = reading.read_tensors(ckpt_dir, fname)
        for kind in ("params", "buffers"):
            for name, saved in content.get(kind, {}).items():
                if name in named:
                    _copy_into(named[name], saved, name, iteration)
        if v.optimizer is not None:
            for name, state in content.get("optim", {}).items():
                if name in named:
                    p = named[name]
                    v.optimizer.state[p] = _optimizer_state_on(group_of.get(id(p), {}), p, state)
    # a rescue names the meta file of the survivor whose copy it took (trainer.checkpoint.rescue)
    meta = reading.read_tensors(ckpt_dir, manifest["meta"].get("meta_file", META))
    _restore_meta(v, meta, iteration)
    dist.barrier()
    log.info("rank %d: loaded checkpoint %d (written by %sx%s) in %.2fs", v.rank, iteration,
             manifest["meta"].get("P"), manifest["meta"].get("D"), time.perf_counter() - start)
    return iteration


def _optimizer_state_on(group: dict, p: torch.Tensor, state: dict) -> dict:
    """`state` placed as the optimizer (whose parameter group of `p` is `group`) keeps it: tensors
    on the parameter's device, except a scalar 'step', which torch's optimizers keep on the CPU
    unless fused or capturable (on a GPU it would cost a device sync per parameter per step)."""
    step_on_device = bool(group.get("fused") or group.get("capturable"))

    def place(k, s):
        if not torch.is_tensor(s):
            return s
        if k == "step" and s.dim() == 0 and not step_on_device:
            return s.to("cpu")
        return s.to(p.device)

    return {k: place(k, s) for k, s in state.items()}


def _why_none(store: str, checksums: bool) -> str:
    """What is wrong with the newest of the checkpoints there, if there are any."""
    found = reading.list_checkpoints(store)
    if not found:
        return ""
    try:
        reading.verify(reading.checkpoint_dir(store, found[-1]), checksums=checksums)
    except CheckpointError as exc:
        return f" ({len(found)} there, none complete; the newest, {found[-1]}: {exc})"
    return ""


def _copy_into(t: torch.Tensor, saved: torch.Tensor, name: str, iteration: int) -> None:
    if saved.shape != t.shape:
        raise CheckpointError(f"checkpoint {iteration}: {name} has shape {tuple(saved.shape)}, "
                              f"the model's is {tuple(t.shape)}", hint=ANOTHER_MODEL)
    with torch.no_grad():
        t.copy_(saved)


def _restore_meta(v: Checkpointed, meta: dict, iteration: int) -> None:
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
    if v.device.type == "cuda" and meta.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(meta["cuda_rng"], v.device)
    v.iteration = int(meta["iteration"])
