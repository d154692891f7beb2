"""Models the meta-device weight tests build, in the worker (tests/workers/train_weights.py) and in
the test's plain reference loop alike.

`mixer`: hand-written, with CutPoints and a non-persistent buffer (a causal mask every block
reads, rebuilt from the attribute its module keeps); `gpt2` and `llama`: transformers' own
classes from small random configs (GPT-2's head tied to its embedding, Llama's rotary
frequencies a non-persistent buffer), without dropout so that the losses compare exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer import CutPoint
from trainer.models.hf import CausalLM

VOCAB, SEQ = 96, 16


class CausalMask(nn.Module):
    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len)) / torch.arange(1, seq_len + 1)[:, None],
                             persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ts,bsd->btd", self.mask, h)


class Mixer(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.average = CausalMask(SEQ)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block, cut in zip(self.blocks, self.cuts):
            h = cut(h + block(self.average(h)))
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


def hf_config(arch: str):
    import transformers
    transformers.logging.set_verbosity_error()
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                                       use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32,
                                    intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, use_cache=False)


def build(arch: str) -> nn.Module:
    """The model on the current default device (meta under `with torch.device("meta")`)."""
    if arch == "mixer":
        return Mixer()
    import transformers
    return CausalLM(transformers.AutoModelForCausalLM.from_config(hf_config(arch)))


def data(examples: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (examples, SEQ), generator=torch.Generator().manual_seed(7))
