"""Global batches ([Note: the global batch defines the math] in ARCHITECTURE.md) and the locally generated datasets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data import (
    VOCAB,
    GlobalBatches,
    ImageDataset,
    TextDataset,
    decode,
    encode,
    make_corpus,
    random_image_batch_fn,
    random_token_batch_fn,
    source_corpus,
)
from trainer.errors import ConfigError

# --- GlobalBatches ---------------------------------------------------------------------


def test_batches_are_a_function_of_seed_and_step_only():
    a, b = GlobalBatches(100, 8, seed=3), GlobalBatches(100, 8, seed=3)
    # Asking in a different order (as a restarted job would) gives the same batches.
    later_first = [b.indices(s) for s in (40, 7, 0)]
    assert all(np.array_equal(a.indices(s), x) for s, x in zip((40, 7, 0), later_first))
    assert not np.array_equal(a.indices(0), GlobalBatches(100, 8, seed=4).indices(0))


@pytest.mark.parametrize("num_examples,batch_size", [(96, 8), (100, 8), (10, 24)])
def test_every_example_is_seen_once_per_pass(num_examples, batch_size):
    batches = GlobalBatches(num_examples, batch_size, seed=0)
    passes = 3
    steps = -(-passes * num_examples // batch_size)
    stream = np.concatenate([batches.indices(s) for s in range(steps)])
    assert all(len(batches.indices(s)) == batch_size for s in range(steps))
    orders = [stream[p * num_examples:(p + 1) * num_examples] for p in range(passes)]
    for order in orders:
        assert np.array_equal(np.sort(order), np.arange(num_examples))
    assert not np.array_equal(orders[0], orders[1])  # each pass is shuffled afresh


def test_shards_tile_the_global_batch_for_any_data_depth():
    batches = GlobalBatches(1000, 24, seed=1)
    for depth in (1, 2, 3, 4, 6):
        shards = [batches.shard(5, r, depth) for r in range(depth)]
        assert all(len(s) == 24 // depth for s in shards)
        assert np.array_equal(np.concatenate(shards), batches.indices(5))


def test_shards_with_shares_tile_the_global_batch_in_replica_order():
    batches = GlobalBatches(1000, 12, seed=1)
    shards = [batches.shard(5, r, 3, shares=(6, 4, 2)) for r in range(3)]
    assert [len(s) for s in shards] == [6, 4, 2]
    assert np.array_equal(np.concatenate(shards), batches.indices(5))
    assert np.array_equal(batches.shard(5, 1, 3, shares=[6, 4, 2]), batches.indices(5)[6:10])
    # shares may split a batch that D does not divide; equal ones are the even split
    assert [len(GlobalBatches(10, 10).shard(0, r, 3, shares=(4, 3, 3))) for r in range(3)] == [4, 3, 3]
    assert np.array_equal(batches.shard(2, 2, 3, shares=(4, 4, 4)), batches.shard(2, 2, 3))
    with pytest.raises(ConfigError, match=r"add up to 11 examples, the global batch is 12"):
        batches.shard(0, 0, 3, shares=(6, 4, 1))
    with pytest.raises(ConfigError, match="name 2 replicas"):
        batches.shard(0, 0, 3, shares=(6, 6))
    with pytest.raises(ConfigError, match="replica 3"):
        batches.shard(0, 3, 3, shares=(6, 4, 2))


def test_shard_refuses_an_uneven_split_and_says_what_to_change():
    batches = GlobalBatches(1000, 10, seed=0)
    with pytest.raises(ConfigError, match="multiple of 4") as info:
        batches.shard(0, 0, 4)
    assert info.value.hint and "divides 10" in info.value.hint
    with pytest.raises(ConfigError, match="replica 2"):
        batches.shard(0, 2, 2)
    with pytest.raises(ConfigError):
        GlobalBatches(0, 4)
    with pytest.raises(ConfigError):
        batches.indices(-1)


# --- text ------------------------------------------------------------------------------


def test_corpus_is_deterministic_english_like_and_in_vocabulary():
    text = make_corpus(5000, seed=0)
    assert len(text) >= 5000
    assert text == make_corpus(5000, seed=0) and text != make_corpus(5000, seed=1)
    assert set(text) <= set(VOCAB)
    assert "\n" in text and ". " in text
    words = text.replace(".", " ").replace(",", " ").split()
    assert sum(w.lower() in {"the", "a", "an"} for w in words) > len(words) // 20


def test_encode_decode_round_trip():
    assert len(VOCAB) == 96
    text = "Hello, world!\n~"
    ids = encode(text)
    assert ids.dtype == np.uint8 and ids.max() < len(VOCAB)
    assert decode(ids) == text
    assert decode(torch.as_tensor(ids.astype(np.int64))) == text
    assert decode(encode("caf\u00e9")) == "caf?"


def test_text_examples_are_shifted_windows():
    ds = TextDataset(16, num_examples=64, seed=0)
    batch = ds.batch([0, 5, 63])
    assert set(batch) == {"input_ids", "targets"}
    assert batch["input_ids"].shape == batch["targets"].shape == (3, 16)
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])
    # Consecutive windows continue each other: example 1 starts where example 0's targets end.
    two = ds.batch([0, 1])
    assert two["input_ids"][1, 0] == two["targets"][0, -1]
    assert torch.equal(ds[5]["input_ids"], batch["input_ids"][1])
    assert len(ds) == 64 and int(batch["input_ids"].max()) < ds.vocab_size
    with pytest.raises(IndexError):
        ds.batch([64])


def test_text_dataset_is_the_same_in_every_worker():
    a, b = TextDataset(8, num_examples=32, seed=2), TextDataset(8, num_examples=32, seed=2)
    assert torch.equal(a.tokens, b.tokens)
    assert a.sample_batch(40)["input_ids"].shape == (40, 8)


# --- images ----------------------------------------------------------------------------


def test_image_examples_do_not_depend_on_which_batch_they_are_in():
    ds = ImageDataset(100, channels=3, image_size=8, seed=0)
    big = ds.batch([3, 7, 42])
    alone = ds.batch([42])
    assert big["images"].shape == (3, 3, 8, 8) and big["images"].dtype == torch.float32
    assert big["labels"].dtype == torch.int64
    assert torch.equal(big["images"][2], alone["images"][0])
    assert int(big["labels"][2]) == int(alone["labels"][0])


def test_image_classes_are_separable():
    ds = ImageDataset(400, image_size=16, num_classes=10, noise=0.5, seed=0)
    batch = ds.batch(range(400))
    flat = batch["images"].flatten(1)
    templates = torch.from_numpy(ds.patterns).flatten(1)
    # Nearest-template classification recovers the labels: the classes carry real signal.
    predicted = torch.cdist(flat, templates).argmin(dim=1)
    assert (predicted == batch["labels"]).float().mean() > 0.9
    assert set(batch["labels"].tolist()) == set(range(10))


def test_dry_run_batch_fns_have_the_right_shapes_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    tokens = random_token_batch_fn(96, 32)(4, "cpu")
    images = random_image_batch_fn(3, 32, 10)(4, "cpu")
    assert torch.equal(state, torch.get_rng_state())
    assert tokens["input_ids"].shape == tokens["targets"].shape == (4, 32)
    assert torch.equal(tokens["input_ids"][:, 1:], tokens["targets"][:, :-1])
    assert images["images"].shape == (4, 3, 32, 32) and images["labels"].shape == (4,)


def test_text_dataset_over_a_given_text_keeps_whole_windows_only():
    text = "def f(x):\n    return x + 1\n" * 3
    ds = TextDataset(8, 100, text=text)
    assert len(ds) == (len(text) - 1) // 8  # fewer than asked: what the text holds
    b = ds.batch([1])
    assert decode(b["input_ids"][0]) == text[8:16] and decode(b["targets"][0]) == text[9:17]
    with pytest.raises(ConfigError, match="holds no window"):
        TextDataset(64, 10, text="too short")


def test_source_corpus_is_this_package_and_stable():
    text = source_corpus()
    assert len(text) > 100_000 and "class TextDataset" in text
    assert source_corpus() == text  # every worker on one install reads the same examples
