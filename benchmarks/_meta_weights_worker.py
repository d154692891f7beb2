"""Worker of benchmarks/meta_weights.py, started by trainer.launch: builds a Hugging Face GPT-2 on
the CPU (--mode cpu) or on the meta device with weights= (--mode meta), wraps it in Varuna, drops
the model, trains one step with Adam and writes its resident memory at each point to --out."""

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from trainer import Varuna  # noqa: E402
from trainer.models.hf import CausalLM  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["cpu", "meta"], required=True)
p.add_argument("--weights", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
transformers.logging.set_verbosity_error()


def rss() -> float:
    return psutil.Process().memory_info().rss / 2**20


class PeakSampler(threading.Thread):
    """The largest resident size seen, sampled every 2 ms (the engine resets the kernel's
    high-water mark when training starts, and ru_maxrss keeps across exec the size of the
    launcher that forked this worker)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss()
        self.running = True
        self.start()

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def stop(self) -> float:
        self.running = False
        self.join()
        return max(self.peak, rss())


config = transformers.AutoConfig.from_pretrained(args.weights)
ids = torch.randint(0, config.vocab_size, (8, config.n_positions), generator=torch.Generator().manual_seed(0))
# the modeling code and torch.export are imported alike in both modes: not counted
import torch.export  # noqa: E402,F401

transformers.GPT2LMHeadModel  # noqa: B018 (transformers imports a model's module when it is first named)
before = rss()
sampler = PeakSampler()
if args.mode == "meta":
    with torch.device("meta"):
        model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
else:
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
varuna = Varuna(model, None, lambda n, d: {"input_ids": ids[:n].to(d)}, batch_size=4, chunk_size=2,
                weights=args.weights if args.mode == "meta" else None)
del model
gc.collect()
record = {"stage": varuna.stage, "stage_mib": varuna.parameter_bytes() / 2**20, "before": before,
          "peak_build": sampler.stop(), "after_build": rss()}
varuna.set_optimizer(torch.optim.Adam(varuna.parameters(), lr=1e-4))
varuna.step({"input_ids": ids[:4]})
record.update(after_step=rss())
with open(os.path.join(args.out, f"{args.mode}-rank{varuna.rank}.json"), "w") as f:
    json.dump(record, f)
varuna.close()
