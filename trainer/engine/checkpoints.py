"""A worker's checkpoints: written (in place, or staged in a local directory and copied into the
store in the background), settled (the daemon told when one is complete), compared (every
worker's share of a staged one), loaded; through a store outage, a needed one is retried and a
periodic one given up (trainer.engine.store_outage). What a checkpoint holds is
trainer.checkpoint.contents ([Note: state per layer] in ARCHITECTURE.md).

`WorkerCheckpoints` is a part of `trainer.engine.varuna.Varuna`: it reads the worker's
assignment, iteration, control line and store health, and keeps the staged checkpoint in flight
(`_upload`) and whether this worker's share of it failed (`_shares_unsettled`, `_share_failed`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.checkpoint import contents as checkpointing
from trainer.errors import CheckpointError, StoreOutage

__all__ = ["WorkerCheckpoints"]


class WorkerCheckpoints:
    def checkpoint(self, global_store: str, step: int | None = None, tmpdir: str | None = None,
                   shard: bool = False, on_demand: bool = False) -> str:
        """Write this job's state as `global_store/varuna_ckpt_<step>`; collective (every worker calls it).

        With `tmpdir` (a local directory), the state is written there and copied into the store in
        the background while training goes on; the checkpoint is complete (loadable) once rank 0
        has written its manifest, which `wait_checkpoint` waits for. `on_demand` (a preemption
        notice) writes straight into the store and returns when it is complete. Either way the
        staged checkpoint still in flight, if any, is waited for first (a failed one is logged)."""
        self._settle_upload(together=True)
        staged = tmpdir is not None and not on_demand
        if not on_demand:
            # Every worker compares its share at the next checkpoint, whatever this save does and
            # whether its daemon stages: one whose staging directory refused the save (a
            # StoreOutage, given up) once skipped that collective while the others entered it, and
            # the job hung for good. A staged share counts as failed until the save returns, so
            # that the comparison tells rank 0 to stop waiting for its files.
            self._shares_unsettled, self._share_failed = True, staged
        final_dir, self._upload = checkpointing.save(self, global_store, self.iteration if step is None else step,
                                                     tmpdir=tmpdir if staged else None, shard=shard)
        self._share_failed = False
        return final_dir

    def _write_checkpoint(self, *, on_demand: bool) -> str | None:
        """This step's checkpoint through a store outage (trainer.engine.store_outage): one the job
        needs (`on_demand`: the final one, a notice's, a morph's) is retried, the state held in
        memory, until it is written; a periodic one is given up (None) and the next interval
        tries again, while training goes on."""
        a = self.assignment
        what = f"checkpoint {self.iteration}"

        def write() -> str:
            return self.checkpoint(a.store, tmpdir=a.checkpoint_tmpdir, on_demand=on_demand)

        if on_demand:
            return self.store_health.until_written(write, self.iteration, what)
        try:
            path = write()
        except StoreOutage as exc:
            self.store_health.failed(exc, self.iteration, what)
            return None
        if self._upload is None:
            self.store_health.wrote()
        return path

    def wait_checkpoint(self) -> str | None:
        """Wait for the staged checkpoint in flight to reach the store; returns its directory (None
        when there is none). Raises CheckpointError if it failed: it stays incomplete and the
        previous checkpoint is the newest a resume would load."""
        upload = self._settle_upload()
        if upload is None:
            return None
        if upload.error is not None:
            raise CheckpointError(f"checkpoint {upload.iteration} did not reach the store: {upload.error}",
                                  hint="check the store's mount and free space")
        return upload.final_dir

    def _settle_upload(self, *, together: bool = False) -> checkpointing.Upload | None:
        """Wait for the staged checkpoint in flight, tell the daemon if it made it, forget it.
        `together`: every worker calls it (a checkpoint), and they compare their shares first."""
        upload, self._upload = self._upload, None
        if together and self._shares_unsettled:
            self._shares_unsettled = False
            self._compare_shares(upload)
        if upload is not None:
            upload.wait()
            self._share_failed = upload.share_error is not None
            if upload.error is None:
                self.control.checkpointed(upload.iteration, upload.final_dir, upload.stalled_s)
                self.store_health.wrote()
            elif isinstance(upload.error, StoreOutage):
                self.store_health.failed(upload.error, upload.iteration, f"checkpoint {upload.iteration}")
        return upload

    def _compare_shares(self, upload: checkpointing.Upload | None) -> None:
        """Every worker says whether its share of the staged checkpoint before this one reached the
        store; collective. A store can refuse one worker's files and take another's (nearly full):
        rank 0 then stops waiting for files that will never come, instead of holding up this
        checkpoint until its commit deadline."""
        if upload is not None:
            upload.shared.wait()
            self._share_failed = upload.share_error is not None
        failed = torch.tensor([float(self._share_failed)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed[0] > 0 and upload is not None:
            upload.abandon()

    def load_checkpoint(self, global_store: str, iteration: int | None = None, check_complete: bool = True) -> int:
        """Load `varuna_ckpt_<iteration>` (default: the newest complete one); collective.
        Call after set_optimizer so the optimizer state is restored too. Returns the iteration."""
        loaded = checkpointing.load(self, global_store, iteration, check_complete=check_complete)
        self._held_since = self.iteration
        self._scheduler_steps = getattr(self.lr_scheduler, "last_epoch", None)
        return loaded
