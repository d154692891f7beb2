"""Pipeline schedules as data: per-stage lists of actions that the executor runs and the simulator replays.

An `Action` is (stage, kind, micro-batch) with a short text form: ``2F0`` (stage 2 forwards
micro-batch 0), ``1RG3`` (stage 1 receives the gradient of micro-batch 3), ``0AR`` (all-reduce),
``0OPT`` (optimizer step). A schedule is one `Schedule` record in `SCHEDULES`: its generator
(`varuna`, `gpipe`, `one_f_one_b`, `zero_bubble`) returns the compute-only order of one stage, its stash rule says
how many micro-batches a stage holds, and `build_table` adds the communication with one pure pass,
so the executor and the simulator read the very same lists and the planner the very same rule.

Semantics shared by every consumer (stages 0..P-1, micro-batches 0..m-1):

* FORWARD m on a stage s < P-1 with recompute on runs without keeping the autograd graph (only its
  input is stashed); RECOMPUTE m re-runs it with the graph before BACKWARD m. The last stage never
  recomputes: its FORWARD keeps the graph and computes the loss.
* RECV_ACT m comes immediately before FORWARD m on s > 0, SEND_ACT m immediately after it on
  s < P-1; RECV_GRAD m comes before BACKWARD m on s < P-1 (Varuna: after RECOMPUTE m, so the
  recompute overlaps the wait for the gradient; GPipe/1F1B: before it, as a framework that
  recomputes inside backward does), SEND_GRAD m immediately after BACKWARD m on s > 0.
* WEIGHT m, where a stage's list has it, is the second half of a split backward: BACKWARD m then
  computes only the gradient of the stage's input (what the previous stage waits for) and WEIGHT m,
  later, the parameters' gradients (zero-bubble schedules; the engine's `split_backward`). A stage
  has a WEIGHT for every micro-batch or for none. The micro-batch's activations live until its
  WEIGHT, so the stash rules count a micro-batch until then.
* Receives block, sends do not. After the last BACKWARD every stage runs one ALLREDUCE (over its
  data-parallel replicas) and one STEP.
"""

from __future__ import annotations

import enum
import functools
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from trainer.errors import VarunaError

__all__ = [
    "Kind",
    "Action",
    "ScheduleError",
    "Schedule",
    "SCHEDULES",
    "DEFAULT_SCHEDULE",
    "schedule_named",
    "AUTO_SCHEDULE",
    "check_choice",
    "Recompute",
    "stash_bound",
    "varuna",
    "gpipe",
    "one_f_one_b",
    "zero_bubble",
    "build_table",
    "validate",
]


class ScheduleError(VarunaError, ValueError):
    """A schedule table breaks a rule (or would deadlock); the message says which."""


class Kind(enum.Enum):
    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"
    WEIGHT = "W"
    RECV_ACT = "RA"
    SEND_ACT = "SA"
    RECV_GRAD = "RG"
    SEND_GRAD = "SG"
    ALLREDUCE = "AR"
    STEP = "OPT"


_STAGE_WIDE = frozenset({Kind.ALLREDUCE, Kind.STEP})
# Longest codes first so that "RA" is not read as "R" followed by garbage.
_ACTION_RE = re.compile(
    r"^(\d+)(" + "|".join(sorted((k.value for k in Kind), key=len, reverse=True)) + r")(\d+)?$"
)


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: Kind
    micro_batch: int | None = None  # None for ALLREDUCE / STEP

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"action kind must be a Kind, got {self.kind!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ScheduleError(f"action stage must be an int >= 0, got {self.stage!r}")
        if self.kind in _STAGE_WIDE:
            if self.micro_batch is not None:
                raise ScheduleError(f"{self.kind.name} takes no micro-batch, got {self.micro_batch!r}")
        elif (
            isinstance(self.micro_batch, bool)
            or not isinstance(self.micro_batch, int)
            or self.micro_batch < 0
        ):
            raise ScheduleError(
                f"{self.kind.name} needs a micro-batch int >= 0, got {self.micro_batch!r}"
            )

    def __str__(self) -> str:
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.stage}{self.kind.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r} (expected e.g. '2F0', '1RG3', '0AR')")
        stage, code, mb = match.groups()
        return cls(int(stage), Kind(code), None if mb is None else int(mb))


def _act(stage: int, kind: Kind, mb: int | None = None) -> Action:
    """An Action built from values valid by construction, skipping `__post_init__`: tables
    hold P x m x ~6 of them and the planner builds several per decision."""
    a = object.__new__(Action)
    object.__setattr__(a, "stage", stage)
    object.__setattr__(a, "kind", kind)
    object.__setattr__(a, "micro_batch", mb)
    return a


def _check_args(P: int, m: int, stage: int | None = None) -> None:
    if P < 1:
        raise ScheduleError(f"pipeline depth P must be >= 1, got {P}")
    if m < 1:
        raise ScheduleError(f"number of micro-batches m must be >= 1, got {m}")
    if stage is not None and not 0 <= stage < P:
        raise ScheduleError(f"stage {stage} is outside 0..{P - 1}")


Recompute = bool | Sequence[bool]  # one flag for all stages, or one per stage


def _flags(P: int, recompute: Recompute) -> tuple[bool, ...]:
    """Per-stage recompute decisions; the last stage never recomputes."""
    if isinstance(recompute, (bool, int)):
        flags = (bool(recompute),) * P
    else:
        flags = tuple(bool(r) for r in recompute)
        if len(flags) != P:
            raise ScheduleError(f"recompute needs one flag per stage ({P}), got {len(flags)}")
    return flags[:-1] + (False,)


def _recomputes(P: int, stage: int, recompute: Recompute) -> bool:
    return _flags(P, recompute)[stage]


def _backward_unit(P: int, stage: int, mb: int, recompute: Recompute) -> list[Action]:
    out = [_act(stage, Kind.RECOMPUTE, mb)] if _recomputes(P, stage, recompute) else []
    return out + [_act(stage, Kind.BACKWARD, mb)]


def gpipe(P: int, m: int, stage: int, recompute: Recompute = True) -> list[Action]:
    """All forwards, then all backwards in micro-batch order (recompute right before each)."""
    _check_args(P, m, stage)
    out = [_act(stage, Kind.FORWARD, k) for k in range(m)]
    for k in range(m):
        out += _backward_unit(P, stage, k, recompute)
    return out


def one_f_one_b(P: int, m: int, stage: int, recompute: Recompute = True) -> list[Action]:
    """PipeDream-flush: P-s-1 warm-up forwards, then pairs of one forward and one backward,
    then the remaining backwards. At most P-s micro-batches are stashed on stage s (`_one_f_one_b_stash`)."""
    _check_args(P, m, stage)
    warmup = min(P - stage - 1, m)
    out = [_act(stage, Kind.FORWARD, k) for k in range(warmup)]
    for k in range(m - warmup):
        out.append(_act(stage, Kind.FORWARD, warmup + k))
        out += _backward_unit(P, stage, k, recompute)
    for k in range(m - warmup, m):
        out += _backward_unit(P, stage, k, recompute)
    return out


def zero_bubble(P: int, m: int, stage: int, recompute: Recompute = True) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's order of forwards
    and backwards, with each backward after the first stage split in two. BACKWARD computes only
    the input gradient the previous stage waits for; stage s defers the WEIGHT passes by s
    micro-batches, and the deferred ones fill the drain, where 1F1B's later stages sit idle while
    the last gradients travel up. With forward, input and weight gradients of equal cost the
    bubble shrinks from 3(P-1) to (P-1) units. Every stage then holds up to P micro-batches (the
    first stage's 1F1B count, so the peak over stages is 1F1B's; `_zero_bubble_stash`).

    The first stage keeps its backward whole: nothing waits for its input gradient. A stage that
    recomputes does not defer (WEIGHT right after BACKWARD): it would otherwise hold several
    recomputed activation sets at once."""
    _check_args(P, m, stage)
    if stage == 0:
        return one_f_one_b(P, m, stage, recompute)
    defer = 0 if _recomputes(P, stage, recompute) else stage
    warmup = min(P - stage - 1, m)
    out = [_act(stage, Kind.FORWARD, k) for k in range(warmup)]
    weighed = 0
    for k in range(m):
        if warmup + k < m:
            out.append(_act(stage, Kind.FORWARD, warmup + k))
        out += _backward_unit(P, stage, k, recompute)
        if k >= defer:
            out.append(_act(stage, Kind.WEIGHT, k - defer))
            weighed = k - defer + 1
    return out + [_act(stage, Kind.WEIGHT, k) for k in range(weighed, m)]


# Costs of the idealised run that orders Varuna's actions. A backward costs twice a forward and
# a recompute as much as a forward; the partitioner balances stages by their whole work, so a
# stage that does not recompute (the last one always) is modelled as equally loaded: 4 + 8 = 12
# units like 3 + 3 + 6. Ordering for a cheaper last stage instead (1, 1, 2 everywhere) makes
# the table up to 20% slower than 1F1B on a balanced pipeline in the simulator.
_COSTS = {True: (3, 3, 6), False: (4, 0, 8)}  # recompute? -> forward, recompute, backward


@functools.lru_cache(maxsize=256)
def _varuna_orders(P: int, m: int, flags: tuple[bool, ...]) -> tuple[tuple[Action, ...], ...]:
    """Order every stage's work by an idealised, event-driven run of the whole pipeline.

    Whenever a stage is idle it starts the ready task of highest priority, backward > recompute
    > forward, each kind in micro-batch order:
      * FORWARD k is ready once stage s-1 finished FORWARD k, and only while the stage stashes
        fewer than its bound of micro-batches (forwarded, backward not finished; `_varuna_stash`): P-s where the
        full activations are kept (the 1F1B bound), 2(P-s) where the stage recomputes, since it
        then stashes only each micro-batch's input boundary. The slack lets a recomputing stage
        run ahead with forwards while gradients are late, which is where Varuna's tolerance of
        a jittery network comes from (the paper's generator has no bound at all; with exactly
        P-s it loses to 1F1B, with 2(P-s) it beats 1F1B and GPipe in the simulator).
      * RECOMPUTE k is ready once stage s+1 *started* BACKWARD k, so it runs while the gradient
        is being computed downstream and is done by the time it arrives; at most one recomputed
        micro-batch waits for its backward, so recompute never holds two full activation sets.
      * BACKWARD k is ready once the gradient arrived (stage s+1 finished BACKWARD k, or the
        stage's own FORWARD k on the last stage) and, when recomputing, RECOMPUTE k is done.
    Communication is free here. At each instant stages decide from the last one down, so that
    a stage sees a backward its successor starts at that instant. Deterministic by construction.
    """
    fin_f = [[None] * m for _ in range(P)]
    fin_r = [[None] * m for _ in range(P)]
    start_b = [[None] * m for _ in range(P)]
    fin_b = [[None] * m for _ in range(P)]
    next_f, next_r, next_b = [0] * P, [0] * P, [0] * P
    done_b = [0] * P  # backwards finished (they finish in micro-batch order)
    busy_until = [0] * P
    orders: list[list[Action]] = [[] for _ in range(P)]
    remaining = P * m
    t = 0
    bounds = [_varuna_stash(P, s, m, flags[s]) for s in range(P)]

    def by(x: int | None) -> bool:  # the event happened at or before now
        return x is not None and x <= t

    while remaining:
        for s in range(P - 1, -1, -1):
            if busy_until[s] > t:
                continue
            rec = flags[s]
            f_cost, r_cost, b_cost = _COSTS[rec]
            kb, kr, kf = next_b[s], next_r[s], next_f[s]
            while done_b[s] < kb and by(fin_b[s][done_b[s]]):
                done_b[s] += 1
            if kb < m and kb < kf:
                grad_ready = by(fin_f[s][kb]) if s == P - 1 else by(fin_b[s + 1][kb])
                if grad_ready and (not rec or by(fin_r[s][kb])):
                    start_b[s][kb], fin_b[s][kb] = t, t + b_cost
                    busy_until[s] = t + b_cost
                    next_b[s] += 1
                    remaining -= 1
                    orders[s].append(_act(s, Kind.BACKWARD, kb))
                    continue
            if rec and kr < m and kr == kb and by(start_b[s + 1][kr]):
                fin_r[s][kr] = busy_until[s] = t + r_cost
                next_r[s] += 1
                orders[s].append(_act(s, Kind.RECOMPUTE, kr))
                continue
            if kf < m and kf - done_b[s] < bounds[s] and (s == 0 or by(fin_f[s - 1][kf])):
                fin_f[s][kf] = busy_until[s] = t + f_cost
                next_f[s] += 1
                orders[s].append(_act(s, Kind.FORWARD, kf))
        later = [b for b in busy_until if b > t]
        if not later:  # nobody is busy and nothing could start: a bug, not bad input
            raise ScheduleError(f"varuna ordering stalled for P={P}, m={m}, recompute={flags}")
        t = min(later)  # readiness only changes when some task ends
    return tuple(tuple(o) for o in orders)


def varuna(P: int, m: int, stage: int, recompute: Recompute = True) -> list[Action]:
    """Varuna's schedule (EuroSys 2022, section 3.2): backward > recompute > forward, recompute
    just in time for the gradient, memory bounded like 1F1B. See `_varuna_orders`."""
    _check_args(P, m, stage)
    return list(_varuna_orders(P, m, _flags(P, recompute))[stage])


ScheduleFn = Callable[[int, int, int, Recompute], list[Action]]


# The memory rule of each schedule: how many micro-batches stage `stage` of P holds at most
# (forwarded, backward not yet finished) with m micro-batches, given whether it recomputes.
# The planner sizes stages by it; the generators above produce orders whose peak is exactly
# this (tests/unit/test_schedule.py checks it against the orders), and Varuna's ordering enforces it.
def _varuna_stash(P: int, stage: int, m: int, recompute: bool) -> int:
    # a recomputing stage keeps only each micro-batch's input, so it may run twice as far ahead
    return min(m, (2 if recompute else 1) * (P - stage))


def _gpipe_stash(P: int, stage: int, m: int, recompute: bool) -> int:
    return m  # every forward before any backward


def _one_f_one_b_stash(P: int, stage: int, m: int, recompute: bool) -> int:
    return min(m, P - stage)  # the warm-up forwards plus the one in flight


def _zero_bubble_stash(P: int, stage: int, m: int, recompute: bool) -> int:
    # 1F1B's count plus the `stage` deferred WEIGHT passes; a recomputing stage does not defer
    return min(m, P - stage if recompute or stage == 0 else P)


StashRule = Callable[[int, int, int, bool], int]


@dataclass(frozen=True)
class Schedule:
    """Everything the executor, the simulator and the planner know of one schedule, in one record,
    so that a schedule cannot be half added: a fact kept elsewhere under the schedule's name would
    give wrong estimates, not an error, where it was forgotten. [Note: a schedule is data]"""

    name: str
    order: ScheduleFn  # the compute-only order of one stage; `table` adds the communication
    stash: StashRule  # the memory rule above: exact for the orders `order` produces
    # RECV_GRAD after RECOMPUTE, so the recompute hides the wait; otherwise the gradient comes
    # first, as in a framework that recomputes inside backward
    overlap_recompute: bool
    # how many micro-batches a stage forwards ahead of its backwards, where that is fewer than it
    # stashes (zero-bubble: its stash holds deferred WEIGHT passes, not forwards run ahead)
    ahead: StashRule | None = None
    # stages after the first split their backward (a WEIGHT per micro-batch): each holds, from a
    # micro-batch's BACKWARD to its WEIGHT, the gradients recorded between the two passes
    split_backward: bool = False

    def splits(self, P: int, stage: int) -> bool:
        """Whether stage `stage` of P runs split backwards (and holds what they keep between passes)."""
        return self.split_backward and P > 1 and stage > 0

    def table(self, P: int, m: int, recompute: Recompute = True) -> dict[int, list[Action]]:
        """Every stage's full list: compute, communication, then ALLREDUCE and STEP. `recompute` is
        one flag for every stage or one per stage (the planner recomputes only where memory needs)."""
        _check_args(P, m)
        return {s: _with_comm(self.order(P, m, s, recompute), P, s, self.overlap_recompute) for s in range(P)}

    def stash_bound(self, P: int, stage: int, m: int, recompute: bool) -> int:
        """The most micro-batches stage `stage` of a P-stage pipeline stashes with m micro-batches
        (the last stage never recomputes, whatever `recompute` says)."""
        _check_args(P, m, stage)
        return self.stash(P, stage, m, bool(recompute) and stage < P - 1)

    def stash_bounds(self, P: int, m: int) -> tuple[tuple[int, int], ...]:
        """Per stage, `stash_bound` without and with recompute: the planner's hot loop reads this."""
        return _stash_bounds(self, P, m)

    def has_slack(self, P: int, stage: int, recompute: bool) -> bool:
        """Whether the stage may run further ahead than the P-s micro-batches that keep the pipeline
        full. One that may not (1F1B; Varuna where it keeps full activations) has no slack to hide
        a message in its steady state, so the planner's closed form charges it the hop; read off
        the memory rule (or the `ahead` rule where there is one), as the orders are bound by it."""
        _check_args(P, 1, stage)
        rule = self.ahead or self.stash
        return rule(P, stage, P - stage + 1, bool(recompute) and stage < P - 1) > P - stage


@functools.lru_cache(maxsize=1024)
def _stash_bounds(schedule: Schedule, P: int, m: int) -> tuple[tuple[int, int], ...]:
    return tuple((schedule.stash_bound(P, s, m, False), schedule.stash_bound(P, s, m, True)) for s in range(P))


# The registry. Adding a schedule is its generator and stash rule above, one record here, and its
# golden tables (tests/golden); the tests of every rule above run over every record.
SCHEDULES: Mapping[str, Schedule] = types.MappingProxyType({
    s.name: s for s in (
        Schedule("varuna", varuna, _varuna_stash, overlap_recompute=True),
        Schedule("gpipe", gpipe, _gpipe_stash, overlap_recompute=False),
        Schedule("1f1b", one_f_one_b, _one_f_one_b_stash, overlap_recompute=False),
        Schedule("zb-h1", zero_bubble, _zero_bubble_stash, overlap_recompute=False, ahead=_one_f_one_b_stash,
                 split_backward=True),
    )
})


# What a job, a plan or a script that names no schedule runs: Varuna's own (the paper's).
DEFAULT_SCHEDULE = "varuna"
# What a job names to have the planner pick, by the simulator's replay, the fastest schedule for
# each plan it makes. Never a plan's schedule: a plan names the one its workers run.
AUTO_SCHEDULE = "auto"


def schedule_named(name: object) -> Schedule:
    """The record of schedule `name`. The one place a name is checked: a job spec, a plan read
    from etcd, the planner and the launcher all refuse an unknown one in the same words."""
    found = SCHEDULES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ScheduleError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    return found


def check_choice(name: object) -> str:
    """A job's schedule: a schedule's name or `AUTO_SCHEDULE`; refused in `schedule_named`'s words."""
    if name == AUTO_SCHEDULE:
        return AUTO_SCHEDULE
    try:
        return schedule_named(name).name
    except ScheduleError as exc:
        raise ScheduleError(f"{exc}, or {AUTO_SCHEDULE!r} to let the planner choose") from None


def stash_bound(name: str, P: int, stage: int, m: int, recompute: bool) -> int:
    """`Schedule.stash_bound` of the schedule called `name`."""
    return schedule_named(name).stash_bound(P, stage, m, recompute)


def build_table(name: str, P: int, m: int, recompute: Recompute = True) -> dict[int, list[Action]]:
    """`Schedule.table` of the schedule called `name`."""
    return schedule_named(name).table(P, m, recompute)


def _with_comm(compute: Sequence[Action], P: int, stage: int, overlap: bool) -> list[Action]:
    out: list[Action] = []
    got_grad: set[int] = set()
    s = stage
    for i, a in enumerate(compute):
        k = a.micro_batch
        if a.kind is Kind.FORWARD:
            if s > 0:
                out.append(_act(s, Kind.RECV_ACT, k))
            out.append(a)
            if s < P - 1:
                out.append(_act(s, Kind.SEND_ACT, k))
        elif a.kind is Kind.RECOMPUTE:
            nxt = compute[i + 1] if i + 1 < len(compute) else None
            if not overlap and s < P - 1 and nxt == _act(s, Kind.BACKWARD, k):
                out.append(_act(s, Kind.RECV_GRAD, k))
                got_grad.add(k)
            out.append(a)
        elif a.kind is Kind.BACKWARD:
            if s < P - 1 and k not in got_grad:
                out.append(_act(s, Kind.RECV_GRAD, k))
            out.append(a)
            if s > 0:
                out.append(_act(s, Kind.SEND_GRAD, k))
        elif a.kind is Kind.WEIGHT:
            out.append(a)
        else:
            raise ScheduleError(f"schedule generators return compute only, got {a}")
    return out + [_act(s, Kind.ALLREDUCE), _act(s, Kind.STEP)]


def _positions(actions: Sequence[Action], stage: int, m: int) -> dict[tuple[Kind, int], int]:
    pos: dict[tuple[Kind, int], int] = {}
    for i, a in enumerate(actions):
        if a.stage != stage:
            raise ScheduleError(f"action {a} is listed under stage {stage}")
        if a.kind in _STAGE_WIDE:
            continue
        if a.micro_batch >= m:
            raise ScheduleError(f"action {a} names micro-batch {a.micro_batch}, but m={m}")
        if (a.kind, a.micro_batch) in pos:
            raise ScheduleError(f"action {a} appears twice on stage {stage}")
        pos[(a.kind, a.micro_batch)] = i
    return pos


def validate(table: Mapping[int, Sequence[Action]], P: int, m: int, recompute: Recompute) -> None:
    """Raise ScheduleError naming the first rule the table breaks."""
    _check_args(P, m)
    flags = _flags(P, recompute)
    if sorted(table) != list(range(P)):
        raise ScheduleError(f"table has stages {sorted(table)}, expected 0..{P - 1}")
    for s in range(P):
        acts = list(table[s])
        pos = _positions(acts, s, m)
        rec = flags[s]
        expected = {Kind.FORWARD, Kind.BACKWARD}
        expected |= {Kind.RECOMPUTE} if rec else set()
        expected |= {Kind.RECV_ACT} if s > 0 else set()
        expected |= {Kind.SEND_GRAD} if s > 0 else set()
        expected |= {Kind.SEND_ACT, Kind.RECV_GRAD} if s < P - 1 else set()
        if any(kind is Kind.WEIGHT for kind, _ in pos):
            if s == 0 and P > 1:
                raise ScheduleError(f"stage 0 of {P} must not split its backward (nothing waits for its input gradient)")
            expected.add(Kind.WEIGHT)
        for kind, k in pos:
            if kind not in expected:
                raise ScheduleError(f"stage {s} of {P} must not have {kind.name} (found {s}{kind.value}{k})")
        for kind in expected:
            for k in range(m):
                if (kind, k) not in pos:
                    raise ScheduleError(f"stage {s} lacks {Action(s, kind, k)} ({kind.name} of micro-batch {k})")
        for k in range(m):
            f, b = pos[(Kind.FORWARD, k)], pos[(Kind.BACKWARD, k)]
            if b < f:
                raise ScheduleError(f"{acts[b]} comes before its forward {acts[f]}")
            if rec and not f < pos[(Kind.RECOMPUTE, k)] < b:
                raise ScheduleError(f"{Action(s, Kind.RECOMPUTE, k)} must come between {acts[f]} and {acts[b]}")
            if s > 0 and pos[(Kind.RECV_ACT, k)] != f - 1:
                raise ScheduleError(f"{Action(s, Kind.RECV_ACT, k)} must come immediately before {acts[f]}")
            if s < P - 1 and pos[(Kind.SEND_ACT, k)] != f + 1:
                raise ScheduleError(f"{Action(s, Kind.SEND_ACT, k)} must come immediately after {acts[f]}")
            if s < P - 1 and not f < pos[(Kind.RECV_GRAD, k)] < b:
                raise ScheduleError(f"{Action(s, Kind.RECV_GRAD, k)} must come between {acts[f]} and {acts[b]}")
            if s > 0 and pos[(Kind.SEND_GRAD, k)] != b + 1:
                raise ScheduleError(f"{Action(s, Kind.SEND_GRAD, k)} must come immediately after {acts[b]}")
            if Kind.WEIGHT in expected and pos[(Kind.WEIGHT, k)] < b:
                raise ScheduleError(f"{Action(s, Kind.WEIGHT, k)} must come after {acts[b]}")
        tail = [str(a) for a in acts if a.kind in _STAGE_WIDE]
        if tail != [f"{s}AR", f"{s}OPT"] or [str(a) for a in acts[-2:]] != tail:
            raise ScheduleError(f"stage {s} must end with exactly {s}AR then {s}OPT, found {tail}")
