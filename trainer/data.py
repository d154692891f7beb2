"""Deterministic global batches and two small, locally generated datasets.

[Note: the global batch defines the math] in ARCHITECTURE.md: step s trains on the global batch B(s) = f(seed, s), whatever P x D runs it.
`GlobalBatches` is that f: the data is read as an endless stream of permutations, one per pass
(the permutation of pass e is seeded by (seed, e)), and B(s) is the s-th run of `batch_size` indices in
that stream. Every example is seen exactly once per pass; a batch may straddle two passes
(and then can hold one example twice, once from each).
Replica r of D takes the r-th contiguous slice, so after a morph from D=4 to D=2 the same
step still covers the same examples; a plan that gives replicas uneven shares
(`ParallelPlan.shares`) only moves the slices' boundaries.

Nothing is downloaded: the text corpus comes from a small grammar written here, tokenised
one character per token into `VOCAB` (96 symbols: newline and printable ASCII), and the
images are class-dependent gratings plus per-example noise seeded by (seed, index).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from trainer.errors import ConfigError
from trainer.planning.parallel import replica_slice

__all__ = [
    "GlobalBatches",
    "VOCAB",
    "encode",
    "decode",
    "make_corpus",
    "source_corpus",
    "TextDataset",
    "ImageDataset",
    "random_token_batch_fn",
    "random_image_batch_fn",
]


class GlobalBatches:
    """Which examples make up the global batch of each step (and each replica's shard of it)."""

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0) -> None:
        if num_examples < 1:
            raise ConfigError(f"the dataset is empty (num_examples={num_examples})")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        # Each instance keeps its own small cache: consecutive steps reuse one or two passes.
        self._permutation = lru_cache(maxsize=4)(self._make_permutation)

    def __repr__(self) -> str:
        return f"GlobalBatches(num_examples={self.num_examples}, batch_size={self.batch_size}, seed={self.seed})"

    def _make_permutation(self, data_pass: int) -> np.ndarray:
        # Seeding by the pair (seed, pass) rather than seed + pass keeps runs with
        # neighbouring seeds from sharing shifted orders.
        perm = np.random.default_rng([self.seed, data_pass]).permutation(self.num_examples)
        perm.flags.writeable = False
        return perm

    def data_pass(self, step: int) -> int:
        """The pass over the data in which `step`'s batch starts."""
        return step * self.batch_size // self.num_examples

    def indices(self, step: int) -> np.ndarray:
        """Example indices of the global batch of `step`, in the order they are sharded."""
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        start = step * self.batch_size
        end = start + self.batch_size
        parts = []
        pos = start
        while pos < end:
            data_pass, offset = divmod(pos, self.num_examples)
            take = min(end - pos, self.num_examples - offset)
            parts.append(self._permutation(data_pass)[offset:offset + take])
            pos += take
        return np.concatenate(parts)

    def shard(self, step: int, replica: int, data_depth: int, shares: Sequence[int] | None = None) -> np.ndarray:
        """Replica `replica`'s contiguous slice of step `step`'s global batch: batch_size / data_depth
        examples, or ``shares[replica]`` where the replicas take uneven shares (a script may pass
        ``varuna.shares``, the plan's, or leave them out: Varuna takes the even shard too)."""
        if data_depth < 1:
            raise ConfigError(f"data_depth must be >= 1, got {data_depth}")
        if shares is None and self.batch_size % data_depth:
            raise ConfigError(
                f"global batch size {self.batch_size} does not split evenly over {data_depth} replicas",
                hint=f"use a batch size that is a multiple of {data_depth} "
                     f"(e.g. {self.batch_size - self.batch_size % data_depth or data_depth}) "
                     f"or a replica count that divides {self.batch_size}",
            )
        if not 0 <= replica < data_depth:
            raise ConfigError(f"replica {replica} is outside 0..{data_depth - 1}")
        offset, size = replica_slice(self.batch_size, data_depth, None if shares is None else tuple(shares), replica)
        return self.indices(step)[offset:offset + size]


# --- text ------------------------------------------------------------------------------

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_CHAR_TO_ID = {ch: i for i, ch in enumerate(VOCAB)}
_UNKNOWN = _CHAR_TO_ID["?"]


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) of `text`; characters outside VOCAB become '?'."""
    return np.fromiter((_CHAR_TO_ID.get(ch, _UNKNOWN) for ch in text), dtype=np.uint8, count=len(text))


def decode(ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return "".join(VOCAB[int(i)] for i in ids)


_WORDS = {
    "det": ["the", "a", "every", "one", "that", "no", "some"],
    "adj": ["small", "quiet", "red", "old", "bright", "cold", "patient", "tired", "clever", "green",
            "heavy", "distant", "young", "careful"],
    "noun": ["river", "engine", "farmer", "garden", "lamp", "teacher", "window", "sparrow", "market",
             "ship", "letter", "forest", "baker", "machine", "valley", "child", "clock", "road"],
    "verb_t": ["sees", "follows", "builds", "carries", "finds", "paints", "repairs", "watches",
               "remembers", "sells", "opens", "answers"],
    "verb_i": ["sleeps", "waits", "sings", "works", "falls", "rests", "listens", "returns", "shines"],
    "adv": ["slowly", "again", "quietly", "today", "at night", "with care", "once more", "early"],
    "prep": ["near", "under", "behind", "beside", "across", "above", "past"],
    "name": ["Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Gus", "Hana"],
}


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_WORDS["det"])]
    if rng.random() < 0.5:
        words.append(rng.choice(_WORDS["adj"]))
    words.append(rng.choice(_WORDS["noun"]))
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    subject = rng.choice(_WORDS["name"]) if rng.random() < 0.25 else _noun_phrase(rng)
    if rng.random() < 0.6:
        parts = [subject, rng.choice(_WORDS["verb_t"]), _noun_phrase(rng)]
    else:
        parts = [subject, rng.choice(_WORDS["verb_i"])]
    if rng.random() < 0.4:
        parts += [rng.choice(_WORDS["prep"]), _noun_phrase(rng)]
    if rng.random() < 0.3:
        parts.append(rng.choice(_WORDS["adv"]))
    return " ".join(parts)


def _sentence(rng: random.Random) -> str:
    text = _clause(rng)
    roll = rng.random()
    if roll < 0.2:
        text += ", and " + _clause(rng)
    elif roll < 0.3:
        text += " because " + _clause(rng)
    end = "?" if roll > 0.95 else "."
    return text[0].upper() + text[1:] + end


def source_corpus() -> str:
    """The Python source of the `trainer` and `protocol` packages (about 400 KB of real text).

    It ships with every install, so a demo trains on real text with nothing to download; every
    machine of a job must run the same version for the examples to agree.
    """
    root = Path(__file__).resolve().parent.parent
    files = sorted(f for pkg in ("trainer", "protocol") for f in (root / pkg).rglob("*.py"))
    if not files:
        raise ConfigError(f"no Python source under {root}/trainer or {root}/protocol to use as a corpus")
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def make_corpus(num_chars: int, seed: int = 0) -> str:
    """At least `num_chars` characters of English-like text from a fixed grammar.

    Deterministic for a given seed (Python's `random.Random` sequence is stable across
    versions for `random()` and `choice()`). Sentences are grouped into short paragraphs so
    the model also sees newlines.
    """
    rng = random.Random(seed)
    pieces: list[str] = []
    total = 0
    while total < num_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(2, 5))) + "\n"
        pieces.append(paragraph)
        total += len(paragraph)
    return "".join(pieces)


class TextDataset:
    """Next-character prediction windows over a generated corpus, or over `text` when given.

    Example i is the window tokens[i*seq_len : (i+1)*seq_len + 1]: `input_ids` is all but its
    last token, `targets` all but its first. Windows do not overlap, so one pass sees every
    character once. A given `text` holds at most (len(text) - 1) // seq_len examples; fewer
    than `num_examples` are kept then (``len()`` tells).
    """

    def __init__(self, seq_len: int, num_examples: int = 2048, *, seed: int = 0, text: str | None = None) -> None:
        if seq_len < 1 or num_examples < 1:
            raise ConfigError(f"seq_len and num_examples must be >= 1, got {seq_len} and {num_examples}")
        if text is not None:
            num_examples = min(num_examples, (len(text) - 1) // seq_len)
            if num_examples < 1:
                raise ConfigError(f"a text of {len(text)} characters holds no window of {seq_len + 1}")
        self.seq_len = seq_len
        self.num_examples = num_examples
        self.vocab_size = len(VOCAB)
        if text is None:
            text = make_corpus(num_examples * seq_len + 1, seed=seed)
        self.tokens = torch.from_numpy(encode(text[:num_examples * seq_len + 1]).astype(np.int64))

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.batch([index])
        return {k: v[0] for k, v in batch.items()}

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str | None = None
              ) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_examples):
            raise IndexError(f"example index out of range 0..{self.num_examples - 1}")
        # Gather all windows at once: (n, 1) starts + (seq_len + 1,) offsets.
        windows = self.tokens[idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)]
        batch = {"input_ids": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
        return _to_device(batch, device)

    def sample_batch(self, size: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The first `size` examples (wrapping around): the shape of real batches, for a dry run."""
        return self.batch(np.arange(size) % self.num_examples, device)


# --- images ----------------------------------------------------------------------------

class ImageDataset:
    """Synthetic classification images: a class-specific grating plus Gaussian noise.

    Class c's pattern is a sinusoidal grating whose orientation and frequency depend on c
    (and a per-channel phase, so colour carries signal too). Labels and noise are fixed by
    (seed, index), so any shard can be materialised without the rest.
    """

    def __init__(self, num_examples: int = 2048, *, channels: int = 1, image_size: int = 16,
                 num_classes: int = 10, noise: float = 0.5, seed: int = 0) -> None:
        if min(num_examples, channels, image_size, num_classes) < 1:
            raise ConfigError("num_examples, channels, image_size and num_classes must all be >= 1")
        self.num_examples = num_examples
        self.channels = channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed
        self.labels = np.random.default_rng([seed, 0]).integers(num_classes, size=num_examples)
        self.patterns = _gratings(num_classes, channels, image_size)

    def __len__(self) -> int:
        return self.num_examples

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str | None = None
              ) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_examples):
            raise IndexError(f"example index out of range 0..{self.num_examples - 1}")
        labels = self.labels[idx]
        shape = (self.channels, self.image_size, self.image_size)
        noise = np.stack([np.random.default_rng([self.seed, 1, int(i)]).standard_normal(shape, dtype=np.float32)
                          for i in idx]) if idx.size else np.zeros((0, *shape), np.float32)
        images = self.patterns[labels] + self.noise * noise
        batch = {"images": torch.from_numpy(images), "labels": torch.from_numpy(labels.astype(np.int64))}
        return _to_device(batch, device)

    def sample_batch(self, size: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return self.batch(np.arange(size) % self.num_examples, device)


def _gratings(num_classes: int, channels: int, size: int) -> np.ndarray:
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    out = np.empty((num_classes, channels, size, size), dtype=np.float32)
    for c in range(num_classes):
        angle = np.pi * c / num_classes
        cycles = 1.5 + (c % 3)  # across the image; distinct classes differ in angle or frequency
        phase_axis = (xx * np.cos(angle) + yy * np.sin(angle)) / size
        for ch in range(channels):
            out[c, ch] = np.sin(2 * np.pi * cycles * phase_axis + ch * np.pi / 3)
    return out


# --- dry-run batches -------------------------------------------------------------------

# These draw from a private generator: a dry run must not shift the global RNG, or runs that
# calibrate and runs that do not would see different dropout masks afterwards.

def random_token_batch_fn(vocab_size: int, seq_len: int, seed: int = 0):
    """A `get_batch_fn(size, device)` returning random token batches of the GPT's shape."""
    def get_batch_fn(size: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(vocab_size, (size, seq_len + 1), generator=gen)
        return _to_device({"input_ids": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous()}, device)
    return get_batch_fn


def random_image_batch_fn(channels: int, image_size: int, num_classes: int, seed: int = 0):
    """A `get_batch_fn(size, device)` returning random image batches of the CNN's shape."""
    def get_batch_fn(size: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        batch = {
            "images": torch.randn(size, channels, image_size, image_size, generator=gen),
            "labels": torch.randint(num_classes, (size,), generator=gen),
        }
        return _to_device(batch, device)
    return get_batch_fn


def _to_device(batch: dict[str, torch.Tensor], device: torch.device | str | None) -> dict[str, torch.Tensor]:
    if device is None:
        return batch
    return {k: v.to(device) for k, v in batch.items()}
