"""A replica's share of the step's global batch when the plan gives replicas uneven shares
(`ParallelPlan.shares`: a slow replica takes fewer examples).

A script may pass `step()` either this replica's own share (``GlobalBatches.shard(..., shares=
varuna.shares)``) or the even shard it always passed (``GlobalBatches.shard(step, replica, D)``),
which scripts written before shares existed still do. From even shards the replicas of a stage
put the global batch back together (an all-gather over the stage's group, in replica order) and
each keeps its share: the slices are contiguous in replica order either way, so every example
keeps its global index and the step computes what the even split computes
([Note: the global batch defines the math] in ARCHITECTURE.md).

Which of the two the script passed is decided by every replica of the stage together, from the
sizes all of them were given: a replica whose share is the even size cannot tell alone, and
replicas that decided apart would wait in different collectives. A stage that needs no inputs
needs no collective: only its count of examples matters there.

Plain functions of their arguments (the stage's process group, its ranks in replica order), so
that what needs none of Varuna's state lives apart from it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from trainer.engine.data_parallel import _wait
from trainer.errors import ConfigError

__all__ = ["is_uneven", "replica_order", "gathered_sizes", "share_of"]

_OWN = "GlobalBatches(...).shard(step, varuna.replica, varuna.data_depth, shares=varuna.shares)"
_EVEN = "GlobalBatches(...).shard(step, varuna.replica, varuna.data_depth)"


def _hint(even: int | None) -> str:
    # without an even shard (D does not divide the batch) only the shares say where examples are
    return f"pass {_OWN}" if even is None else f"pass {_EVEN}, or this replica's share: {_OWN}"


def is_uneven(shares: Sequence[int] | None) -> bool:
    """Whether `shares` split the batch other than evenly (equal shares are the even split)."""
    return shares is not None and len(set(shares)) > 1


def replica_order(group, stage_ranks: Sequence[int]) -> list[int]:
    """The position in `group` of each replica's rank, in replica order. A collective lists its
    results by group rank, which follows the global ranks the group was made of, not the plan's
    replica order (a stage_to_rank_map may number replicas in any order)."""
    members = list(dist.get_process_group_ranks(group))
    return [members.index(rank) for rank in stage_ranks]


def _gather(tensor: torch.Tensor, group, order: Sequence[int]) -> list[torch.Tensor]:
    """Every replica's `tensor` (all the same shape), in replica order. Waited on from Python, so
    that the daemon's rescue signal still reaches a worker whose peer vanished mid-exchange
    (`data_parallel._wait`)."""
    # gloo has no bool all-gather; the bytes are the same
    sent = tensor.contiguous().view(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    got = [torch.empty_like(sent) for _ in order]
    _wait(dist.all_gather(got, sent, group=group, async_op=True), sent.is_cuda)
    return [got[i].view(torch.bool) if tensor.dtype == torch.bool else got[i] for i in order]


def _signature(wanted: Mapping[str, torch.Tensor]) -> int:
    """What must be alike on every replica to put their even shards together: each input's name,
    dtype and shape past the batch dimension (a collator that pads each shard to its own longest
    sequence makes them differ)."""
    text = ";".join(f"{name}:{t.dtype}:{tuple(t.shape[1:])}" for name, t in sorted(wanted.items()))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def gathered_sizes(size: int, group, order: Sequence[int]) -> list[int]:
    """Every replica's `size`, in replica order (a collective over `group`)."""
    return [int(t[0]) for t in _gather(torch.tensor([size], dtype=torch.int64), group, order)]


def _accepted(share: int, even: int | None) -> str:
    return f"this replica's share ({share})" + ("" if even in (None, share) else f" or the even shard ({even})")


def _refuse(passed: int, share: int, even: int | None, replica: int) -> ConfigError:
    return ConfigError(f"step() got {passed} examples on replica {replica}; it takes {_accepted(share, even)}",
                       hint=_hint(even))


def _refuse_mixed(sizes: Sequence[int], shares: Sequence[int], even: int | None) -> ConfigError:
    return ConfigError(f"the replicas of a stage got {list(sizes)} examples: every one takes its share "
                       f"({list(shares)})" + ("" if even is None else f", or every one the even shard ({even})"),
                       hint=_hint(even))


def share_of(wanted: Mapping[str, torch.Tensor], passed: int, *, batch: int, shares: Sequence[int],
             replica: int, offset: int, group, order: Sequence[int]) -> dict[str, torch.Tensor]:
    """This replica's `shares[replica]` examples of each tensor in `wanted` (the inputs its stage
    needs), from the `passed` examples the script gave it. Collective over `group` (the stage's
    replicas) when `wanted` is not empty: every replica of the stage calls it at the same step."""
    share = shares[replica]
    even = batch // len(shares) if batch % len(shares) == 0 else None
    if not wanted:
        if passed not in (share, even):
            raise _refuse(passed, share, even, replica)
        return {}
    told = _gather(torch.tensor([passed, _signature(wanted)], dtype=torch.int64), group, order)
    sizes = [int(t[0]) for t in told]
    if sizes == list(shares):
        return dict(wanted)
    if even is not None and all(s == even for s in sizes):
        if len({int(t[1]) for t in told}) > 1:
            raise ConfigError("the replicas of a stage passed inputs that differ past the batch dimension ("
                              + ", ".join(f"{n} {tuple(t.shape[1:])}" for n, t in sorted(wanted.items()))
                              + " on this one): their even shards cannot be put together into the shares",
                              hint=f"pad every shard to one length, or pass {_OWN}")
        return {name: torch.cat(_gather(t, group, order))[offset:offset + share] for name, t in sorted(wanted.items())}
    # every replica of the stage saw the same sizes, so all of them refuse, none waits for the others
    raise _refuse(passed, share, even, replica) if passed not in (share, even) else _refuse_mixed(sizes, shares, even)
