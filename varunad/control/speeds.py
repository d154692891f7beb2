"""Each slot's measured speed, the stragglers it reveals, and the planner's view of a slow slot.

A calibration measures one slot of a device kind, and the planner used to take every slot of that
kind to run at that speed. Spot VMs do not: a noisy neighbour, an older host under the same name, a
throttled GPU. Workers report the seconds their stage computed per micro-batch in each step
(``Progress.compute_s``, waits on peers left out: `trainer.engine.compute_clock`); the leader
divides it by what the plan expected of that stage on its kind, which gives a ratio per slot.

* A slot's *pace* is the median of its last ``window`` ratios (one per new step reported).
* Its *slowdown* is its pace over a reference pace measured in the same epoch, so a fleet that runs
  uniformly slower than its calibration (a local ring whose daemons share a host's cores) has no
  straggler. The best reference is the fastest replica of the same stage on the same kind: same
  work, same calibration. Failing that, the fastest slot of its kind, then of any kind (each
  measured against its own kind's calibration), then, for a slot alone in its epoch, its
  calibration (a ratio of 1.0), but only where that calibration was measured: a synthetic one says
  nothing about speed. Those comparisons lean on the calibration's split of the work between
  segments, which is off by tens of percent on a busy host: a slot compared only that way must be
  ``CROSS`` times as slow again to count (a healthy 2x1 pipeline measured its second stage 2.5x
  its first under load).
* A slot becomes a straggler when its slowdown is above ``threshold`` for ``window`` reports in a
  row, and stops being one when it is below ``threshold * RECOVER`` for as long: hysteresis, so a
  slot near the threshold does not flip the plan back and forth. A straggler that no plan uses is
  no longer measured; ``forget_s`` after its last measurement it is taken at full speed again, by
  the next plan made for any reason (a straggler's recovery never morphs a job by itself:
  `varunad.node.leader_pace`).
* A slot whose machine runs other workers of the plan, or other daemons (a local ring, network
  namespaces), is measured but never called a straggler: which of them lags is the host's
  scheduler's choice from moment to moment, not a slot's speed (a chaos ring measured healthy
  daemons 2.4-4.1x slower than their replicas for seconds), and a plan moved onto another daemon
  of the machine would compute no faster.

The planner sees a straggler as a device kind of its own, ``KIND~Fx``, whose calibration is its
kind's with every compute time F times longer (F rounded to a step of a factor of sqrt(2), so the
planner sees few kinds): it then gives that slot fewer layers, or leaves it idle when using it costs
more than it brings. The planner also knows which kind each such copy slows (``slowed_kinds``), so
replicas of one stage on slots of one kind at different speeds may take uneven shares of the
global batch, a contiguous slice each, sized for its speed (`ParallelPlan.shares`): the math of a
step is the same whatever the plan ([Note: the global batch defines the math] in ARCHITECTURE.md).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from trainer.planning.calibration import Calibration
from varunad.control.records import Progress

__all__ = ["SlotSpeeds", "RECOVER", "slowed_kind", "base_kind", "slowed_calibrations", "bucket"]

RECOVER = 0.8   # a straggler is one no longer once its slowdown is below threshold * RECOVER
CROSS = 2.0     # the threshold's factor for a slot with no replica of its stage to compare with
_STEP = math.sqrt(2.0)
_SLOWED = re.compile(r"(?P<kind>.+)~(?P<factor>[0-9.]+)x")


def bucket(factor: float) -> float:
    """``factor`` rounded to a power of sqrt(2) (1.4, 2, 2.8, 4, 5.7, ...): few kinds to plan."""
    if factor <= 1.0:
        return 1.0
    return round(_STEP ** round(math.log(factor, _STEP)), 1)


def slowed_kind(kind: str, factor: float) -> str:
    """The planner's name for a slot of ``kind`` that computes ``factor`` times slower."""
    return kind if factor <= 1.0 else f"{kind}~{factor:g}x"


def base_kind(name: str) -> tuple[str, float]:
    """(device kind, slowdown) of a planner kind name (``slowed_kind``'s inverse)."""
    m = _SLOWED.fullmatch(name)
    if m is None:
        return name, 1.0
    try:
        return m["kind"], float(m["factor"])
    except ValueError:
        return name, 1.0


def _slowed(cal: Calibration, name: str, factor: float) -> Calibration:
    segments = tuple(replace(s, step_s=s.step_s * factor, costs=tuple(
        replace(c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor,
                recompute_s=c.recompute_s * factor) for c in s.costs)) for s in cal.segments)
    return replace(cal, device_kind=name, segments=segments)


def slowed_calibrations(calibrations: Mapping[str, Calibration], slowdowns: Iterable[tuple[str, float]]
                        ) -> dict[str, Calibration]:
    """``calibrations`` plus one per (kind, factor) in ``slowdowns`` whose kind has one."""
    out = dict(calibrations)
    for kind, factor in slowdowns:
        name = slowed_kind(kind, factor)
        if name not in out and kind in calibrations:
            out[name] = _slowed(calibrations[kind], name, factor)
    return out


@dataclass(frozen=True, slots=True)
class Expected:
    """What the plan expects of one rank: where it runs and its stage's compute per micro-batch
    on the slot's device kind at full speed."""

    slot: str   # "member/index", the planner's slot id
    kind: str
    compute_s: float
    stage: int = 0
    shared: bool = False   # its machine runs other workers of the plan (`DaemonMember.machine`)


@dataclass
class _Slot:
    kind: str
    stage: int = 0
    ratios: deque = field(default_factory=deque)
    last_step: int = -1
    epoch: int = 0
    steps_seen: int = 0
    measured_at: float = 0.0
    slow_run: int = 0   # reports in a row above the threshold
    fast_run: int = 0   # reports in a row below threshold * RECOVER
    shared: bool = False


class SlotSpeeds:
    """The leader's measurements, per slot, across epochs (a slot keeps its history when it is
    planned again). ``threshold`` 0 turns straggler detection off (paces are still measured)."""

    def __init__(self, *, threshold: float, window: int, forget_s: float) -> None:
        self.threshold, self.window, self.forget_s = threshold, window, forget_s
        self._slots: dict[str, _Slot] = {}
        self.stragglers: dict[str, float] = {}   # slot -> its slowdown when last measured
        self.paces: dict[str, float] = {}        # slot -> slowdown, every slot measured in the epoch

    def observe(self, epoch: int, expected: Mapping[int, Expected], progress: Iterable[Progress],
                now: float, *, calibrated: bool = True) -> bool:
        """Take in the ranks' latest progress of ``epoch``; True when the set of stragglers changed.
        ``calibrated``: the plan's calibrations were measured (else a lone slot has no reference)."""
        for p in progress:
            want = expected.get(p.rank)
            if p.epoch != epoch or want is None or p.compute_s <= 0 or want.compute_s <= 0:
                continue
            s = self._slots.setdefault(want.slot, _Slot(want.kind))
            if s.epoch != epoch:   # a new epoch: a new stage, maybe; the history of ratios stays
                s.epoch, s.last_step, s.steps_seen, s.kind, s.stage = epoch, -1, 0, want.kind, want.stage
                s.shared = want.shared
            if p.step <= s.last_step:
                continue
            s.last_step = p.step
            s.steps_seen += 1
            if s.steps_seen == 1:
                continue   # an epoch's first step builds buffers and warms caches: not its pace
            s.ratios.append(p.compute_s / want.compute_s)
            while len(s.ratios) > self.window:
                s.ratios.popleft()
            s.measured_at = now
        return self._judge(epoch, now, calibrated)

    def _judge(self, epoch: int, now: float, calibrated: bool) -> bool:
        current = {name: s for name, s in self._slots.items() if s.epoch == epoch and s.ratios}
        before = set(self.stragglers)
        self.paces = {}
        references = _references({name: (s.kind, s.stage, statistics.median(s.ratios)) for name, s in current.items()},
                                 calibrated)
        for name, s in current.items():
            reference, bar = references[name]
            if reference is None:
                continue
            slowdown = statistics.median(s.ratios) / reference
            self.paces[name] = round(slowdown, 2)
            if not self.threshold or s.measured_at != now or (s.shared and name not in self.stragglers):
                continue   # off, nothing new from this slot in this round, or sharing a machine's cores
            latest = s.ratios[-1] / reference
            s.slow_run = s.slow_run + 1 if latest > self.threshold * bar else 0
            s.fast_run = s.fast_run + 1 if latest < self.threshold * bar * RECOVER else 0
            if name in self.stragglers:
                if s.fast_run >= self.window:
                    del self.stragglers[name]
                else:
                    self.stragglers[name] = round(slowdown, 2)
            elif s.slow_run >= self.window and slowdown > self.threshold * bar:
                self.stragglers[name] = round(slowdown, 2)
        for name in list(self.stragglers):
            s = self._slots.get(name)
            if s is None or now - s.measured_at > self.forget_s:
                self.stragglers.pop(name, None)
                self._slots.pop(name, None)
        return set(self.stragglers) != before

    def adopt(self, stragglers: Mapping[str, float], now: float) -> None:
        """Stragglers another leader found (the job's state): a new leader plans as its
        predecessor did until its own measurements say otherwise."""
        for name, factor in stragglers.items():
            if name not in self.stragglers and isinstance(factor, (int, float)) and factor > 1.0:
                self.stragglers[name] = float(factor)
                self._slots.setdefault(name, _Slot("", measured_at=now))

    def slowdowns(self) -> dict[str, float]:
        """slot -> the slowdown the planner should assume (bucketed), stragglers only."""
        return {name: bucket(f) for name, f in self.stragglers.items()}


def _references(paces: Mapping[str, tuple[str, int, float]], calibrated: bool
                ) -> dict[str, tuple[float | None, float]]:
    """slot -> (the pace it is compared with, the factor on the threshold), from each slot's
    (kind, stage, pace), best reference first (see the module's docstring); (None, 1) where there
    is none. A slot belongs to the group it is compared with, so the group's fastest pace is the
    fastest of its peers' and its own. One pass over the slots: the leader judges every second."""
    groups: dict[tuple, list[float]] = {}
    for kind, stage, pace in paces.values():
        for key in ((kind, stage), (kind,), ()):
            groups.setdefault(key, []).append(pace)
    out: dict[str, tuple[float | None, float]] = {}
    for name, (kind, stage, _) in paces.items():
        if len(groups[(kind, stage)]) > 1:
            out[name] = min(groups[(kind, stage)]), 1.0
        elif len(groups[()]) > 1:
            peers = groups[(kind,)] if len(groups[(kind,)]) > 1 else groups[()]
            out[name] = min(peers), CROSS
        else:
            out[name] = (1.0, CROSS) if calibrated else (None, 1.0)
    return out
