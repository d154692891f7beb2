"""Worker of benchmarks/export.py, started by trainer.launch: trains a Hugging Face GPT-2 (random
init from a config, nothing downloaded) for --steps steps with Adam and checkpoints into --store."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from trainer import GlobalBatches, Varuna  # noqa: E402
from trainer.data import TextDataset  # noqa: E402


class LossOf(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=targets).loss


p = argparse.ArgumentParser()
p.add_argument("--store", required=True)
p.add_argument("--config", required=True, help="JSON GPT2Config fields")
p.add_argument("--steps", type=int, default=1)
args = p.parse_args()

transformers.logging.set_verbosity_error()
fields = json.loads(args.config)
data = TextDataset(fields["n_positions"], num_examples=64, seed=0)
torch.manual_seed(0)
model = LossOf(transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)))
varuna = Varuna(model, None, data.sample_batch, 4, 2)
del model
varuna.set_optimizer(torch.optim.Adam(varuna.parameters(), lr=1e-3))
batches = GlobalBatches(len(data), 4, seed=0)
while varuna.iteration < args.steps:
    varuna.step(data.batch(batches.shard(varuna.iteration, varuna.replica, varuna.data_depth)))
varuna.checkpoint(args.store)
varuna.close()
