"""`varunactl export`: a job's checkpoint out as the user's own model files (safetensors under
the model's state_dict names; trainer.checkpoint.export does the work).

The checkpoint store is `--store`, else the job's as etcd holds it: the store the job was
submitted with, else the one the leader resolved when it ran (the daemons' --store/JOB). The
export itself reads the store, never etcd, and needs torch (imported on use).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from varunad.control.jobs import JobSpec
from varunad.control.status import UnknownJob, read_state
from varunad.store.contract import Store
from varunad.store.keys import Keys

__all__ = ["ExportError", "job_store_dir", "export", "print_exported"]


class ExportError(ValueError):
    """A refusal with its reason and what to do (varunactl prints it as one line)."""


async def job_store_dir(store: Store, keys: Keys, job: str) -> str:
    """Where `job` keeps its checkpoints, as etcd knows it (UnknownJob, ExportError)."""
    kv = await store.get(keys.job(job))
    if kv is None:
        raise UnknownJob(f"no job named {job} (see `varunactl jobs`)")
    spec = JobSpec.decode(kv.value, job=job)
    if spec.store:
        return spec.store
    state = await read_state(store, keys, job)
    if state is not None and state.store:
        return state.store
    if state is not None and state.terminal:   # it ended before its first plan: no step, no checkpoint
        raise ExportError(f"job {job} is {state.state} and never trained a step, so it has no checkpoint to "
                          f"export: {state.reason}")
    raise ExportError(f"job {job} was submitted without --store and has not run, so its store is not known: "
                      f"pass --store DIR/{job}, where DIR is the daemons' --store")


def export(store_dir: str, out: str, step: int | None, module: str | None) -> dict[str, Any]:
    """Export and describe what was written; CheckpointError becomes ExportError."""
    from trainer.checkpoint.export import export_checkpoint
    from trainer.errors import CheckpointError

    try:
        done = export_checkpoint(store_dir, out, step, module=module)
    except CheckpointError as exc:
        hint = getattr(exc, "hint", None)
        raise ExportError(f"{str(exc).splitlines()[0]}" + (f" ({hint})" if hint and hint not in str(exc) else "")
                          ) from None
    return {"store": store_dir, "step": done.step, "out": done.out, "module": done.module,
            "model_class": done.model_class, "files": list(done.files), "tensors": done.tensors,
            "total_bytes": done.total_bytes, "largest_read_bytes": done.largest_read,
            "pretrained": done.pretrained, "config": done.config,
            "missing": list(done.missing), "left_out": done.left_out}


def print_exported(doc: dict[str, Any], out: TextIO = sys.stdout) -> None:
    shards = [f for f in doc["files"] if f.endswith(".safetensors")]
    print(f"exported  checkpoint {doc['step']} of {doc['store']} into {doc['out']}: {doc['tensors']} tensors, "
          f"{doc['total_bytes'] / 2**20:.1f} MiB in {len(shards)} file(s), at most "
          f"{doc['largest_read_bytes'] / 2**20:.1f} MiB of the checkpoint held at once", file=out)
    print(f"model     {doc['model_class']}" + (f" (the model's '{doc['module'].rstrip('.')}')" if doc["module"] else ""),
          file=out)
    cls = doc["model_class"].rsplit(".", 1)[-1]
    if doc["pretrained"]:
        config = "" if doc["config"] else ", config=its_config"
        print(f"load      {cls}.from_pretrained({json.dumps(doc['out'])}{config})"
              + ("" if doc["config"] else "  (the model's config could not be recorded: pass yours)"), file=out)
    else:
        where = (shards[0] if len(shards) == 1 else
                 f"each of the {len(shards)} files model.safetensors.index.json lists")
        print(f"load      model.load_state_dict(state, strict=True), state read from {where} "
              "with safetensors.torch.load_file", file=out)
    if doc["missing"]:
        print(f"warning   {len(doc['missing'])} state_dict entries are in no checkpoint file, since the model's "
              f"forward never uses them ({', '.join(doc['missing'][:5])}): they keep their initial values; "
              "load with strict=False", file=out)
