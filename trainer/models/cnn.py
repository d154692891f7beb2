"""A small convolutional classifier with no CutPoints at all.

Its `body` is an `nn.Sequential` of blocks; the partitioner cuts between a Sequential's
children when a model declares no CutPoint, so this model exercises that path. The last
block is the classifier head, so `body(images)` is the logits and any cut leaves the loss
on the last stage.

Normalisation is GroupNorm, not BatchNorm: batch statistics would depend on how a replica's
shard is split into micro-batches, and a run would no longer compute the same gradient for
every P x D ([Note: the global batch defines the math] in ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError

__all__ = ["CNNConfig", "CNN", "PRESETS"]


@dataclass(frozen=True, slots=True)
class CNNConfig:
    """Shape of a CNN and of the images it takes."""

    in_channels: int = 1
    image_size: int = 16
    """Height and width; must be divisible by 2 ** (number of pooling blocks)."""
    num_classes: int = 10
    width: int = 16
    """Channels of the first stage; doubled after every pooling block."""
    stages: int = 2
    """Resolution stages; each is two conv blocks, the second one pooling by 2."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "image_size", "num_classes", "width", "stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CNNConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % (2 ** self.stages):
            raise ConfigError(
                f"image_size={self.image_size} cannot be halved {self.stages} times",
                hint=f"use an image size divisible by {2 ** self.stages} or fewer stages",
            )

    @classmethod
    def preset(cls, name: str, **overrides: object) -> CNNConfig:
        try:
            base = PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown CNN preset {name!r}", hint=f"choose one of {', '.join(PRESETS)}") from None
        return replace(base, **overrides)

    @property
    def num_blocks(self) -> int:
        """Children of `CNN.body` (conv blocks + head); there are num_blocks - 1 places to cut."""
        return 2 * self.stages + 1


PRESETS: dict[str, CNNConfig] = {
    "tiny": CNNConfig(in_channels=1, image_size=16, num_classes=10, width=16, stages=2),
    "cifar": CNNConfig(in_channels=3, image_size=32, num_classes=10, width=32, stages=3),
}


class ConvBlock(nn.Module):
    """3x3 conv, GroupNorm, ReLU, optionally followed by 2x2 max-pooling."""

    def __init__(self, cin: int, cout: int, *, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)
        self.norm = nn.GroupNorm(min(8, cout), cout)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.norm(self.conv(x))))


class Head(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, cin: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class CNN(nn.Module):
    """`forward(images, labels)` returns the mean cross-entropy over the batch.

    `seed` makes initialisation independent of the global RNG (see `trainer.models.gpt`);
    `seed=None` uses the global RNG.
    """

    def __init__(self, config: CNNConfig, *, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        blocks: list[nn.Module] = []
        cin, cout = config.in_channels, config.width
        for _ in range(config.stages):
            blocks += [ConvBlock(cin, cout, pool=False), ConvBlock(cout, cout, pool=True)]
            cin, cout = cout, cout * 2
        blocks.append(Head(cin, config.num_classes))
        self.body = nn.Sequential(*blocks)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int | None) -> None:
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu", generator=gen)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01, generator=gen)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(images), labels)
