"""Host memory per worker: a model built on the CPU in every worker vs built on the meta device
and filled per stage from its weights (`Varuna(weights=...)`).

A Hugging Face GPT-2 from a random config is saved once with save_pretrained (sharded, nothing
downloaded); then the same P x 1 job runs twice under the local launcher
(benchmarks/_meta_weights_worker.py): each worker builds the model on the CPU, or on the meta
device reading only its stage's tensors from the files. Per stage: the stage's weights, the
resident memory a worker gained by the end of `Varuna(...)` (peak, and what remains once the
script dropped its model), and after one Adam step. The capture itself (torch.export) costs a
worker the same in both modes.

Run:  python3 benchmarks/meta_weights.py [--quick] [--stages 4]
The last line is `bench meta_weights: plan=Px1 model_mib=M build_peak_cpu_mib=A build_peak_meta_mib=B saved_mib=S`
(the largest stage's peak growth through Varuna(), and what meta saved on it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from trainer.launch import launch  # noqa: E402

WORKER = REPO / "benchmarks" / "_meta_weights_worker.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="GPT-2 6 x 512 instead of 12 x 768")
    p.add_argument("--stages", type=int, default=4)
    args = p.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    width, layers = (512, 6) if args.quick else (768, 12)
    config = transformers.GPT2Config(vocab_size=32000, n_positions=32, n_embd=width, n_layer=layers,
                                     n_head=8, use_cache=False)
    root = Path(tempfile.mkdtemp(prefix="meta-weights-"))
    weights = root / "weights"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model_mib = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
    model.save_pretrained(str(weights), max_shard_size="50MB")
    del model
    rows: dict[str, list[dict]] = {}
    for mode in ("cpu", "meta"):
        start = time.perf_counter()
        result = launch(WORKER, ["--mode", mode, "--weights", str(weights), "--out", str(root)],
                        stages=args.stages, replicas=1, threads=1, timeout=600)
        if not result.ok:
            sys.exit(f"{mode} run failed ({result.reason}):\n" + "\n".join(result.errors))
        rows[mode] = sorted((json.loads((root / f"{mode}-rank{r}.json").read_text()) for r in range(args.stages)),
                            key=lambda r: r["stage"])
        print(f"{mode}: {time.perf_counter() - start:.0f} s", flush=True)

    print(f"\nGPT-2 {layers} x {width}, vocabulary 32000: {model_mib:.0f} MiB of weights, P={args.stages}; "
          "MiB a worker's resident memory grew from before the model was built (its code imported)")
    print(f"{'stage':>5} {'weights':>8} | {'cpu: peak':>9} {'kept':>6} {'step':>6} | "
          f"{'meta: peak':>10} {'kept':>6} {'step':>6}")
    for cpu, meta in zip(rows["cpu"], rows["meta"]):
        cells = []
        for r in (cpu, meta):
            cells.append((r["peak_build"] - r["before"], r["after_build"] - r["before"], r["after_step"] - r["before"]))
        (a1, a2, a3), (b1, b2, b3) = cells
        print(f"{cpu['stage']:>5} {cpu['stage_mib']:>8.0f} | {a1:>9.0f} {a2:>6.0f} {a3:>6.0f} | {b1:>10.0f} {b2:>6.0f} {b3:>6.0f}")
    cpu_peak = max(r["peak_build"] - r["before"] for r in rows["cpu"])
    meta_peak = max(r["peak_build"] - r["before"] for r in rows["meta"])
    print(f"bench meta_weights: plan={args.stages}x1 model_mib={model_mib:.0f} build_peak_cpu_mib={cpu_peak:.0f} "
          f"build_peak_meta_mib={meta_peak:.0f} saved_mib={cpu_peak - meta_peak:.0f}")


if __name__ == "__main__":
    main()
