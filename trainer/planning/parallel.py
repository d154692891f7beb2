"""`ParallelPlan`: how one job's workers split the model and the batch, the one value that
crosses every boundary on the way from the planner to a worker.

The planner returns it (inside its `Plan`), the leader stores it in etcd inside the plan
document, the daemon hands it to each worker (the environment variable ``VARUNA_PLAN``) and
`Varuna` reads it. Every hop passes it whole: `to_dict`/`from_dict` go by the dataclass's
fields, so a field added here reaches the worker without touching the hops in between.

A worker's rank is the position of its process in torch.distributed; ``ranks[stage][replica]``
says which (stage, replica) it holds. The planner and the launcher number replica-major
(rank = replica * P + stage, the default); a script may pass another map to `Varuna`.

May import: trainer.planning.schedule, trainer.errors, the standard library (no torch, no numpy).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError, VarunaError
from trainer.planning.schedule import ScheduleError, schedule_named

__all__ = ["ParallelPlan", "ParallelPlanError", "MAX_WORKERS", "PER_STAGE", "PER_REPLICA", "micro_batches",
           "share_micro_batches", "replica_slice", "check_shares", "per_stage_fields", "per_replica_fields"]

# More workers than any fleet has; a plan read from etcd that claims more is refused before its
# rank table is built (P = D = 10**9 would otherwise be 10**18 entries).
MAX_WORKERS = 1 << 16
_MAX_INDEX = (1 << 31) - 1   # micro-batch sizes, cut points, shares: anything that indexes real memory


# The metadata of a field sized by the plan's stages: when a stage_to_rank_map reshapes a plan,
# such a field no longer applies and goes back to None (the script or Varuna chooses again), while
# every other field is carried over. A new per-stage field says so here, where it is declared.
PER_STAGE: Mapping[str, bool] = {"per_stage": True}
# The same for a field sized by the plan's replicas: it no longer applies once D changes.
PER_REPLICA: Mapping[str, bool] = {"per_replica": True}


def per_stage_fields(plan: Any) -> tuple[str, ...]:
    """The names of `plan`'s fields (a ParallelPlan or a subclass, or its class) sized by its stages."""
    return tuple(f.name for f in dataclasses.fields(plan) if f.metadata.get("per_stage"))


def per_replica_fields(plan: Any) -> tuple[str, ...]:
    """The names of `plan`'s fields (a ParallelPlan or a subclass, or its class) sized by its replicas."""
    return tuple(f.name for f in dataclasses.fields(plan) if f.metadata.get("per_replica"))


class ParallelPlanError(VarunaError, ValueError):
    """A parallel plan that is not one: shapes that disagree, ranks twice, unknown schedule."""


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"the {name} must be a positive integer, got {value!r}")


def _even_share(batch: int, replicas: int) -> int:
    if batch % replicas:
        fits = [d for d in range(1, min(batch, 64) + 1) if batch % d == 0]
        raise ConfigError(f"the global batch {batch} does not split evenly over {replicas} replicas",
                          hint=f"use a global batch divisible by {replicas}, or one of {', '.join(map(str, fits))} "
                               f"replicas")
    return batch // replicas


def share_micro_batches(share: int, chunk: int) -> tuple[int, ...]:
    """The sizes of the micro-batches of one replica's share: ``chunk`` each, the last one smaller
    when ``chunk`` does not divide the share."""
    _check_positive("share", share)
    _check_positive("micro-batch size", chunk)
    full, rest = divmod(share, chunk)
    return (chunk,) * full + ((rest,) if rest else ())


def micro_batches(batch: int, replicas: int, chunk: int) -> tuple[int, ...]:
    """The sizes of one replica's micro-batches: the global batch split evenly over the replicas,
    each share cut into micro-batches of ``chunk``, the last one smaller when ``chunk`` does not
    divide the share. The one rule for batch and micro-batch sizes: the engine checks it for its
    plan, ``varunactl submit`` for one replica (the planner then picks only replica counts that
    divide the batch). The loss is normalised by the global batch, so an uneven split changes
    the work per micro-batch, never the model. A plan with `ParallelPlan.shares` splits the batch
    by them instead (`replica_slice`, then `share_micro_batches`)."""
    for name, value in (("global batch", batch), ("micro-batch size", chunk), ("replica count", replicas)):
        _check_positive(name, value)
    return share_micro_batches(_even_share(batch, replicas), chunk)


def check_shares(batch: int, shares: Sequence[int]) -> None:
    """Uneven shares still make up the global batch: every example once, none made up."""
    _check_positive("global batch", batch)
    for share in shares:
        _check_positive("share of a replica", share)
    total = sum(shares)
    if total != batch:
        raise ConfigError(f"the plan's shares {list(shares)} add up to {total} examples, the global batch is {batch}",
                          hint="give each replica a share so that they add up to the global batch, or no shares "
                               "(an even split)")


def replica_slice(batch: int, replicas: int, shares: Sequence[int] | None, replica: int) -> tuple[int, int]:
    """(offset, size) of replica ``replica``'s examples in a global batch of ``batch``: the one rule
    for where they are. Replica r takes the r-th contiguous slice, ``shares[r]`` examples long, or
    batch / replicas without shares. Contiguous slices in replica order keep the global index of
    every example, which keys its random draws (trainer.graph.keyed_rng)."""
    _check_positive("global batch", batch)
    _check_positive("replica count", replicas)
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
        raise ConfigError(f"replica {replica!r} is outside 0..{replicas - 1}")
    if shares is None:
        share = _even_share(batch, replicas)
        return replica * share, share
    if len(shares) != replicas:
        raise ConfigError(f"the plan's shares {list(shares)} name {len(shares)} replicas, the plan has {replicas}",
                          hint="give one share per replica, in replica order")
    check_shares(batch, shares)
    return sum(shares[:replica]), shares[replica]


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the fields hold (a frozen value must not hold a list)."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def _lists(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_lists(v) for v in value]
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    P: int                                      # pipeline stages
    D: int                                      # data-parallel replicas of each stage
    micro_batch_size: int | None = None         # None: the script's chunk_size
    schedule: str | None = None                 # None: the script's (default varuna)
    # active cut points; None: Varuna balances them
    cuts: tuple[int, ...] | None = dataclasses.field(default=None, metadata=PER_STAGE)
    # per stage; None: the script's choice
    recompute: tuple[bool, ...] | None = dataclasses.field(default=None, metadata=PER_STAGE)
    ranks: tuple[tuple[int, ...], ...] | None = None  # [stage][replica] -> rank; None: replica-major
    # examples of the global batch each replica takes per step, in replica order (a slow replica
    # takes fewer); None: an even split. Their sum is the global batch, which the engine checks.
    shares: tuple[int, ...] | None = dataclasses.field(default=None, metadata=PER_REPLICA)

    def __post_init__(self) -> None:
        for name in ("P", "D"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelPlanError(f"{name} must be an int >= 1, got {value!r}")
        P, D = self.P, self.D
        if P * D > MAX_WORKERS:
            raise ParallelPlanError(f"a {P}x{D} plan has more than {MAX_WORKERS} workers")
        mbs = self.micro_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or not 1 <= mbs <= _MAX_INDEX):
            raise ParallelPlanError(f"micro_batch_size must be an int in 1..{_MAX_INDEX}, got {mbs!r}")
        if self.schedule is not None:
            try:
                schedule_named(self.schedule)
            except ScheduleError as exc:
                raise ParallelPlanError(str(exc)) from None
        if self.cuts is not None:
            cuts = _tuples(self.cuts)
            if (len(cuts) != P - 1 or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= _MAX_INDEX
                                              for c in cuts)
                    or list(cuts) != sorted(set(cuts))):
                raise ParallelPlanError(f"a plan of {P} stages needs {P - 1} increasing cut points, got {list(cuts)}")
            object.__setattr__(self, "cuts", cuts)
        if self.recompute is not None:
            flags = _tuples(self.recompute)
            if len(flags) != P or not all(isinstance(f, bool) for f in flags):
                raise ParallelPlanError(f"recompute needs one true/false per stage ({P}), got {list(flags)}")
            object.__setattr__(self, "recompute", flags)
        if self.shares is not None:
            object.__setattr__(self, "shares", self._checked_shares(_tuples(self.shares)))
        ranks = _tuples(self.ranks) if self.ranks is not None else tuple(
            tuple(r * P + s for r in range(D)) for s in range(P))
        if len(ranks) != P or any(len(row) != D for row in ranks):
            raise ParallelPlanError(f"ranks must be {P} stages of {D} replicas, got {_lists(ranks)}")
        flat = sorted(r for row in ranks for r in row) if all(
            isinstance(r, int) and not isinstance(r, bool) for row in ranks for r in row) else None
        if flat != list(range(P * D)):
            raise ParallelPlanError(f"ranks must hold 0..{P * D - 1} once each, got {_lists(ranks)}")
        object.__setattr__(self, "ranks", ranks)

    def _checked_shares(self, shares: Any) -> tuple[int, ...]:
        if (not isinstance(shares, tuple) or len(shares) != self.D
                or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= _MAX_INDEX for n in shares)):
            raise ParallelPlanError(f"shares needs one number of examples >= 1 per replica ({self.D}), "
                                    f"got {_lists(shares)!r:.100}")
        return shares

    @classmethod
    def from_stage_to_rank(cls, stage_to_rank: Mapping[Any, Sequence[Any]], **fields: Any) -> ParallelPlan:
        """The plan of the original Varuna API's ``stage_to_rank_map`` ({stage: [rank per replica]})."""
        try:
            rows = {int(s): tuple(int(r) for r in ranks) for s, ranks in stage_to_rank.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ParallelPlanError(f"stage_to_rank_map must map stage -> [ranks], got {stage_to_rank!r:.100}") from exc
        if sorted(rows) != list(range(len(rows))) or not rows:
            raise ParallelPlanError(f"stages must be numbered 0..P-1, got {sorted(rows)}")
        widths = {len(r) for r in rows.values()}
        if len(widths) != 1:
            raise ParallelPlanError(f"every stage needs the same number of replicas, got {stage_to_rank!r:.100}")
        return cls(P=len(rows), D=widths.pop(), ranks=tuple(rows[s] for s in range(len(rows))), **fields)

    @property
    def world_size(self) -> int:
        return self.P * self.D

    @property
    def shape(self) -> str:
        return f"{self.P}x{self.D}"

    @property
    def stage_to_rank(self) -> dict[int, list[int]]:
        return {s: list(row) for s, row in enumerate(self.ranks)}

    def rank_of(self, stage: int, replica: int) -> int:
        return self.ranks[stage][replica]

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for stage, row in enumerate(self.ranks):
            if rank in row:
                return stage, row.index(rank)
        raise ParallelPlanError(f"rank {rank} is in no stage of a {self.shape} plan")

    def positions(self) -> dict[int, tuple[int, int]]:
        """rank -> (stage, replica), every rank at once."""
        return {rank: (stage, replica) for stage, row in enumerate(self.ranks) for replica, rank in enumerate(row)}

    def replace(self, **changes: Any) -> ParallelPlan:
        """A copy with `changes`; a new D drops the fields sized by the replicas (unless given),
        which no longer say anything about the new ones."""
        if changes.get("D", self.D) != self.D:
            changes = {**dict.fromkeys(per_replica_fields(self)), **changes}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, tuples as lists."""
        return {f.name: _lists(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ParallelPlan:
        """The plan from `to_dict`'s form; fields this release does not know (a newer one's) are
        left out, anything else wrong is a ParallelPlanError."""
        if not isinstance(doc, Mapping):
            raise ParallelPlanError(f"a parallel plan is a JSON object, got {doc!r:.100}")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: _tuples(v) for k, v in doc.items() if k in known})
        except TypeError as exc:   # a required field missing
            raise ParallelPlanError(f"malformed parallel plan: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ParallelPlanError(f"a parallel plan is JSON, got {text[:100]!r}: {exc}") from None
        return cls.from_dict(doc)
