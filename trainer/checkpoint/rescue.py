"""A broken epoch's state, saved from the memory of the workers that survived it.

At a step boundary the D replicas of a stage hold the same parameters and optimizer state. When
a VM vanishes mid-step the survivors abandon the broken step (the engine never lets a failure
land half-way through an optimizer step) and still hold the state after `iteration` completed
steps: usually newer than the store's newest checkpoint. Each survivor writes its stage's layer
files into the ordinary checkpoint directory ``varuna_ckpt_<iteration>``, with no collective
(the process group is broken), then a writers' record naming them under the epoch's rescue
token. The survivor that finds every layer file and a meta file recorded commits the manifest,
marked ``source: replicas``: from then on it is a complete checkpoint like any other, and the
next epoch resumes from it (re-sharded to its own P x D, [Note: state per layer] in ARCHITECTURE.md) without redoing a step.

What keeps it safe:

* the replicas of a stage write byte-identical files (same tensors; torch.save is
  deterministic), so two of them racing on one name leave the same file; a survivor skips
  files another has already recorded;
* the meta file holds per-worker state (the RNG), so each survivor writes its own
  ``meta-rank<r>.pt`` and the manifest names the one it took (``meta_file``);
* a stage none of whose replicas survived is never recorded: the checkpoint stays
  incomplete, is never loaded, and the next epoch resumes from the newest complete one.
  Survivors holding different steps (one stage finished the broken step, another did not)
  write different directories and neither completes;
* the manifest carries the broken epoch, so the epoch fences refuse a rescue that lands after
  a newer epoch chose where to resume (`fences.superseded`).
"""

from __future__ import annotations

import logging
import posixpath
import time

from trainer.checkpoint import contents, fences, reading
from trainer.checkpoint import store as ckpt_store
from trainer.checkpoint.storage import storage_for
from trainer.errors import CheckpointError

__all__ = ["SOURCE", "rescue_token", "save_from_memory"]

log = logging.getLogger("varuna.checkpoint")

SOURCE = "replicas"   # the manifest's meta["source"] for a checkpoint saved by a rescue


def rescue_token(epoch: int) -> str:
    """The writers' token every survivor of `epoch` uses (the same without talking to each other)."""
    fences.check_epoch(epoch)
    return f"{epoch:016x}"


def save_from_memory(v: contents.Checkpointed, store: str) -> str | None:
    """Write this worker's stage as of `v.iteration` completed steps; commit the checkpoint when
    every stage is recorded. Returns its directory once it is complete (by this worker or an
    earlier one), None while other stages are missing. Raises CheckpointError when a newer
    epoch has fenced it out or the store refuses the write."""
    iteration = v.iteration
    ckpt_dir = reading.checkpoint_dir(store, iteration)
    if storage_for(ckpt_dir).exists(posixpath.join(ckpt_dir, reading.MANIFEST)):
        return ckpt_dir   # a checkpoint of this very step (periodic, or another survivor's rescue)
    epoch = contents.epoch_of(v)
    fences.refuse_superseded(store, epoch, iteration)
    start = time.perf_counter()
    token = rescue_token(epoch or 0)
    done = {e.name for es in ckpt_store.read_writer_records(ckpt_dir, token).values() for e in es}
    entries = [ckpt_store.write_tensors(ckpt_dir, name, content)
               for name, content in sorted(contents.stage_files(v, any_replica=True).items()) if name not in done]
    mine = reading.rescue_meta_file(v.rank)
    entries.append(ckpt_store.write_tensors(ckpt_dir, mine, contents.meta_of(v, iteration)))
    ckpt_store.write_writer_record(ckpt_dir, token, v.rank, entries)
    log.info("rank %d: saved stage %d of step %d from memory into %s in %.2fs (%d files)", v.rank, v.stage,
             iteration, ckpt_dir, time.perf_counter() - start, len(entries))
    committed = _commit_if_whole(v, ckpt_dir, token, iteration, epoch, mine)
    if committed is not None:
        _prune(v, store)
    return committed


def _commit_if_whole(v: contents.Checkpointed, ckpt_dir: str, token: str, iteration: int, epoch: int | None,
                     meta_file: str) -> str | None:
    records = ckpt_store.read_writer_records(ckpt_dir, token)
    by_name: dict[str, reading.FileEntry] = {}
    for rank in sorted(records):
        for e in records[rank]:
            if not e.name.startswith("meta-rank") or e.name == meta_file:
                by_name.setdefault(e.name, e)
    missing = sorted(set(v.layout.files.values()) - set(by_name))
    if missing:
        log.info("rank %d: step %d still lacks %d layer file(s) (%s...): another survivor may add them; "
                 "if none does, the next epoch resumes from the newest complete checkpoint",
                 v.rank, iteration, len(missing), missing[0])
        return None
    try:
        ckpt_store.write_manifest(ckpt_dir, list(by_name.values()),
                                  {**contents.manifest_meta(v), "source": SOURCE, "meta_file": meta_file},
                                  iteration=iteration, epoch=epoch)
    except CheckpointError as exc:
        log.warning("rank %d: could not commit step %d saved from memory: %s", v.rank, iteration, exc)
        return None
    return ckpt_dir


def _prune(v: contents.Checkpointed, store: str) -> None:
    """The job's --keep-checkpoints, kept by the survivor that committed: a job that ends here (a
    cancel, its last step) writes no later checkpoint that would prune. Sizes only, no checksums:
    the rescue is on the daemon's clock."""
    try:
        ckpt_store.prune(store, v.assignment.keep_checkpoints, verify_checksums=False)
    except (CheckpointError, OSError) as exc:   # housekeeping: the next checkpoint prunes again
        log.warning("rank %d: could not prune old checkpoints: %s", v.rank, exc)
