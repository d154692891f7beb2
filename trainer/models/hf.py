"""A Hugging Face causal language model as Varuna wants a model: ``forward(batch) -> loss``.

Varuna calls ``model(**batch)`` and trains on the scalar it returns; a transformers model returns
an output object and shifts the labels itself, so the wrapper passes the input ids as labels and
returns ``.loss``. Its one submodule is named ``lm``: a checkpoint's or an export's names are the
transformers model's own below ``lm.`` (``varunactl export`` writes them without it).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """``forward(input_ids) -> loss`` around a transformers ``...ForCausalLM`` model."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=input_ids).loss
