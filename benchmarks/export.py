"""Exporting a checkpoint: the memory `export_checkpoint` holds, against the model and the checkpoint.

Model: Hugging Face GPT2LMHeadModel (random init from a config, nothing downloaded; 8 blocks
512 wide, vocabulary 8192, ~30M parameters; `--quick`: 4 blocks, 256 wide), wrapped so that
forward returns the loss, trained one step with Adam at P = 2 by the local launcher, which
writes one checkpoint (weights and Adam state: about 3x the weights).

Measured, each in a fresh process, the peak resident memory above what the process held after
its imports (ru_maxrss minus the RSS before the work):
- export    trainer.checkpoint.export.export_checkpoint into a new directory (one checkpoint
            file read, one shard written, at a time);
- whole     what an export that reads the whole checkpoint first would hold: every layer file
            loaded into one dict (the contrast, not a method anyone ships).

Run:  python benchmarks/export.py [--quick] [--store DIR (a checkpoint store to reuse)]
The last line is  `bench export: weights_mb=<exported> checkpoint_mb=<all files> largest_file_mb=<one
layer file> export_peak_mb=<export> whole_peak_mb=<whole> export_peak_over_largest_file=<ratio>
export_s=<seconds>`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.checkpoint import reading  # noqa: E402
from trainer.checkpoint import store as ckpt_store  # noqa: E402
from trainer.launch import launch  # noqa: E402

_MEASURE = """
import json, resource, sys, time
import psutil, torch
from trainer.checkpoint import reading
from trainer.checkpoint.export import export_checkpoint
import safetensors.torch
mode, store, step, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
before = psutil.Process().memory_info().rss
start = time.perf_counter()
if mode == "export":
    done = export_checkpoint(store, out, step)
    extra = {"weights": done.total_bytes, "largest": done.largest_read, "files": len(done.files)}
else:
    ckpt = reading.checkpoint_dir(store, step)
    held = [reading.read_tensors(ckpt, f["name"]) for f in reading.verify(ckpt)["files"]]
    extra = {}
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak": peak - before, "seconds": seconds, **extra}))
"""


def measure(mode: str, store: str, step: int, out: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, mode, store, str(step), out], capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 blocks, 256 wide")
    p.add_argument("--store", help="reuse this checkpoint store instead of training")
    args = p.parse_args()
    d, layers = (256, 4) if args.quick else (512, 8)
    config = dict(vocab_size=8192, n_positions=32, n_embd=d, n_layer=layers, n_head=8, use_cache=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    store = args.store or str(work / "store")
    if not args.store:
        result = launch(REPO / "benchmarks" / "_export_worker.py", ["--store", store, "--config", json.dumps(config)],
                        stages=2, replicas=1, threads=1, timeout=600)
        if not result.ok:
            raise SystemExit(f"training failed ({result.reason}):\n" + "\n".join(result.errors[-20:]))
    step = ckpt_store.latest_complete(store)
    files = reading.verify(reading.checkpoint_dir(store, step))["files"]
    checkpoint = sum(f["size"] for f in files)
    ex = measure("export", store, step, str(work / "export"))
    whole = measure("whole", store, step, str(work / "unused"))
    mb = 2 ** 20
    print(f"model: GPT2LMHeadModel {layers} blocks x {d}, checkpoint {step} of {store}: {len(files)} files")
    print(f"{'what':<34} {'MiB':>9}")
    for what, value in (("weights exported", ex["weights"]), ("checkpoint (weights + Adam)", checkpoint),
                        ("largest checkpoint file", ex["largest"]), ("export: peak above start", ex["peak"]),
                        ("whole checkpoint loaded: peak", whole["peak"])):
        print(f"{what:<34} {value / mb:>9.1f}")
    print(f"export wrote {ex['files']} files in {ex['seconds']:.2f} s")
    print(f"bench export: weights_mb={ex['weights'] / mb:.1f} checkpoint_mb={checkpoint / mb:.1f} "
          f"largest_file_mb={ex['largest'] / mb:.1f} export_peak_mb={ex['peak'] / mb:.1f} "
          f"whole_peak_mb={whole['peak'] / mb:.1f} export_peak_over_largest_file={ex['peak'] / ex['largest']:.2f} "
          f"export_s={ex['seconds']:.2f}")
    shutil.rmtree(work, ignore_errors=True)   # the store too, unless it was --store's


if __name__ == "__main__":
    main()
