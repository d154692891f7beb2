"""Choose P x D, the micro-batch size, the cut points and the placement for a fleet of slots.

The planner only needs calibrations (one per device kind) and the slot list, so the daemon can run
it without torch. For every micro-batch size, set of device kinds and pipeline depth P it
balances the segments into P contiguous stages (bisection on the bottleneck stage time with a
greedy fill that respects each stage's memory, recomputing only where the stashed activations
would not fit), then scores every data-parallel width D that splits the global batch into whole
micro-batches with a closed-form pipeline estimate. The best few are placed on hosts and replayed
by the simulator on the real action table; the fastest replay wins.

Conventions:
  * cut point k lies between segment k and segment k+1; `Plan.cuts` lists the active ones;
  * a stage's memory is the schedule's bound, the same accounting the simulator replays:
    parameters, gradients and optimizer state, plus the micro-batches the schedule stashes
    (`Schedule.stash_bound`: inputs only on a recomputing stage, full activation sets
    otherwise), plus one full set while recomputing, plus one pass's working bytes (its largest
    segment's `working_bytes`: a loss's logits and their gradients), or the optimizer step's
    temporaries (`Calibration.step_bytes`) where they are more: the step runs once the
    activations are freed;
  * slots of one stage are one device kind, so its replicas run in step; the pipeline puts
    kinds with more memory first (early stages stash more) and gives slower kinds fewer layers;
  * workers on one machine share its CPU cores (`Slot.machine`, `machine_cores`): where a placement
    puts more threads on a machine than it has cores, beyond the load its kind's calibration was
    measured under (`calibrated_load`), that machine's stages compute proportionally slower, in
    the screen and in the replay. A local ring of four one-thread daemons on two cores runs each
    worker at half speed, and a plan that leaves two of them idle may be the faster one. A
    calibration that also timed the machine's slots busy at once (`Calibration.busy_slowdown`)
    says what they lose to shared memory bandwidth before they run out of cores (`_crowding`).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainer.planning.calibration import Calibration
from trainer.planning.parallel import ParallelPlan, micro_batches
from trainer.planning.plan import Candidate, ModelTooLarge, Plan, PlanError, Slot, StagePlan
from trainer.planning.schedule import (
    AUTO_SCHEDULE,
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Schedule,
    ScheduleError,
    schedule_named,
)
from trainer.planning.simulator import simulate, stage_costs

# The plan types live in trainer.planning.plan; they are named here too, as the planner's return types.
__all__ = ["PlanError", "ModelTooLarge", "Slot", "StagePlan", "Candidate", "Plan", "plan"]

_EPS = 1e-9
_SIM_CAP = 32  # micro-batches replayed exactly (at least 2P); beyond, extrapolated linearly in m


# --- per-kind prefix sums ---------------------------------------------------------------------


@dataclass
class _Kind:
    name: str
    cal: Calibration
    capacity: int
    slots: int
    host_size: int  # the most common number of slots of this kind per host
    # per micro-batch-size index: prefix sums over segments
    fb: list[list[float]] = field(default_factory=list)
    fbr: list[list[float]] = field(default_factory=list)
    act: list[list[float]] = field(default_factory=list)
    split: list[list[float]] = field(default_factory=list)   # held between a split backward's passes
    # [a][b]: the largest working bytes of segments a..b-1 (a stage holds one pass's at a time)
    work: list[list[list[int]]] = field(default_factory=list)
    out: list[list[int]] = field(default_factory=list)
    static: list[float] = field(default_factory=list)
    params: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        acc = lambda xs: list(itertools.accumulate(xs, initial=0.0))  # noqa: E731
        segs = self.cal.segments
        for j in range(len(self.cal.micro_batch_sizes)):
            c = [s.costs[j] for s in segs]
            # a stage that does not recompute keeps the graph: its forward costs a recompute
            self.fb.append(acc(x.recompute_s + x.backward_s for x in c))
            self.fbr.append(acc(x.forward_s + x.backward_s + x.recompute_s for x in c))
            self.act.append(acc(x.peak_activation_bytes for x in c))
            # not measured (an older calibration): as much as the activations, as the simulator takes it
            self.split.append(acc(x.peak_activation_bytes if x.split_bytes is None else x.split_bytes for x in c))
            self.out.append([x.activation_bytes for x in c])
            self.work.append(_running_max([x.working_bytes or 0 for x in c]))   # not measured: 0, as before
        self.static = acc(s.static_bytes for s in segs)
        self.params = acc(s.param_bytes for s in segs)

    def in_bytes(self, j: int, i: int) -> int:
        return self.cal.input_bytes[j] if i == 0 else self.out[j][i - 1]


def _running_max(xs: Sequence[int]) -> list[list[int]]:
    """[a][b] = max(xs[a:b]) (0 where empty): the planner asks for every stage it weighs."""
    n = len(xs)
    out = []
    for a in range(n + 1):
        row, most = [0] * (n + 1), 0
        for b in range(a + 1, n + 1):
            most = max(most, xs[b - 1])
            row[b] = most
        out.append(row)
    return out


def _fill(kinds: Sequence[_Kind], j: int, X: float, schedule: Schedule, m: int, allow_recompute: bool):
    """Greedy: each stage takes the most segments whose time fits X and memory fits its slot."""
    P, n = len(kinds), kinds[0].cal.n_segments
    bounds, flags = [0], []
    i = 0
    stash = schedule.stash_bounds(P, m)  # per stage, (without, with) recompute
    for s, k in enumerate(kinds):
        jmax = n - (P - s - 1)
        if s == P - 1 and k.fb[j][n] - k.fb[j][i] > X + _EPS:
            return None
        best, best_rec = i, False
        options = (False, True) if (allow_recompute and s < P - 1) else (False,)
        for rec in options:
            pre = k.fbr[j] if rec else k.fb[j]
            e = bisect.bisect_right(pre, pre[i] + X + _EPS, i + 1, jmax + 1) - 1 if s < P - 1 else n
            c = stash[s][rec]
            splits = schedule.splits(P, s)
            while e > i:
                if _stage_bytes(k, j, i, e, c, rec, splits) <= k.capacity:
                    break
                if s == P - 1:
                    return None
                e -= 1
            if e > best:
                best, best_rec = e, rec
        if best <= i:
            return None
        bounds.append(best)
        flags.append(best_rec)
        i = best
    return (tuple(bounds), tuple(flags)) if i == n else None


def _partition(kinds, j, schedule, m, allow_recompute):
    """Contiguous split of the segments minimising the bottleneck stage time (to 0.1%)."""
    if _fill(kinds, j, float("inf"), schedule, m, allow_recompute) is None:
        return None
    n, P = kinds[0].cal.n_segments, len(kinds)
    distinct = list({id(k): k for k in kinds}.values())
    cheapest = [min(k.fb[j][i + 1] - k.fb[j][i] for k in distinct) for i in range(n)]
    lo = max(max(cheapest), sum(cheapest) / P) * 0.999  # no split can beat either
    hi = max(k.fbr[j][n] for k in kinds)
    guess = max(max(cheapest), sum(cheapest) / P) * 1.5  # usually feasible: saves most halvings
    if guess < hi and _fill(kinds, j, guess, schedule, m, allow_recompute) is not None:
        hi = guess
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if _fill(kinds, j, mid, schedule, m, allow_recompute) is None:
            lo = mid
        else:
            hi = mid
    return _fill(kinds, j, hi, schedule, m, allow_recompute)


def _predicted_links(kinds: Sequence[_Kind], D: int) -> tuple[list[str], list[str]]:
    """Link kinds if stages are packed in host-sized blocks (what `_place` aims for)."""
    P = len(kinds)
    links, block = [], 1
    for s in range(P - 1):
        same = kinds[s] is kinds[s + 1] and block < kinds[s].host_size
        links.append("intra" if same else "inter")
        block = block + 1 if same else 1
    ar, start = [], 0
    for s in range(P):  # a block's replicas share a host when D blocks fit in one
        if s == P - 1 or links[s] == "inter":
            b = s + 1 - start
            ar += ["intra" if D == 1 or D * b <= kinds[s].host_size else "inter"] * b
            start = s + 1
    return links, ar


def _estimate(kinds, bounds, flags, j, D, m, links, ar, schedule, slowed=None) -> float:
    """Closed-form screen: fill and drain, m-1 periods of the bottleneck, the slowest all-reduce.
    Within a few percent of the replay on the configurations tried; the replay decides.
    ``slowed``: per stage, how many times slower its compute runs (shared cores)."""
    P = len(kinds)
    slowed = slowed or (1.0,) * P
    work, transfer, hop, fill = [], [0.0], [0.0], 0.0
    tail = 0.0
    for s, k in enumerate(kinds):
        a, b = bounds[s], bounds[s + 1]
        pre = k.fbr[j] if flags[s] else k.fb[j]
        work.append(pre[b] - pre[a])
        if s < P - 1:
            link = k.cal.links[links[s]]
            transfer.append(k.out[j][b - 1] / link.bandwidth_Bps)
            hop.append(link.send_s(k.out[j][b - 1]))
            fill += 2 * hop[-1]
        for side in ([links[s]] if s < P - 1 else []) + ([links[s - 1]] if s > 0 else []):
            link = k.cal.links[side]   # a message each way per micro-batch keeps the stage busy
            work[-1] += link.send_overhead_s + link.recv_overhead_s
        work[-1] *= slowed[s]
        step = sum(seg.step_s for seg in k.cal.segments[a:b]) * slowed[s]
        tail = max(tail, k.cal.allreduce[ar[s]].allreduce_s(k.params[b] - k.params[a], D) + step)
    # a stage that cannot run ahead has no slack to hide a message in: the hop is on its period
    slackless = [max(work[s], work[s + 1]) + hop[s + 1] for s in range(P - 1)
                 if not schedule.has_slack(P, s, flags[s])]
    period = max(max(work), max(transfer), max(slackless, default=0.0))
    return sum(work) + fill + (m - 1) * period + tail


def _place(stage_kinds: Sequence[str], D: int, slots: Sequence[Slot], host_size: Mapping[str, int]):
    """Pack blocks of consecutive same-kind stages onto single hosts, best fit, biggest first, so
    that neighbour stages talk inside a host; returns the assignment and the link kinds it gives."""
    free: dict[tuple[str, str], list[str]] = defaultdict(list)
    for sl in sorted(slots, key=lambda x: (x.host, x.slot_id), reverse=True):
        free[(sl.device_kind, sl.host)].append(sl.slot_id)  # pop() then yields slots in order
    # by_count[kind][n]: hosts with exactly n free slots of that kind, as a sorted stack
    by_count: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for (kind, host), ids in sorted(free.items(), reverse=True):
        by_count[kind][len(ids)].append(host)
    blocks: list[list[int]] = []
    for s, kind in enumerate(stage_kinds):
        if blocks and stage_kinds[blocks[-1][0]] == kind and len(blocks[-1]) < host_size[kind]:
            blocks[-1].append(s)
        else:
            blocks.append([s])
    host_of: dict[tuple[int, int], str] = {}
    assignment: dict[str, tuple[int, int]] = {}
    for block in sorted(blocks, key=len, reverse=True):
        kind = stage_kinds[block[0]]
        counts = by_count[kind]
        for r in range(D):
            todo = list(block)
            while todo:
                sizes = [n for n, hosts in counts.items() if hosts and n > 0]
                if not sizes:
                    raise PlanError(f"ran out of {kind} slots while placing (a bug in the planner)")
                fits = [n for n in sizes if n >= len(todo)]
                n = min(fits) if fits else max(sizes)  # best fit, else split over the emptiest host
                host = counts[n].pop()
                take = min(len(todo), n)
                for s in todo[:take]:
                    assignment[free[(kind, host)].pop()] = (s, r)
                    host_of[(s, r)] = host
                counts[n - take].append(host)
                todo = todo[take:]
    links, ar = _links_between(host_of, len(stage_kinds), D)
    return assignment, links, ar


def _threads_on(slots: Iterable[Slot], machine_cores: Mapping[str, int]) -> Counter:
    """CPU threads the workers of ``slots`` run on each machine whose cores are known."""
    demand: Counter = Counter()
    for sl in slots:
        if sl.threads and sl.machine in machine_cores:
            demand[sl.machine] += sl.threads
    return demand


def _oversubscribed(slots: Sequence[Slot], machine_cores: Mapping[str, int], calibrated_load: Mapping[str, float]
                    ) -> bool:
    """Whether using every slot would put more threads on some machine than its cores take, beyond
    the load its kinds were calibrated under: only then can a placement be slowed by sharing."""
    demand = _threads_on(slots, machine_cores)
    return any(demand[sl.machine] / machine_cores[sl.machine] > max(1.0, calibrated_load.get(sl.device_kind, 1.0))
               for sl in slots if sl.machine in demand)


def _crowding(on_machine: int, cores: int, calibrated_load: float, busy_slowdown: float = 0.0,
              busy_load: float = 0.0) -> float:
    """How many times slower than its calibration a worker computes on a machine of ``cores``
    whose placed workers run ``on_machine`` threads in all; the calibration measured its numbers
    with ``calibrated_load`` threads per core busy. Past the cores the workers take turns: load =
    on_machine / cores times slower. Below them they share memory bandwidth: where the
    calibration also timed ``busy_load`` threads per core busy (``busy_slowdown`` times slower),
    the loss is taken to grow linearly with the cores in use between the two loads."""
    load = on_machine / cores
    turns = max(1.0, load) / max(1.0, calibrated_load)
    near, far = min(1.0, calibrated_load), min(1.0, busy_load)
    if busy_slowdown <= 0 or far <= near:
        return turns
    # the bandwidth part of the probe's slowdown: its own turns (beyond the cores) taken out
    bandwidth = busy_slowdown / (max(1.0, busy_load) / max(1.0, calibrated_load))
    share = min(1.0, max(0.0, (min(1.0, load) - near) / (far - near)))
    return turns * max(1.0, 1.0 + (bandwidth - 1.0) * share)


def _sharing(assignment: Mapping[str, tuple[int, int]], P: int, by_id: Mapping[str, Slot],
             machine_cores: Mapping[str, int], calibrated_load: Mapping[str, float],
             busy: Mapping[str, tuple[float, float]]) -> tuple[float, ...]:
    """Per stage, how many times slower than calibrated it computes on the machines `assignment`
    puts it on (`_crowding`; ``busy``: each kind's (busy_slowdown, busy_load)); replicas run in
    step, so the slowest replica's factor is the stage's."""
    demand = _threads_on((by_id[slot_id] for slot_id in assignment), machine_cores)
    factors: list[float | None] = [None] * P
    for slot_id, (stage, _) in assignment.items():
        sl = by_id[slot_id]
        f = 1.0
        if sl.machine in demand and sl.threads:
            f = _crowding(demand[sl.machine], machine_cores[sl.machine], calibrated_load.get(sl.device_kind, 1.0),
                          *busy.get(sl.device_kind, (0.0, 0.0)))
        factors[stage] = f if factors[stage] is None else max(factors[stage], f)
    return tuple(1.0 if f is None else f for f in factors)


def _configurations(kinds, sizes, global_batch, n_seg, ragged=False):
    """Every (micro-batch size, kinds per stage, D, P) with a lower bound on its time: the
    cheapest placement of each segment, perfectly balanced, and the all-reduce of an average
    stage. `_estimate` of the same configuration is never below it. `ragged`: a replica's
    share may end in a smaller micro-batch (timed as a full one: an estimate from above)."""
    for mbs in sizes:
        cheap = [min(k.fb[k.cal.size_index(mbs)][i + 1] - k.fb[k.cal.size_index(mbs)][i] for k in kinds)
                 for i in range(n_seg)]
        total, biggest = sum(cheap), max(cheap)
        for r in range(1, len(kinds) + 1):
            for subset in itertools.combinations(kinds, r):
                speed = {k.name: k.fb[k.cal.size_index(mbs)][n_seg] for k in subset}
                # more memory first (early stages stash more); faster first among equals
                order = sorted(subset, key=lambda k: (-k.capacity, speed[k.name], k.name))
                fastest_first = sorted(subset, key=lambda k: (speed[k.name], k.name))
                params = min(k.params[n_seg] for k in subset)
                n_slots = sum(k.slots for k in subset)
                for D in (d for d in range(1, n_slots + 1)
                          if global_batch % d == 0 and (ragged or global_batch % (d * mbs) == 0)):
                    m = len(micro_batches(global_batch, D, mbs))
                    avail = {k.name: k.slots // D for k in subset}
                    if min(avail.values()) < 1:
                        continue
                    for P in range(r, min(n_seg, sum(avail.values())) + 1):
                        counts, left = {k.name: 1 for k in subset}, P - r  # each kind gets a stage
                        for k in fastest_first:
                            extra = min(left, avail[k.name] - 1)
                            counts[k.name] += extra
                            left -= extra
                        if left:
                            continue
                        seq = [k for k in order for _ in range(counts[k.name])]
                        ar = min(link.allreduce_s(params / P, D) for k in subset for link in k.cal.allreduce.values())
                        lb = total + (m - 1) * max(biggest, total / P) + ar
                        yield lb, mbs, D, m, P, seq


def _simulate(schedule, P, m, flags, costs) -> float:
    """Replay the table; past a few times P micro-batches the pipeline is in its steady state,
    so two shorter replays give the slope and the rest is extrapolated (planning stays fast)."""
    cap = max(_SIM_CAP, 2 * P)
    if m <= cap:
        return simulate(schedule.table(P, m, flags), costs).minibatch_s
    lo_m = cap // 2  # a wide window: Varuna's steady state repeats with a period of a few P
    hi_t = simulate(schedule.table(P, cap, flags), costs).minibatch_s
    lo_t = simulate(schedule.table(P, lo_m, flags), costs).minibatch_s
    return hi_t + (hi_t - lo_t) / (cap - lo_m) * (m - cap)


def plan(
    slots: Sequence[Slot],
    global_batch: int,
    calibrations: Mapping[str, Calibration] | Sequence[Calibration],
    *,
    schedule: str = DEFAULT_SCHEDULE,
    micro_batch_sizes: Sequence[int] | None = None,
    memory_fraction: float = 0.9,
    allow_recompute: bool = True,
    verify: int = 3,
    runners_up: int = 8,
    machine_cores: Mapping[str, int] | None = None,
    calibrated_load: Mapping[str, float] | None = None,
    slowed_kinds: Mapping[str, tuple[str, float]] | None = None,
) -> Plan:
    """Pick the fastest feasible configuration. `memory_fraction` of each slot is usable (the
    rest is left for the framework, workspaces and fragmentation); `verify` of the best
    closed-form candidates are replayed by the simulator and the fastest replay wins.
    `machine_cores`: cores of each machine that `Slot.machine` names (a machine left out shares
    nothing); `calibrated_load`: per device kind, the threads per core its calibration ran with
    (1 when left out): the module docstring says how the two slow a plan down. `slowed_kinds`:
    device kind -> (the kind it is a copy of, how many times slower it computes), for slots
    measured slower than their calibration: replicas of one kind at different speeds may then
    take uneven shares of the global batch ("uneven data-parallel shares" below).
    `schedule` = `AUTO_SCHEDULE`: the fastest replay over every schedule (`_fastest_schedule`)."""
    if schedule == AUTO_SCHEDULE:
        return _fastest_schedule(
            slots, global_batch, calibrations, micro_batch_sizes=micro_batch_sizes, memory_fraction=memory_fraction,
            allow_recompute=allow_recompute, verify=verify, runners_up=runners_up, machine_cores=machine_cores,
            calibrated_load=calibrated_load, slowed_kinds=slowed_kinds)
    try:
        sched = schedule_named(schedule)
    except ScheduleError as exc:
        raise PlanError(str(exc)) from None
    if global_batch < 1 or not 0 < memory_fraction <= 1 or verify < 1:
        raise PlanError("global_batch >= 1, 0 < memory_fraction <= 1 and verify >= 1 are required")
    cals = dict(calibrations) if isinstance(calibrations, Mapping) else {c.device_kind: c for c in calibrations}
    if not cals:
        raise PlanError("no calibration given", hint="run the profiler once per device kind")
    if len({(c.model, c.n_segments) for c in cals.values()}) != 1:
        raise PlanError("calibrations disagree on the model or its number of segments")
    if len({s.slot_id for s in slots}) != len(slots):
        raise PlanError("slot ids must be unique")
    notes: list[str] = []
    by_kind: dict[str, list[Slot]] = defaultdict(list)
    for sl in slots:
        by_kind[sl.device_kind].append(sl)
    for kind in sorted(set(by_kind) - set(cals)):
        notes.append(f"left out {kind} ({len(by_kind[kind])} slots): no calibration for this device kind")
    kinds: list[_Kind] = []
    for name in sorted(set(by_kind) & set(cals)):
        group = by_kind[name]
        per_host = Counter(Counter(s.host for s in group).values()).most_common(1)[0][0]
        cap = int(min(s.memory_bytes for s in group) * memory_fraction)
        kinds.append(_Kind(name, cals[name], cap, len(group), per_host))
    if not kinds:
        raise PlanError("no slot has a calibrated device kind", hint=f"calibrate one of {sorted(by_kind)}")
    n_seg = kinds[0].cal.n_segments
    sizes = sorted(set.intersection(*(set(k.cal.micro_batch_sizes) for k in kinds)))
    if micro_batch_sizes is not None:
        sizes = [b for b in sizes if b in set(micro_batch_sizes)]
    if not sizes:
        raise PlanError("no micro-batch size is calibrated for every device kind")
    fleet_notes = list(notes)

    # Branch and bound: a lower bound for every configuration costs no partitioning; configurations
    # are then partitioned and estimated in order of that bound until it exceeds the k-th best.
    keep = max(verify, runners_up)
    cores = {m: c for m, c in (machine_cores or {}).items() if c > 0}
    loads = dict(calibrated_load or {})
    busy = {k.name: (k.cal.busy_slowdown, k.cal.busy_load) for k in kinds}
    # placements differ in speed only where a machine can be crowded, or its workers' shared
    # memory bandwidth was measured
    shared = _oversubscribed(slots, cores, loads) or (
        any(f > 1.0 for f, _ in busy.values()) and any(sl.threads and sl.machine in cores for sl in slots))
    by_id = {sl.slot_id: sl for sl in slots}
    kind_by_name = {k.name: k for k in kinds}
    host_size = {k.name: k.host_size for k in kinds}

    def placed(names, D):
        """(assignment, link kinds, all-reduce kinds, slowdown per stage) of one configuration."""
        assignment, links, ar = _place(names, D, [s for s in slots if s.device_kind in set(names)], host_size)
        return assignment, links, ar, _sharing(assignment, len(names), by_id, cores, loads, busy)

    if shared:   # the screen places every configuration: sharing decides between them
        verify = max(verify, runners_up)
    # a micro-batch size the job fixed may leave a smaller last micro-batch (the engine's rule,
    # `micro_batches`); the planner's own choice divides each share evenly
    ragged = micro_batch_sizes is not None and len(set(micro_batch_sizes)) == 1
    pending = sorted(_configurations(kinds, sizes, global_batch, n_seg, ragged), key=lambda c: c[0])
    scored: list[tuple[float, tuple]] = []
    best_k: list[float] = []  # max-heap (negated) of the `keep` best estimates so far
    lower_by_kind: dict[str, float] = {}
    partitions: dict[tuple, object] = {}
    for lb, mbs, D, m, P, seq in pending:
        names = tuple(k.name for k in seq)
        if len(best_k) >= keep and lb > -best_k[0]:
            for name in set(names):
                lower_by_kind.setdefault(name, lb)
            continue
        j = seq[0].cal.size_index(mbs)
        # m matters to a partition only through the stash bounds, which stop growing once m is
        # more than a stage may run ahead: one partition serves every such m
        key = (mbs, names, sched.stash_bounds(P, m))
        if key not in partitions:
            partitions[key] = _partition(seq, j, sched, m, allow_recompute)
        part = partitions[key]
        if part is None:
            continue
        bounds, flags = part
        if shared:
            _, links, ar, slowed = placed(names, D)
            est = _estimate(seq, bounds, flags, j, D, m, links, ar, sched, slowed)
        else:
            links, ar = _predicted_links(seq, D)
            est = _estimate(seq, bounds, flags, j, D, m, links, ar, sched)
        scored.append((est, (mbs, D, m, P, names, bounds, flags)))
        heapq.heappush(best_k, -est)
        if len(best_k) > keep:
            heapq.heappop(best_k)
    if not scored:
        _refuse_too_large(kinds, sizes, allow_recompute)
        raise PlanError(
            f"no configuration of {len(slots)} slots fits the model's memory for global batch {global_batch}",
            hint="add slots or memory, allow recompute, calibrate a smaller micro-batch size, or pick a global "
                 "batch with more divisors",
        )
    scored.sort(key=lambda x: (x[0], x[1][3], x[1][1]))
    verified = []

    def replay(est, config):
        mbs, D, m, P, names, bounds, flags = config
        seq = [kind_by_name[n] for n in names]
        assignment, links, ar, slowed = placed(names, D)
        costs = tuple(c.slowed(f) for c, f in zip(stage_costs([k.cal for k in seq], bounds, mbs, D, links, ar),
                                                  slowed))
        sim = _simulate(sched, P, m, flags, costs)
        verified.append((sim, est, config, assignment, links, ar, slowed))

    for est, config in scored[:verify]:
        replay(est, config)
    # on a tie (to a microsecond) prefer the shallower pipeline: fewer peers to lose
    order = lambda v: (round(v[0], 6), v[2][3], v[2][1])  # noqa: E731
    verified.sort(key=order)
    top = verified[0][2]
    if top[3] > 1 and top[2] == 1:
        # One micro-batch per step on a pipeline is no pipelining at all: before settling for it,
        # replay the best plans with a smaller micro-batch too, and let the faster replay win.
        for est, config in [x for x in scored[verify:] if x[1][0] < top[0]][:verify]:
            replay(est, config)
        verified.sort(key=order)
    sim, est, (mbs, D, m, P, names, bounds, flags), assignment, links, ar, slowed = verified[0]
    sims = {(c[0], c[1], c[3], c[4]): t for t, _, c, *_ in verified}

    def candidate(est, c):
        mbs_, D_, m_, P_, names_, _, flags_ = c
        return Candidate(P_, D_, mbs_, m_, names_, sum(flags_), est, sims.get((mbs_, D_, P_, names_)))

    ordered = [(v[1], v[2]) for v in verified] + [x for x in scored[verify:]]
    shown, seen = [], set()
    for e, c in ordered:
        tag = (c[3], c[1], c[0], c[4])
        if tag not in seen:
            seen.add(tag)
            shown.append(candidate(e, c))
        if len(shown) >= runners_up:
            break

    used = set(names)
    for k in kinds:
        if k.name in used:
            continue
        with_k = [e for e, c in scored if k.name in c[4]]
        if with_k:
            why = f"the best plan that uses it is estimated at {min(with_k):.3f} s vs {est:.3f} s without"
        elif k.name in lower_by_kind:
            why = f"every plan that uses it takes at least {lower_by_kind[k.name]:.3f} s vs {est:.3f} s without"
        else:
            why = "no feasible plan uses it (memory or slot count)"
        notes.append(f"left out {k.name} ({k.slots} slots): {why}")
    ruled_out = tuple(_ruled_out(kinds, sizes, global_batch, sched, allow_recompute, scored, lower_by_kind,
                                 (P, D), ragged))
    unused = tuple(sorted(s.slot_id for s in slots if s.slot_id not in assignment))
    if unused:
        notes.append(f"{len(unused)} slots idle: P x D = {P} x {D} uses {P * D} of {len(slots)}")
    notes += _sharing_notes(assignment, by_id, cores, slowed)

    stages = [_stage_plan(kind_by_name[name], mbs, P, s, m, bounds, flags, sched) for s, name in enumerate(names)]
    parallel = ParallelPlan(P=P, D=D, micro_batch_size=int(mbs), schedule=schedule,
                            cuts=tuple(int(b) - 1 for b in bounds[1:-1]), recompute=tuple(bool(f) for f in flags))
    even = Plan(
        parallel=parallel, micro_batches=m, global_batch=global_batch, stages=tuple(stages), assignment=assignment,
        link_kinds=tuple(links), allreduce_kinds=tuple(ar), estimated_s=sim, unused=unused,
        notes=tuple(notes), candidates=tuple(shown), ruled_out=ruled_out,
        contention=tuple(slowed) if any(f > 1.0 for f in slowed) else (),
    )
    if not slowed_kinds or shared:   # co-located slots' speeds are the host's to share, not theirs
        return even
    by_speed = _uneven_plans(slots, cals, slowed_kinds, sizes, global_batch, sched, allow_recompute,
                             memory_fraction, verify)
    if not by_speed or by_speed[0].sim >= even.estimated_s * (1 - _UNEVEN_GAIN):
        return even
    u = by_speed[0]
    idle = tuple(sorted(s.slot_id for s in slots if s.slot_id not in u.assignment))
    why = fleet_notes + [f"even shares: the best plan ({even.P}x{even.D}) is estimated at {even.estimated_s:.3f} s "
                         f"vs {u.sim:.3f} s"]
    if idle:
        why.append(f"{len(idle)} slots idle: P x D = {u.P} x {len(u.counts)} uses {len(u.assignment)} of {len(slots)}")
    return _uneven_plan(u, global_batch, schedule, sched, why, idle, even.candidates, even.ruled_out)


def _fastest_schedule(slots, global_batch, calibrations, **options) -> Plan:
    """Plan with every schedule and keep the fastest replay; on a tie (to a microsecond) the one
    listed first in `SCHEDULES` (Varuna's). Each schedule is planned whole, as its memory rule
    moves the cuts and the recompute flags; the others' estimates join what ruled out the obvious
    plans (`Plan.ruled_out`, which `varunactl status` shows)."""
    made: list[Plan] = []
    refused: dict[str, PlanError] = {}
    for name in SCHEDULES:
        try:
            made.append(plan(slots, global_batch, calibrations, schedule=name, **options))
        except PlanError as exc:
            refused[name] = exc
    if not made:
        raise refused[DEFAULT_SCHEDULE]
    best = min(made, key=lambda p: round(p.estimated_s, 6))   # min keeps the first of equals
    others = [f"{p.parallel.schedule} ({p.P}x{p.D}) {p.estimated_s:.3f} s" for p in made if p is not best]
    why = (f"the other schedules: {', '.join(others + [f'{name}: no plan fits' for name in refused])} "
           f"(schedule {best.parallel.schedule}: {best.estimated_s:.3f} s)")
    return dataclasses.replace(best, ruled_out=best.ruled_out + (why,))


def _refuse_too_large(kinds: Sequence[_Kind], sizes: Sequence[int], allow_recompute: bool) -> None:
    """ModelTooLarge when some segment, alone on a stage at the smallest micro-batch size with one
    micro-batch in flight, needs more memory than a slot of every kind has usable: no number of
    slots fits the model, so waiting for more of them would wait forever."""
    mbs = min(sizes)
    n = kinds[0].cal.n_segments
    for i in range(n):
        needs = []
        for k in kinds:
            j = k.cal.size_index(mbs)
            need = min(_stage_bytes(k, j, i, i + 1, 1, rec, False) for rec in {False, allow_recompute})
            needs.append((need - k.capacity, need, k))
        if all(over > 0 for over, _, _ in needs):
            _, need, k = min(needs, key=lambda x: x[0])
            static = k.static[i + 1] - k.static[i]
            where = "the first" if i == 0 else "the last" if i == n - 1 else f"segment {i + 1}"
            # on a CPU the worker process itself is most of a small stage (trainer.engine.memory)
            worker = f", the worker beyond its tensors {k.cal.worker_bytes / 2**20:.1f} MiB" if k.cal.worker_bytes else ""
            raise ModelTooLarge(
                f"the model cannot fit any number of these slots: {where} of its {n} segments (the parts "
                f"between cut points) needs {need / 2**20:.1f} MiB on a {k.name} slot even alone on a stage "
                f"at micro-batch {mbs} (its weights and training state {static / 2**20:.1f} MiB{worker}), and "
                f"a slot has {k.capacity / 2**20:.1f} MiB usable",
                hint="give each slot more memory (larger VMs, or the daemons' --memory), or add CutPoints inside "
                     "that part of the model so that it can be split over more stages")


def _stage_bytes(k: _Kind, j: int, a: int, b: int, c: int, rec: bool, splits: bool) -> float:
    """The memory of a stage of segments a..b-1 on kind ``k`` (the bound in the module docstring):
    its worker, weights and training state, and the larger of its optimizer step's temporaries
    and what it holds for the ``c`` micro-batches in flight: their inputs, and as many activation
    sets or, recomputing, one; plus, where it ``splits`` its backwards, the gradients kept between
    the passes for as many micro-batches (one where it recomputes: it weighs after each backward);
    plus one pass's working bytes, its largest segment's (a stage runs one pass at a time)."""
    act, in_b = k.act[j][b] - k.act[j][a], k.in_bytes(j, a)
    split = k.split[j][b] - k.split[j][a] if splits else 0
    held = c * in_b + act + split if rec else c * (in_b + act + split)
    held += k.work[j][a][b]
    return k.cal.worker_bytes + k.static[b] - k.static[a] + max(k.cal.step_bytes(a, b), held)


def _stage_plan(k: _Kind, mbs: int, P: int, s: int, m: int, bounds, flags, sched: Schedule) -> StagePlan:
    """Stage ``s`` of a plan on kind ``k``: its segments, its memory (the bound in the module
    docstring) and its compute per micro-batch."""
    j, a, b = k.cal.size_index(mbs), bounds[s], bounds[s + 1]
    mem = _stage_bytes(k, j, a, b, sched.stash_bound(P, s, m, flags[s]), flags[s], sched.splits(P, s))
    pre = k.fbr[j] if flags[s] else k.fb[j]
    return StagePlan(a, b, k.name, flags[s], int(mem), k.capacity, pre[b] - pre[a])


def _sharing_notes(assignment, by_id, cores, slowed) -> list[str]:
    """One line per machine the plan puts several CPU workers on: what they share."""
    on: dict[str, list[Slot]] = defaultdict(list)
    for slot_id in assignment:
        sl = by_id[slot_id]
        if sl.threads and sl.machine in cores:
            on[sl.machine].append(sl)
    notes = []
    for machine, group in sorted(on.items()):
        if len(group) < 2:
            continue
        threads = sum(sl.threads for sl in group)
        stages = sorted({assignment[sl.slot_id][0] for sl in group})
        worst = max(slowed[s] for s in stages)
        notes.append(f"{len(group)} workers share machine {machine[:8]} ({threads} threads on {cores[machine]} cores)"
                     + (f": their compute planned {worst:.2g}x slower than calibrated" if worst > 1.0 else ""))
    return notes


def _ruled_out(kinds, sizes, global_batch, schedule, allow_recompute, scored, lower_by_kind, chosen,
               ragged=False) -> list[str]:
    """Why the plans a user would try first, every slot data-parallel (1 x N) and one slot alone
    (1 x 1), were not chosen: memory, the micro-batch count, or a slower estimate."""
    if len(kinds) != 1:
        return []
    k = kinds[0]
    out = []
    for D in sorted({k.slots, 1}, reverse=True):
        if (1, D) == chosen:
            continue
        shape = f"1x{D}" + (" (every slot data-parallel)" if D > 1 else " (one slot)")
        fits = [b for b in sizes if global_batch % D == 0 and (ragged or global_batch % (D * b) == 0)]
        if not fits:
            out.append(f"{shape}: the global batch {global_batch} does not split into whole micro-batches of a "
                       f"calibrated size ({', '.join(map(str, sizes))}) over {D} replicas")
            continue
        whole = [b for b in fits
                 if _partition([k], k.cal.size_index(b), schedule, len(micro_batches(global_batch, D, b)),
                               allow_recompute)]
        if not whole:
            out.append(f"{shape}: memory: one {k.name} slot cannot hold the whole model (weights and optimizer "
                       f"state alone {_size(k.static[k.cal.n_segments])}, {_size(k.capacity)} usable)")
            continue
        times = [e for e, c in scored if c[3] == 1 and c[1] == D]
        if times:
            out.append(f"{shape}: estimated {min(times):.3f} s per step (closed form), slower")
        else:
            out.append(f"{shape}: estimated at least {lower_by_kind.get(k.name, 0.0):.3f} s per step, slower")
    return out


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one (a small model's 0.003 GiB reads as nothing at 2 decimals)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# --- uneven data-parallel shares ----------------------------------------------------------------
# A measured straggler is a device kind of its own to the rest of the planner (`slowed_kinds`
# names the kind it is a slowed copy of), so a replica of a stage is always one kind and every
# replica takes an equal share. Replicas of one kind at different speeds can do better: the same
# stages (same cut points, so the stage groups reduce the same tensors), each replica a contiguous
# slice of the global batch sized for its speed. The math of a step is unchanged: the loss is
# normalised by the global batch and gradients are summed
# ([Note: the global batch defines the math] in ARCHITECTURE.md).

_UNEVEN_GAIN = 0.03   # uneven shares must beat the best even plan by this much: a plan change has a price


@dataclass(frozen=True)
class _Uneven:
    sim: float
    est: float
    mbs: int
    P: int
    counts: tuple[int, ...]        # micro-batches per replica
    kind: _Kind
    bounds: tuple[int, ...]
    flags: tuple[bool, ...]
    assignment: dict[str, tuple[int, int]]
    links: tuple[str, ...]
    ar: tuple[str, ...]
    slowed: tuple[tuple[float, ...], ...]   # [replica][stage] compute slowdown


def _links_between(host_of: Mapping[tuple[int, int], str], P: int, D: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(link kind between stage s and s+1, all-reduce kind of stage s) of a placement."""
    links = tuple("intra" if all(host_of[(s, r)] == host_of[(s + 1, r)] for r in range(D)) else "inter"
                  for s in range(P - 1))
    ar = tuple("intra" if len({host_of[(s, r)] for r in range(D)}) == 1 else "inter" for s in range(P))
    return links, ar


def _balanced_counts(first: Sequence[float], period: Sequence[float], total: int) -> tuple[int, ...] | None:
    """Micro-batches per replica, at least one each, summing to ``total``, that minimise the
    slowest replica's time when replica r takes first[r] + (n - 1) * period[r] for n of them
    (greedy on the next micro-batch's finish: exact for times linear in n)."""
    D = len(first)
    if total < D:
        return None
    counts = [1] * D
    heap = [(first[r] + period[r], r) for r in range(D)]
    heapq.heapify(heap)
    for _ in range(total - D):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (first[r] + counts[r] * period[r], r))
    return tuple(counts)


def _families(slots: Sequence[Slot], slowed_kinds: Mapping[str, tuple[str, float]]) -> dict[str, list[tuple[float, Slot]]]:
    """Per device kind that has a slowed copy among the slots: every slot of the kind or its
    copies, with its slowdown, fastest first."""
    out: dict[str, list[tuple[float, Slot]]] = defaultdict(list)
    for sl in slots:
        base, factor = slowed_kinds.get(sl.device_kind, (sl.device_kind, 1.0))
        out[base].append((max(1.0, float(factor)), sl))
    return {base: sorted(members, key=lambda x: (x[0], x[1].host, x[1].slot_id))
            for base, members in out.items() if any(f > 1.0 for f, _ in members)}


def _uneven_plans(slots, cals, slowed_kinds, sizes, global_batch, sched, allow_recompute, memory_fraction,
                  verify) -> list[_Uneven]:
    """The best few plans over replicas of one kind at measured speeds, each replica's share of
    the global batch (whole micro-batches) sized for its speed; replayed, fastest first."""
    screened = []
    for base, members in _families(slots, slowed_kinds).items():
        if base not in cals:
            continue
        group = [sl for _, sl in members]
        per_host = Counter(Counter(s.host for s in group).values()).most_common(1)[0][0]
        cap = int(min(s.memory_bytes for s in group) * memory_fraction)
        kind = _Kind(base, cals[base], cap, len(group), per_host)
        n = len(members)
        for mbs in (b for b in sizes if b in kind.cal.micro_batch_sizes and global_batch % b == 0):
            j, total = kind.cal.size_index(mbs), global_batch // mbs
            for P in range(1, min(kind.cal.n_segments, n) + 1):
                # the stash bound of the largest share any replica could take: memory from above
                part = _partition([kind] * P, j, sched, total, allow_recompute)
                if part is None:
                    continue
                bounds, flags = part
                # D divides the batch: scripts that pass the even shard (B / D examples) to every
                # replica keep working, the engine re-slices them (trainer.engine.replica_share)
                for D in (d for d in range(2, min(n // P, total) + 1) if global_batch % d == 0):
                    chosen = members[:P * D]   # the fastest slots; the slowest share a replica
                    if all(f == 1.0 for f, _ in chosen):
                        continue   # an even plan of the kind's own slots: the main search has it
                    host_of, assignment, slowed = {}, {}, []
                    for r in range(D):
                        row = chosen[r * P:(r + 1) * P]
                        slowed.append(tuple(f for f, _ in row))
                        for s, (_, sl) in enumerate(row):
                            host_of[(s, r)], assignment[sl.slot_id] = sl.host, (s, r)
                    links, ar = _links_between(host_of, P, D)
                    seq, timed = [kind] * P, {}
                    for sl in set(slowed):   # most replicas are alike: time each kind of replica once
                        timed[sl] = tuple(_estimate(seq, bounds, flags, j, D, m, links, ar, sched, sl) for m in (1, 2))
                    one, two = [timed[sl][0] for sl in slowed], [timed[sl][1] for sl in slowed]
                    counts = _balanced_counts(one, [b - a for a, b in zip(one, two)], total)
                    if counts is None:
                        continue
                    # scripts pass even shards: the replicas of the input stage put the batch's inputs
                    # together before each step (an all-gather: half an all-reduce's traffic)
                    gather = kind.cal.allreduce[ar[0]].allreduce_s(kind.cal.input_bytes[j] * total, D) / 2
                    est = gather + max(a + (c - 1) * (b - a) for a, b, c in zip(one, two, counts))
                    screened.append((est, mbs, P, counts, kind, bounds, flags, assignment, links, ar,
                                     tuple(slowed), gather))
    screened.sort(key=lambda x: x[0])
    replayed = []
    for est, mbs, P, counts, kind, bounds, flags, assignment, links, ar, slowed, gather in screened[:verify]:
        base_costs = stage_costs([kind.cal] * P, bounds, mbs, len(counts), links, ar)
        sim = gather + max(_simulate(sched, P, c, flags, tuple(x.slowed(f) for x, f in zip(base_costs, sl)))
                           for c, sl in zip(counts, slowed))
        replayed.append(_Uneven(sim, est, mbs, P, counts, kind, bounds, flags, assignment, links, ar, slowed))
    return sorted(replayed, key=lambda u: (round(u.sim, 6), u.P, len(u.counts)))


def _uneven_plan(u: _Uneven, global_batch: int, schedule: str, sched: Schedule, notes: list[str],
                 unused: tuple[str, ...], candidates: tuple[Candidate, ...], ruled_out: tuple[str, ...]) -> Plan:
    """The `Plan` of an uneven-share configuration."""
    k, P, D, mbs = u.kind, u.P, len(u.counts), u.mbs
    m = max(u.counts)
    stages = [_stage_plan(k, mbs, P, s, m, u.bounds, u.flags, sched) for s in range(P)]
    shares = tuple(c * mbs for c in u.counts)
    speeds = ", ".join(f"{max(f):g}x" for f in u.slowed)
    notes = notes + [f"uneven shares: replicas computing {speeds} slower than calibrated take "
                     f"{', '.join(map(str, shares))} of the global batch {global_batch}"]
    parallel = ParallelPlan(P=P, D=D, micro_batch_size=mbs, schedule=schedule, shares=shares,
                            cuts=tuple(int(b) - 1 for b in u.bounds[1:-1]), recompute=tuple(u.flags))
    mine = Candidate(P, D, mbs, m, (k.name,) * P, sum(u.flags), u.est, u.sim)
    return Plan(
        parallel=parallel, micro_batches=m, global_batch=global_batch, stages=tuple(stages),
        assignment=u.assignment, link_kinds=u.links, allreduce_kinds=u.ar, estimated_s=u.sim, unused=unused,
        notes=tuple(notes), candidates=(mine,) + candidates[:-1] if candidates else (mine,), ruled_out=ruled_out,
    )
