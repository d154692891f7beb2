"""Where a job's next epoch resumes from, as the leader can tell from the store: the step and why.

After a broken epoch the survivors save what they hold from memory (trainer.checkpoint.rescue);
the new epoch's workers then resume from the newest complete checkpoint, which is that rescue
when every stage kept a live replica, and the store's newest periodic (or notice) checkpoint
when some stage lost all of its replicas. The leader reads the same manifests (plain JSON: the
control plane does not import torch) to write the morph's source into the job's record, in
words a user can act on: "replicas", "checkpoint 60" and, for a fallback, which stages had no
live replica on which VMs. Checksums are the workers' to verify: a checkpoint that turns out
corrupt makes them fall back further, and the report's redone steps (from the steps the new
epoch actually trained) say so.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection
from dataclasses import dataclass

from varunad.control.plans import PlanDoc

__all__ = ["ResumeSource", "complete_manifest", "resume_source"]

_CKPT = re.compile(r"varuna_ckpt_(0|[1-9][0-9]*)")


NO_CHECKPOINT_YET = "no complete checkpoint yet"


@dataclass(frozen=True, slots=True)
class ResumeSource:
    source: str            # "replicas" | "checkpoint" | "scratch" | "" (a store the leader cannot read)
    step: int | None       # the step the next epoch starts at
    why: str               # for a fallback: what the replicas could not provide
    # (step, loss) of the steps before that one, from its manifest: a daemon that died right after
    # the checkpoint may not have written them into the loss history, and nobody trains them again
    losses: tuple[tuple[int, float], ...] = ()
    losses_epoch: int = 0   # the epoch that trained them

    @property
    def words(self) -> str:
        if self.source == "replicas":
            return f"from replicas at step {self.step}"
        if self.source == "checkpoint":
            return f"from checkpoint {self.step}" + (f" ({self.why})" if self.why else "")
        if self.source == "scratch":
            return "from scratch" + (f" ({self.why})" if self.why else "")
        return ""


def complete_manifest(store: str, step: int) -> dict | None:
    """The manifest of checkpoint `step` in `store` if it is committed (the manifest is written
    last) and every file it lists has the size it says, else None: the workers skip a checkpoint
    with a truncated or missing file (trainer.checkpoint.reading.verify), so the morph's record
    must not name it. The checksums and the epoch fences (a late write of an older epoch) are the
    workers' alone to read. Plain JSON: the control plane does not import torch."""
    where = os.path.join(store, f"varuna_ckpt_{step}")
    try:
        with open(os.path.join(where, "manifest.json"), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None   # not committed (yet), or damaged: the workers skip it too
    if not (isinstance(doc, dict) and doc.get("complete") is True and doc.get("iteration") == step):
        return None
    files = doc.get("files")
    if not isinstance(files, list):
        return None
    for entry in files:
        name = entry.get("name") if isinstance(entry, dict) else None
        # a flat name only: one with a separator is refused by the workers too
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            return None
        try:
            if os.stat(os.path.join(where, name)).st_size != entry.get("size"):
                return None
        except OSError:
            return None
    return doc


def _newest_complete(store: str) -> tuple[int, dict] | None:
    try:
        names = os.listdir(store)
    except OSError:
        return None
    for step in sorted((int(m.group(1)) for n in names if (m := _CKPT.fullmatch(n))), reverse=True):
        doc = complete_manifest(store, step)
        if doc is not None:
            return step, doc
    return None


def _orphaned_stages(doc: PlanDoc | None, lost: Collection[str]) -> str:
    """'stage 1 had no live replica (vm3)' for the stages whose every replica was on a lost VM."""
    if doc is None or doc.kind != "run" or not lost:
        return ""
    gone = {stage: members for stage, members in doc.members_by_stage().items() if members <= set(lost)}
    if not gone:
        return ""
    stages = sorted(gone)
    vms = sorted(set().union(*gone.values()))
    label = f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(map(str, stages))
    return f"{label} had no live replica ({', '.join(vms)})"


def resume_source(store: str, plan: PlanDoc | None, lost: Collection[str]) -> ResumeSource:
    """What the next epoch of the job whose old plan was `plan` will resume from, given the VMs
    `lost` with it. A store that is not a local path (an object store URL) is not read."""
    if "://" in store:
        return ResumeSource("", None, "")
    newest = _newest_complete(store)
    if newest is None:
        return ResumeSource("scratch", 0, _orphaned_stages(plan, lost) or NO_CHECKPOINT_YET)
    step, doc = newest
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    epoch, losses = _losses(meta.get("losses"), step)
    if meta.get("source") == "replicas":
        return ResumeSource("replicas", step, "", losses, epoch)
    why = _orphaned_stages(plan, lost) or ("the survivors held no common step newer than it" if lost else "")
    return ResumeSource("checkpoint", step, why, losses, epoch)


def _losses(value: object, before: int) -> tuple[int, tuple[tuple[int, float], ...]]:
    """A manifest's {"epoch": e, "steps": [[step, loss], ...]} as trainer.checkpoint.contents
    writes it (a diverged step's loss null: NaN); what is not that (an older worker's manifest has
    none) is no losses."""
    if not isinstance(value, dict) or type(value.get("epoch")) is not int or not isinstance(value.get("steps"), list):
        return 0, ()
    return value["epoch"], tuple(
        (pair[0], math.nan if pair[1] is None else float(pair[1])) for pair in value["steps"]
        if isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and 0 <= pair[0] < before
        and (pair[1] is None or isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)))
