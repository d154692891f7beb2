"""The tiny GPT and a small dataset for it, built in the test process (the profiler tests)."""

from __future__ import annotations

from trainer.data import TextDataset
from trainer.models.gpt import GPT, GPTConfig


def tiny_gpt(**overrides):
    cfg = GPTConfig.preset("tiny", **overrides)
    return GPT(cfg, seed=0), TextDataset(cfg.seq_len, num_examples=16, seed=0)
