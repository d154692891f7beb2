"""A GPT-2 style decoder written to be cut into pipeline stages.

The pipeline partitioner traces `GPT.forward` with torch.fx and splits it at active
`CutPoint`s, so the forward obeys three rules:

* no Python control flow that depends on tensor values (or on `self.training`);
* every input is a tensor from the batch dict (`input_ids`, `targets`), passed by keyword;
* only one tensor crosses each cut point (the residual stream `x`): positions are derived
  from `input_ids` inside the first stage and attention is causal via `is_causal=True`, so
  no mask has to travel down the pipeline.

Cut points: index 0 sits after the embeddings, index i (1 <= i < n_layer) after block i-1,
so there are `n_layer` in all and the last stage always holds the final LayerNorm and the
output head. The head's weight *is* the token embedding's Parameter (weight tying as in
GPT-2); the engine notices the sharing between the first and last stage.

Initialisation is deterministic: `GPT(config, seed=s)` draws every weight from its own
`torch.Generator` seeded with `s`, so every worker building the model gets identical
weights whatever the global RNG state. `seed=None` uses the global RNG instead (then
`torch.manual_seed` beforehand makes it reproducible).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError
from trainer.graph.cutpoint import CutPoint

__all__ = ["GPTConfig", "GPT", "PRESETS"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int = 96
    """Number of token ids; 96 fits `trainer.data.VOCAB` (printable ASCII and newline)."""
    seq_len: int = 32
    """Longest sequence (size of the position embedding)."""
    n_layer: int = 4
    """Transformer blocks; the model has this many cut points."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 48
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after embeddings and each residual branch (nn.Dropout; the engine keys its masks
    by sample, so every P x D and recompute draws the same ones)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}",
                hint="pick a head count that divides the width, e.g. n_embd // 64",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named preset (`tiny`, `small`, `gpt100m`), with fields optionally overridden."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown GPT preset {name!r}", hint=f"choose one of {', '.join(PRESETS)}") from None
        return replace(base, **overrides)

    def num_parameters(self) -> int:
        """Distinct trainable parameters (the tied head counted once), without building the model."""
        d, ff = self.n_embd, 4 * self.n_embd
        per_block = (
            2 * 2 * d                 # two LayerNorms
            + d * 3 * d + 3 * d       # qkv projection
            + d * d + d               # attention output projection
            + d * ff + ff + ff * d + d  # MLP
        )
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # Unit tests and multi-process tests on two CPU cores: ~0.12M parameters.
    "tiny": GPTConfig(vocab_size=96, seq_len=32, n_layer=4, n_head=4, n_embd=48),
    # Examples that should learn visibly within minutes on a CPU: ~14M parameters.
    "small": GPTConfig(vocab_size=96, seq_len=128, n_layer=8, n_head=6, n_embd=384),
    # Benchmarks: GPT-2 small's width with 14 layers and a character vocabulary, ~99M parameters.
    "gpt100m": GPTConfig(vocab_size=96, seq_len=512, n_layer=14, n_head=12, n_embd=768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # unflatten/permute instead of `B, T, C = x.size()` keeps the graph free of shape
        # unpacking, which symbolic tracing cannot do.
        qkv = self.c_attn(x).unflatten(-1, (3, self.n_head, self.head_dim)).permute(2, 0, 3, 1, 4)
        # No attention-probability dropout: to key it by sample the engine runs attention as
        # matmul + softmax (trainer.graph.keyed_random), giving up SDPA's fused kernel; residual
        # dropout below is an nn.Dropout.
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model; `forward(input_ids, targets)` returns the mean cross-entropy."""

    def __init__(self, config: GPTConfig, *, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        # cuts[0] after the embeddings, cuts[i] after blocks[i-1].
        self.cuts = nn.ModuleList(CutPoint() for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int | None) -> None:
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        # GPT-2's scheme: N(0, 0.02) everywhere, residual output projections scaled down by
        # sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # its weight is wte's; initialised once, as the embedding
            if isinstance(module, nn.Linear):
                std = proj_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, 0.0, std, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=gen)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for cut, block in zip(self.cuts, self.blocks):
            x = block(cut(x))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
