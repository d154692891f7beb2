"""trainer/engine/replica_share.py: which examples a replica keeps when the plan gives uneven shares,
from the shard the script passed. The collectives are stood in for by what the stage's replicas
would have sent, in replica order; tests/integration/test_uneven_shares_launch.py runs them for real."""

from __future__ import annotations

import pytest
import torch

from trainer.engine import replica_share
from trainer.errors import ConfigError

SHARES = (5, 4, 3)   # global batch 12 over 3 replicas: replica 1's share is the even size


def _sent(monkeypatch, *gathers):
    """Each call of the stage's all-gather returns the next of `gathers` (a list in replica order)."""
    pending = list(gathers)

    def gather(tensor, group, order):
        assert pending, "a collective the replicas did not all call"
        return pending.pop(0)
    monkeypatch.setattr(replica_share, "_gather", gather)
    return pending


def _sizes(*sizes, shapes=None):
    """What the first exchange returns: each replica's count of examples and its inputs' signature
    (alike unless `shapes` says otherwise)."""
    return [torch.tensor([n, 7 if shapes is None else shapes[i]]) for i, n in enumerate(sizes)]


def _share(wanted, passed, replica, offset):
    return replica_share.share_of(wanted, passed, batch=12, shares=SHARES, replica=replica, offset=offset,
                                  group=None, order=[0, 1, 2])


def test_from_even_shards_each_replica_keeps_its_share_of_the_whole_batch(monkeypatch):
    ids = torch.arange(12 * 2).view(12, 2)
    mask = torch.arange(12) % 3 == 0
    even = [slice(0, 4), slice(4, 8), slice(8, 12)]
    for replica, offset in ((0, 0), (1, 5), (2, 9)):
        pending = _sent(monkeypatch, _sizes(4, 4, 4), [ids[s] for s in even], [mask[s] for s in even])
        got = _share({"mask": mask[even[replica]], "ids": ids[even[replica]]}, 4, replica, offset)
        assert not pending   # one collective of the sizes, one per input, in the order of their names
        share = slice(offset, offset + SHARES[replica])
        assert torch.equal(got["ids"], ids[share]) and torch.equal(got["mask"], mask[share])


def test_a_replica_given_its_share_keeps_it_even_where_it_is_the_even_size(monkeypatch):
    ids = torch.arange(12)
    pending = _sent(monkeypatch, _sizes(5, 4, 3))   # the others tell: these are shares
    got = _share({"ids": ids[5:9]}, 4, 1, 5)
    assert not pending and torch.equal(got["ids"], ids[5:9])


def test_sizes_that_are_neither_refuse_on_every_replica_naming_both(monkeypatch):
    _sent(monkeypatch, _sizes(5, 4, 4))   # replica 2 passed the even shard, the others their shares
    with pytest.raises(ConfigError, match=r"replicas of a stage got \[5, 4, 4\] examples.*\(\[5, 4, 3\]\).*\(4\)"):
        _share({"ids": torch.zeros(5)}, 5, 0, 0)
    _sent(monkeypatch, _sizes(5, 6, 3))
    # replica 1's share is the even size: one number, said once
    with pytest.raises(ConfigError, match=r"got 6 examples on replica 1; it takes this replica's share \(4\)") as info:
        _share({"ids": torch.zeros(6)}, 6, 1, 5)
    assert "shares=varuna.shares" in info.value.hint and "even shard (4)" not in str(info.value)


def test_a_stage_that_needs_no_inputs_needs_no_collective(monkeypatch):
    _sent(monkeypatch)   # any collective fails the test
    assert _share({}, 4, 0, 0) == {} and _share({}, 5, 0, 0) == {}
    with pytest.raises(ConfigError, match="got 6 examples on replica 0"):
        _share({}, 6, 0, 0)
    # a batch the replicas do not divide has no even shard to accept
    with pytest.raises(ConfigError, match=r"share \(4\) \(pass GlobalBatches") as info:
        replica_share.share_of({}, 3, batch=11, shares=(4, 4, 3), replica=0, offset=0, group=None, order=[0, 1, 2])
    assert info.value.hint.count("GlobalBatches") == 1


def test_replica_order_maps_group_ranks_back_to_replicas(monkeypatch):
    monkeypatch.setattr(replica_share.dist, "get_process_group_ranks", lambda group: [1, 4, 7])
    assert replica_share.replica_order(None, [7, 1, 4]) == [2, 0, 1]
    assert replica_share.is_uneven((5, 4, 3)) and not replica_share.is_uneven((4, 4, 4))
    assert not replica_share.is_uneven(None)


def test_even_shards_that_differ_past_the_batch_dimension_are_refused_on_every_replica(monkeypatch):
    """A collator that pads each shard to its own longest sequence: the shards cannot be stacked."""
    _sent(monkeypatch, _sizes(4, 4, 4, shapes=(7, 7, 9)))
    with pytest.raises(ConfigError, match=r"differ past the batch dimension \(ids \(6,\) on this one\)"):
        _share({"ids": torch.zeros(4, 6)}, 4, 0, 0)
    sig = replica_share._signature
    assert sig({"ids": torch.zeros(4, 6)}) == sig({"ids": torch.ones(9, 6)}) != sig({"ids": torch.zeros(4, 7)})
    assert sig({"ids": torch.zeros(4, 6)}) != sig({"ids": torch.zeros(4, 6, dtype=torch.int64)})
