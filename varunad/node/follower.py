"""The plan follower: this daemon applies each new plan epoch to its own workers.

It watches ``plan`` in etcd and reads the plan back at each event, at start and at least once a
TTL (a silent watch is not trusted); a pushed PlanChanged only makes it read at once
([Note: etcd holds the truth]). A ``run`` plan that has this member starts its workers with the
job's files (the spec, its signature when the daemon takes only signed jobs, the unpacked
bundle); a ``profile`` plan for this member starts a calibration run, whose file it stores for
the leader; ``stop`` and ``idle`` plans stop the workers.

``PlanFollowing`` is a part of ``varunad.node.daemon.Daemon``: it acts on its supervisor, link
prober and membership, and keeps (in attributes the daemon sets up) the epoch it applied last
(``applied_epoch``), the plan's revision it read last (``plan_read_at``, under the lock
``_plan_reading``) and the jobs whose files it has unpacked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from pathlib import Path

from trainer.planning.calibration import Calibration
from varunad.cluster.revision_floor import raise_revision_past
from varunad.control.fleet import read_plan, usable_spec
from varunad.control.jobs import BundleError, JobSpec, JobSpecError, script_fingerprint, unpack_bundle
from varunad.control.plans import PlanDoc
from varunad.node.housekeeping import BUNDLES, job_dir, prune_jobs
from varunad.node.signing import SigningError
from varunad.store.contract import StoreError

__all__ = ["FILES_PATIENCE", "PlanFollowing"]

log = logging.getLogger("varunad")   # the daemon's log: its lines keep their logger name

FILES_PATIENCE = 30.0   # seconds a new epoch's start retries reading the job's files from etcd


class PlanFollowing:
    _raised_for = -1   # the applied epoch this daemon last moved etcd's revision past (_history_went_back)

    async def _read_plan(self, why: str, *, seen: int = 0) -> None:
        """Read the plan and apply it. `seen`: the revision that prompted the read (a watch
        event's, a pushed epoch); none is made if a read since has returned that plan. A new plan
        reaches every VM twice, pushed and watched, and at 300 VMs the reads of both at once
        timed out on a loaded host."""
        async with self._plan_reading:
            if seen and self.plan_read_at >= seen:
                return
            try:
                doc, epoch = await read_plan(self.store, self.keys, timeout=self.config.retry_timeout)
            except StoreError as exc:
                log.warning("%s: cannot read the plan (%s): %s", self.name, why, exc)
                return
            self.plan_read_at = epoch
        if doc is not None:
            await self._apply(doc, epoch)

    async def _check_plan(self) -> None:
        """A silent watch's check: one read of the plan key, and the whole read (with its writer
        check) only if the key changed since (two reads a TTL from every VM were a fifth of a
        big fleet's etcd load at rest)."""
        try:
            kv = await self.store.get(self.keys.plan, timeout=self.config.retry_timeout)
        except StoreError as exc:
            log.warning("%s: cannot read the plan (periodic check): %s", self.name, exc)
            return
        if kv is None or kv.mod_revision != self.plan_read_at:
            await self._read_plan("periodic check")

    async def _follow_plan(self) -> None:
        while True:
            watch = self.store.watch(self.keys.plan)
            try:
                await watch.start(timeout=self.config.retry_timeout)
                await self._read_plan("start of the plan watch")
                while True:
                    event = await watch.next(timeout=self.config.ttl)
                    if event is None:
                        await self._check_plan()  # a silent watch (frozen etcd) is not trusted
                    elif event.kind == "put":
                        # read back, not taken from the event: read_plan checks who wrote it (a
                        # plan no leader wrote is skipped and the plan in force stays)
                        await self._read_plan(f"a put at revision {event.revision}", seen=event.revision)
            except StoreError as exc:
                log.debug("%s: plan watch broke (%s); watching again", self.name, exc)
                await asyncio.sleep(min(1.0, self.config.loop_wait))
            finally:
                await watch.cancel()

    async def _apply(self, doc: PlanDoc, epoch: int) -> None:
        async with self._apply_lock:
            if epoch <= self.applied_epoch:
                if epoch < self.applied_epoch:
                    self._history_went_back(epoch)
                return
            self.applied_epoch = epoch
            log.info("%s: plan epoch %d: %s %s (%s)", self.name, epoch, doc.kind, doc.job or "", doc.reason)
            sup = self.supervisor
            if doc.kind == "idle":
                sup.stop(None, None, checkpoint=False, reason=doc.reason)
            elif doc.kind == "stop":
                sup.stop(doc.job, doc.stop_epoch, checkpoint=doc.checkpoint, reason=doc.reason,
                         grace=0.0 if doc.kill else None)
            elif self.draining:
                return
            elif doc.kind == "run":
                await self._start_run(doc, epoch)
            elif doc.kind == "profile" and doc.profile_member == self.name:
                await self._start_profile(doc, epoch)

    def _history_went_back(self, epoch: int) -> None:
        """A leader's plan older than the epoch this daemon applied: plan epochs are etcd revisions,
        which go back only when etcd lost its data or was restored from an older copy. Move etcd's
        revision past the epoch applied (varunad.cluster.revision_floor), once: the leader's next
        plan is then newer than it, and the leader re-plans the workers of an epoch etcd no
        longer holds. Meanwhile the older plans are not applied: they would start workers of an
        epoch the store's fences refuse."""
        applied = self.applied_epoch
        if self._raised_for == applied:   # once per epoch applied; the leader re-plans next
            return
        self._raised_for = applied
        self.supervisor.reporter.mark()   # the report etcd restored may name an older epoch: the leader reads this one
        log.error("%s: the plan's epoch %d is older than epoch %d, which this daemon applied: etcd's history went "
                  "back (its data was lost or it was restored from an older copy); moving etcd's revision past %d, "
                  "so that the leader's next plan is newer than every epoch this daemon ran (a restore with "
                  "'etcdutl snapshot restore --bump-revision N --mark-compacted' avoids this)",
                  self.name, epoch, applied, applied)

        async def raise_floor() -> None:
            while True:
                try:
                    await raise_revision_past(self.store, self.keys, applied, who=self.name,
                                              timeout=self.config.retry_timeout)
                    break
                except StoreError as exc:   # etcd down again: try again, it is the fleet's only way on
                    log.warning("%s: moving etcd's revision forward: %s; trying again", self.name, exc)
                    await asyncio.sleep(1.0)
            await self._read_plan("etcd's revision moved forward")

        task = asyncio.get_running_loop().create_task(raise_floor(), name="revision-floor")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _planned_for_me(self, doc: PlanDoc) -> bool:
        lease = self.membership.lease
        mine = doc.incarnations.get(self.name)
        if mine is not None and (lease is None or lease.id != mine):
            log.warning("%s: the plan was made for an earlier registration of this daemon; waiting for a new one",
                        self.name)
            return False
        return True

    async def _start_run(self, doc: PlanDoc, epoch: int) -> None:
        sup = self.supervisor
        if self.name not in doc.members:
            if sup.alive():
                sup.stop(None, None, checkpoint=False, reason=f"epoch {epoch} runs without {self.name}")
            sup.warm_spares(doc.job)   # a VM that just joined: the morph that takes it in starts its workers there
            return
        if not self._planned_for_me(doc):
            return
        try:
            spec, script = await self._job_files_patiently(doc.job or "")
        except (StoreError, JobSpecError) as exc:
            log.error("%s: cannot start %s epoch %d: %s", self.name, doc.job, epoch, exc)
            sup.fail_epoch(doc.job or "", epoch, [s.rank for s in doc.slots_on(self.name)],
                           f"{self.name} could not get the job's files: {exc}")
            return
        await self.prober.stop(f"{doc.job} epoch {epoch} starts here")   # a probe never runs beside a step
        await sup.start_epoch(doc, epoch, spec, script)

    async def _start_profile(self, doc: PlanDoc, epoch: int) -> None:
        if not self._planned_for_me(doc):
            return
        try:
            spec, script = await self._job_files_patiently(doc.job or "")
        except (StoreError, JobSpecError) as exc:
            self.supervisor.fail_epoch(doc.job or "", epoch, [0], f"{self.name} could not get the job's files: {exc}")
            return
        out = Path(self.config.state_dir) / "calibration" / f"{script_fingerprint(spec)}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("%s: calibrating the model of %s (writing %s)", self.name, spec.job, out)
        await self.prober.stop(f"calibrating {spec.job} here")
        await self.supervisor.start_profile(doc, epoch, spec, script, str(out))

    async def _after_worker(self, worker) -> None:
        """A calibration run that exited 0 has written its file: store it for the leader."""
        if worker.profile_path is None or worker.outcome != "done":
            return
        try:
            spec, _ = self._jobs[worker.job]
            cal = Calibration.load(worker.profile_path)
            kind = self.membership.member.device_kind
            if cal.device_kind != kind:
                cal = dataclasses.replace(cal, device_kind=kind)
            await self.store.put(self.keys.calibration_entry(script_fingerprint(spec), kind), cal.to_bytes(),
                                 timeout=self.config.retry_timeout)
            log.info("%s: stored the calibration of %s for %s", self.name, spec.job, kind)
        except FileNotFoundError:
            worker.outcome = "failed"
            worker.error = ("the script exited (code 0) without training: it never built Varuna(model, ...) and "
                            "called step(), where the calibration is measured (a script that ends before, or "
                            "trains with a plain loop of its own)")
        except (OSError, ValueError, KeyError, StoreError) as exc:
            worker.outcome = "failed"
            worker.error = f"it left no usable calibration: {exc}"

    async def _job_files_patiently(self, job: str) -> tuple[JobSpec, Path]:
        """``_job_files``, a read etcd failed or did not answer tried again for up to
        FILES_PATIENCE seconds, after a random share of a growing pause. A new plan sends every
        VM of it to etcd at once for the job's files; at 300 VMs on a loaded host some reads
        timed out, and each was reported as a failed epoch: three restarts used up, the job
        failed. A spec or bundle that is wrong fails at once (JobSpecError)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FILES_PATIENCE
        pause = 0.25
        while True:
            try:
                return await self._job_files(job)
            except StoreError as exc:
                if loop.time() + pause > deadline:
                    raise
                log.warning("%s: cannot read the files of %s yet (%s); trying again", self.name, job, exc)
            await asyncio.sleep(pause * (0.5 + random.random()))
            pause = min(2 * pause, 4.0)

    async def _job_files(self, job: str) -> tuple[JobSpec, Path]:
        t = self.config.retry_timeout
        kv = await self.store.get(self.keys.job(job), timeout=t)
        if kv is None:
            raise JobSpecError(f"job {job} has no spec in etcd")
        spec, raw = await usable_spec(self.store, kv, job, timeout=t)
        if self.allowed_submitters is not None:
            sig = await self.store.get(self.keys.signature(job), timeout=t)
            try:
                signer = self.allowed_submitters.verify(job, raw, None if sig is None else sig.value)
            except SigningError as exc:
                raise BundleError(str(exc)) from None
            log.info("%s: job %s is signed by %s", self.name, job, signer)
        cached = self._jobs.get(job)
        if cached is not None and cached[0] == spec:
            return cached
        bundle = await self.store.get(self.keys.bundle(job), timeout=t)
        if bundle is None:
            raise BundleError(f"job {job} has no bundle in etcd")
        directory = unpack_bundle(bundle.value, spec.bundle_digest, job_dir(self.config.state_dir, BUNDLES, job))
        running = {w.job for w in self.supervisor.alive()}
        for old in prune_jobs(self.config.state_dir, self.config.keep_jobs, protect={job, *running}):
            self._jobs.pop(old, None)
        script = directory / spec.script
        if not script.is_file():
            raise BundleError(f"the bundle of {job} holds no {spec.script}")
        self._jobs[job] = (spec, script)
        return spec, script
