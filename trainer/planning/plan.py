"""What the planner returns: a `Plan`, which is the `ParallelPlan` the workers will run (P x D,
micro-batch, schedule, cuts, recompute) with the planner's reasons around it (per-stage layout
and memory, the slot of each (stage, replica), the estimate and the runners-up), checked on
construction, and the `Slot`s it places workers on. trainer.planning.planner builds them.

May import: trainer.planning.schedule, trainer.planning.parallel, trainer.errors, the standard
library (no torch, no numpy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from trainer.errors import ConfigError, VarunaError
from trainer.planning.parallel import ParallelPlan, check_shares, micro_batches, share_micro_batches
from trainer.planning.schedule import Action, build_table

__all__ = ["PlanError", "ModelTooLarge", "Slot", "StagePlan", "Candidate", "Plan"]


class PlanError(VarunaError, ValueError):
    """No configuration fits, or the planner's inputs are inconsistent."""


class ModelTooLarge(PlanError):
    """A segment of the model does not fit any slot's memory even alone: no number of slots of
    the calibrated kinds can hold the model; only more memory per slot or finer cut points can."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One device a worker can run on."""

    slot_id: str
    host: str
    device_kind: str
    memory_bytes: int
    # The machine whose CPU cores the slot's worker computes on ("" = a device of its own, such as
    # a GPU, or unknown) and how many threads it runs there: workers on one machine share its
    # cores, whatever address each daemon advertises (`plan(machine_cores=...)`).
    machine: str = ""
    threads: int = 0

    def __post_init__(self) -> None:
        for name in ("slot_id", "host", "device_kind"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise PlanError(f"Slot.{name} must be a non-empty string")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise PlanError(f"Slot {self.slot_id}: memory_bytes must be a positive int, got {self.memory_bytes!r}")
        if not isinstance(self.machine, str):
            raise PlanError(f"Slot {self.slot_id}: machine must be a string")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise PlanError(f"Slot {self.slot_id}: threads must be a non-negative int, got {self.threads!r}")


@dataclass(frozen=True, slots=True)
class StagePlan:
    first_segment: int
    end_segment: int  # exclusive
    device_kind: str
    recompute: bool
    memory_bytes: int  # the bound described in the module docstring
    capacity_bytes: int
    compute_s: float  # forward + backward (+ recompute) of one micro-batch


@dataclass(frozen=True, slots=True)
class Candidate:
    """One scored configuration (the chosen one and its runners-up)."""

    P: int
    D: int
    micro_batch_size: int
    micro_batches: int
    kinds: tuple[str, ...]  # device kind per stage
    recomputing: int  # stages that recompute
    estimate_s: float  # closed-form screen
    simulated_s: float | None  # replay of the action table, for the best few


@dataclass(frozen=True, slots=True)
class Plan:
    parallel: ParallelPlan  # what the workers run; the fields below say why
    micro_batches: int  # m, per replica (the largest share's, where replicas take uneven shares)
    global_batch: int
    stages: tuple[StagePlan, ...]
    assignment: Mapping[str, tuple[int, int]]  # slot id -> (stage, replica)
    link_kinds: tuple[str, ...]  # between stage s and s+1
    allreduce_kinds: tuple[str, ...]
    estimated_s: float  # simulated mini-batch time
    unused: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    ruled_out: tuple[str, ...] = ()  # why the obvious plans (1 x every slot, 1 x 1) were not chosen
    # per stage: how many times slower than calibrated it computes because the plan puts more
    # threads on its machine's cores than its calibration ran with (() = none shared)
    contention: tuple[float, ...] = ()

    def alternatives(self, n: int = 3) -> list[Candidate]:
        """The next ``n`` runners-up (other shapes or micro-batch sizes than the chosen plan's)."""
        mine = (self.P, self.D, self.micro_batch_size)
        return [c for c in self.candidates if (c.P, c.D, c.micro_batch_size) != mine][:n]

    def __post_init__(self) -> None:
        par = self.parallel
        if par.micro_batch_size is None or par.schedule is None or par.cuts is None or par.recompute is None:
            raise PlanError(f"a planned ParallelPlan decides micro-batch, schedule, cuts and recompute: {par}")
        if self.micro_batches < 1:
            raise PlanError(f"m must be >= 1, got {self.micro_batches}")
        if par.recompute != tuple(s.recompute for s in self.stages):
            raise PlanError(f"the plan's recompute flags {par.recompute} are not its stages'")
        if par.shares is not None:
            try:
                check_shares(self.global_batch, par.shares)
            except ConfigError as exc:
                raise PlanError(str(exc)) from None
            most = max(len(share_micro_batches(share, self.micro_batch_size)) for share in par.shares)
            if most != self.micro_batches:
                raise PlanError(f"m = {self.micro_batches}, but the largest share {max(par.shares)} makes {most} "
                                f"micro-batches of at most {self.micro_batch_size}")
        else:
            try:
                split = micro_batches(self.global_batch, self.D, self.micro_batch_size)
            except ConfigError as exc:
                raise PlanError(str(exc)) from None
            if len(split) != self.micro_batches:
                raise PlanError(f"m = {self.micro_batches}, but the global batch {self.global_batch} over {self.D} "
                                f"replicas makes {len(split)} micro-batches of at most {self.micro_batch_size}")
        if len(self.stages) != self.P:
            raise PlanError(f"a plan of {self.P} stages needs {self.P} stage plans, got {len(self.stages)}")
        if sorted(self.assignment.values()) != [(s, r) for s in range(self.P) for r in range(self.D)]:
            raise PlanError("the assignment must give every (stage, replica) exactly one slot")
        object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))

    def __hash__(self) -> int:
        return hash((self.parallel, tuple(sorted(self.assignment.items()))))

    # The parallel plan's fields, read through: the planner's callers and tests say plan.P.
    @property
    def P(self) -> int:
        return self.parallel.P

    @property
    def D(self) -> int:
        return self.parallel.D

    @property
    def micro_batch_size(self) -> int:
        return self.parallel.micro_batch_size

    @property
    def schedule(self) -> str:
        return self.parallel.schedule

    @property
    def cuts(self) -> tuple[int, ...]:
        return self.parallel.cuts

    @property
    def recompute(self) -> tuple[bool, ...]:
        return self.parallel.recompute

    def table(self) -> dict[int, list[Action]]:
        """The action lists the executor runs (and the simulator replayed)."""
        return build_table(self.schedule, self.P, self.micro_batches, self.recompute)

    def stage_to_slots(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {s: [""] * self.D for s in range(self.P)}
        for slot, (s, r) in self.assignment.items():
            out[s][r] = slot
        return out

    def explain(self) -> str:
        gib = 2**30
        lines = [
            f"plan: P={self.P} x D={self.D}, micro-batch {self.micro_batch_size}, m={self.micro_batches}, "
            f"schedule {self.schedule}, estimated {self.estimated_s:.3f} s per mini-batch of {self.global_batch}",
            "stage  segments  kind          recompute  mem_GiB/cap   compute_s  link_out  allreduce",
        ]
        for s, st in enumerate(self.stages):
            link = self.link_kinds[s] if s < self.P - 1 else "-"
            lines.append(
                f"{s:>5}  {st.first_segment:>3}..{st.end_segment - 1:<3}  {st.device_kind:<12}  "
                f"{'yes' if st.recompute else 'no':<9}  {st.memory_bytes / gib:6.1f}/{st.capacity_bytes / gib:<5.1f}"
                f"  {st.compute_s:9.4f}  {link:<8}  {self.allreduce_kinds[s]}"
            )
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"not: {n}" for n in self.ruled_out]
        if self.candidates:
            lines.append("  P x  D  mbs     m  recompute  estimate_s  simulated_s  kinds")
            for c in self.candidates:
                sim = f"{c.simulated_s:11.3f}" if c.simulated_s is not None else " " * 11
                kinds = ",".join(f"{k}x{n}" for k, n in Counter(c.kinds).items())
                mark = "*" if (c.P, c.D, c.micro_batch_size, c.kinds) == (
                    self.P, self.D, self.micro_batch_size, tuple(s.device_kind for s in self.stages)) else " "
                lines.append(f"{mark}{c.P:>2} x{c.D:>3}  {c.micro_batch_size:>3}  {c.micro_batches:>4}  "
                             f"{c.recomputing:>9}  {c.estimate_s:10.3f}  {sim}  {kinds}")
        return "\n".join(lines)
