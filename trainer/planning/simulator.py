"""Predict a mini-batch's time and memory by replaying the executor's own action table.

`simulate` walks the per-stage lists that `schedule.build_table` produced (the lists the
executor runs; there is no second copy of any schedule here) with calibrated costs:

* FORWARD / RECOMPUTE / BACKWARD advance the stage's clock by the stage's cost; a FORWARD that
  keeps its autograd graph (a stage that does not recompute that micro-batch, e.g. the last
  stage) costs `forward_graph_s`, one that does not `forward_s`; where the stage's list splits
  the backward (a WEIGHT pass per micro-batch), BACKWARD costs the input pass and WEIGHT the
  weight pass (`StageCost.split_s`); the gradients recorded between the passes are held from
  BACKWARD (`StageCost.split_bytes`), and they and the activations are freed by WEIGHT;
* SEND_ACT / SEND_GRAD cost the sender only the message's CPU overhead (`Transfer.send_s`: sends
  are asynchronous); the bytes then occupy the directed link for ``bytes / bandwidth`` (sends on
  one link go one after another) and arrive ``latency`` later, plus optional seeded jitter;
* RECV_ACT / RECV_GRAD wait until the matching message arrived, then cost the receiver the
  message's CPU overhead (`Transfer.recv_s`);
* ALLREDUCE and STEP advance the clock by the stage's all-reduce (its gradient bytes over its D
  replicas) and optimizer step. Replicas of a stage are assumed to run in lock-step. Stages that
  share tied weights (`tied_allreduce_s` > 0: the first and last stage of a GPT) first meet in
  their ALLREDUCE and sum those gradients (at any D).

Memory per stage is replayed too: parameters, gradients and optimizer state, plus what the
schedule stashes (a recomputing stage keeps only each micro-batch's input until its backward and
one full set of activations while recomputing; otherwise the full activations are kept), plus,
during a FORWARD, RECOMPUTE, BACKWARD or WEIGHT, the pass's working bytes (`StageCost.working_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from trainer.errors import VarunaError
from trainer.planning.calibration import LINK_KINDS, Calibration
from trainer.planning.schedule import Action, Kind, ScheduleError

__all__ = [
    "SimulationError",
    "Transfer",
    "StageCost",
    "StageReport",
    "SimResult",
    "stage_costs",
    "simulate",
]


class SimulationError(VarunaError, ValueError):
    """Costs do not match the table they are replayed against."""


def _nonneg(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not np.isfinite(v) or v < 0:
            raise SimulationError(f"{owner}.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message on one link: `transfer_s` occupies the link, `latency_s` is added in flight;
    `send_s` and `recv_s` are CPU time the sending and the receiving stage spend on it."""

    latency_s: float = 0.0
    transfer_s: float = 0.0
    send_s: float = 0.0
    recv_s: float = 0.0

    def __post_init__(self) -> None:
        _nonneg("Transfer", latency_s=self.latency_s, transfer_s=self.transfer_s, send_s=self.send_s,
                recv_s=self.recv_s)


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one stage costs at one micro-batch size (one micro-batch unless stated)."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    send_act: Transfer = Transfer()  # its output to stage s+1
    send_grad: Transfer = Transfer()  # the gradient of its input to stage s-1
    allreduce_s: float = 0.0  # its gradients over the D replicas (whole mini-batch)
    step_s: float = 0.0
    static_bytes: int = 0  # parameters + gradients + optimizer state, and the worker's own (Calibration.worker_bytes)
    input_bytes: int = 0  # its input boundary, stashed per micro-batch in flight
    activation_bytes: int = 0  # what the autograd graph keeps for one micro-batch
    forward_graph_s: float | None = None  # a FORWARD that keeps its graph (None: forward_s)
    tied_allreduce_s: float = 0.0  # summing tied weights' gradients with the other stages holding them
    # a split backward's input pass and weight pass, as calibrated; None (not measured): each half
    # the backward, as in the zero-bubble paper (a matrix product's backward is two products of
    # its size, one for the input, one for the weight)
    split_s: tuple[float, float] | None = None
    split_bytes: int = 0   # held from a split backward's input pass to its weight pass (per micro-batch)
    working_bytes: int = 0   # what one pass holds at its peak beyond the graphs (its largest segment's)

    def __post_init__(self) -> None:
        if self.forward_graph_s is None:
            object.__setattr__(self, "forward_graph_s", self.forward_s)
        _nonneg(
            "StageCost",
            forward_s=self.forward_s,
            forward_graph_s=self.forward_graph_s,
            tied_allreduce_s=self.tied_allreduce_s,
            backward_s=self.backward_s,
            recompute_s=self.recompute_s,
            allreduce_s=self.allreduce_s,
            step_s=self.step_s,
            static_bytes=self.static_bytes,
            input_bytes=self.input_bytes,
            activation_bytes=self.activation_bytes,
            split_bytes=self.split_bytes,
            working_bytes=self.working_bytes,
        )
        if self.split_s is not None:
            _nonneg("StageCost", input_pass_s=self.split_s[0], weight_pass_s=self.split_s[1])

    def split(self) -> tuple[float, float]:
        """(input pass, weight pass) of this stage's split backward."""
        return self.split_s if self.split_s is not None else (self.backward_s / 2, self.backward_s / 2)


    def slowed(self, factor: float) -> StageCost:
        """The stage on a device ``factor`` times slower: its compute, its optimizer step and the
        CPU it spends on messages (not the links' time, nor the all-reduce's)."""
        if factor == 1.0:
            return self
        cpu = lambda t: replace(t, send_s=t.send_s * factor, recv_s=t.recv_s * factor)  # noqa: E731
        return replace(self, forward_s=self.forward_s * factor, backward_s=self.backward_s * factor,
                       split_s=None if self.split_s is None else (self.split_s[0] * factor, self.split_s[1] * factor),
                       recompute_s=self.recompute_s * factor, forward_graph_s=self.forward_graph_s * factor,
                       step_s=self.step_s * factor, send_act=cpu(self.send_act), send_grad=cpu(self.send_grad))


@dataclass(frozen=True, slots=True)
class StageReport:
    compute_s: float  # forward + recompute + backward
    allreduce_s: float  # data-parallel and tied all-reduces
    step_s: float
    idle_s: float  # mini-batch time minus the others: waiting for peers or the flush
    finish_s: float
    peak_bytes: int
    message_s: float = 0.0  # CPU spent sending and receiving point-to-point messages


@dataclass(frozen=True, slots=True)
class SimResult:
    minibatch_s: float
    stages: tuple[StageReport, ...]

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        return tuple(s.peak_bytes for s in self.stages)


def stage_costs(
    calibrations: Sequence[Calibration],
    bounds: Sequence[int],
    micro_batch_size: int,
    replicas: int,
    link_kinds: Sequence[str],
    allreduce_kinds: Sequence[str],
) -> tuple[StageCost, ...]:
    """Sum the calibrated segments of each stage. Stage s runs segments bounds[s]..bounds[s+1]-1
    on a device whose calibration is calibrations[s]; link_kinds[s] is the kind of link between
    stages s and s+1, allreduce_kinds[s] the kind the ring of stage s's replicas crosses."""
    P = len(bounds) - 1
    if P < 1 or len(calibrations) != P or len(link_kinds) != P - 1 or len(allreduce_kinds) != P:
        raise SimulationError(
            f"{P} stages need {P} calibrations, {P - 1} link kinds and {P} all-reduce kinds; got "
            f"{len(calibrations)}, {len(link_kinds)}, {len(allreduce_kinds)}"
        )
    n = calibrations[0].n_segments
    if bounds[0] != 0 or bounds[-1] != n or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise SimulationError(f"bounds {list(bounds)} must rise strictly from 0 to {n}")
    for kind in (*link_kinds, *allreduce_kinds):
        if kind not in LINK_KINDS:
            raise SimulationError(f"unknown link kind {kind!r}; expected one of {LINK_KINDS}")
    stage_of = [s for s in range(P) for _ in range(bounds[s], bounds[s + 1])]
    tied_s, tied_less = [0.0] * P, [0] * P   # tied all-reduce per stage; bytes it takes out of the DP one
    for t in calibrations[0].tied:
        holders = sorted({stage_of[k] for k in t.segments if k < n})
        for s in holders:
            copies = sum(1 for k in t.segments if stage_of[k] == s)
            tied_less[s] += (copies if len(holders) > 1 else copies - 1) * t.param_bytes
        if len(holders) > 1:
            lo, hi = holders[0], holders[-1]
            crossed = {*link_kinds[lo:hi], *(allreduce_kinds[s] for s in holders)}
            kind = "inter" if "inter" in crossed else "intra"
            for s in holders:
                tied_s[s] += calibrations[s].allreduce[kind].allreduce_s(t.param_bytes, len(holders) * replicas)
    out = []
    for s in range(P):
        cal, lo, hi = calibrations[s], bounds[s], bounds[s + 1]
        if cal.n_segments != n:
            raise SimulationError(f"calibration {cal.key} has {cal.n_segments} segments, expected {n}")
        j = cal.size_index(micro_batch_size)
        segs = cal.segments[lo:hi]
        costs = [seg.costs[j] for seg in segs]
        out_bytes = costs[-1].activation_bytes
        in_bytes = cal.input_bytes[j] if s == 0 else calibrations[s - 1].segments[lo - 1].costs[j].activation_bytes
        act = Transfer()
        if s < P - 1:
            link = cal.links[link_kinds[s]]
            act = Transfer(link.latency_s, out_bytes / link.bandwidth_Bps, link.send_overhead_s,
                           calibrations[s + 1].links[link_kinds[s]].recv_overhead_s)
        grad = Transfer()
        if s > 0:
            link = cal.links[link_kinds[s - 1]]
            grad = Transfer(link.latency_s, in_bytes / link.bandwidth_Bps, link.send_overhead_s,
                            calibrations[s - 1].links[link_kinds[s - 1]].recv_overhead_s)
        grad_bytes = max(0, sum(seg.param_bytes for seg in segs) - tied_less[s])
        out.append(
            StageCost(
                forward_s=sum(c.forward_s for c in costs),
                forward_graph_s=sum(c.recompute_s for c in costs),  # with the graph: as a recompute
                tied_allreduce_s=tied_s[s],
                backward_s=sum(c.backward_s for c in costs),
                split_s=(None if any(c.input_grad_s is None for c in costs) else
                         (sum(c.input_grad_s for c in costs), sum(c.weight_grad_s for c in costs))),
                # not measured (an older calibration): as much as the activations, to be safe
                split_bytes=sum(c.peak_activation_bytes if c.split_bytes is None else c.split_bytes for c in costs),
                recompute_s=sum(c.recompute_s for c in costs),
                send_act=act,
                send_grad=grad,
                allreduce_s=cal.allreduce[allreduce_kinds[s]].allreduce_s(grad_bytes, replicas),
                step_s=sum(seg.step_s for seg in segs),
                static_bytes=sum(seg.static_bytes for seg in segs) + cal.worker_bytes,
                input_bytes=in_bytes,
                activation_bytes=sum(c.peak_activation_bytes for c in costs),
                working_bytes=max((c.working_bytes or 0 for c in costs), default=0),
            )
        )
    return tuple(out)


_F, _R, _B, _RA, _SA, _RG, _SG, _AR, _OPT, _W = range(10)
_CODE = {
    Kind.FORWARD: _F, Kind.RECOMPUTE: _R, Kind.BACKWARD: _B, Kind.RECV_ACT: _RA, Kind.SEND_ACT: _SA,
    Kind.RECV_GRAD: _RG, Kind.SEND_GRAD: _SG, Kind.ALLREDUCE: _AR, Kind.STEP: _OPT, Kind.WEIGHT: _W,
}
# The categories trainer.engine.trace records for the executor's actions, so that a simulated and a
# measured step render alike in the report's timelines and Perfetto.
_TRACE_CATEGORY = ("forward", "recompute", "backward", "recv", "send", "recv", "send", "allreduce", "optimizer",
                   "backward")


def _trace_event(action: Action, code: int, start_s: float, end_s: float) -> dict:
    """One complete ("X") Chrome trace event, shaped as trainer.engine.trace.TraceRecorder writes it."""
    args = {} if action.micro_batch is None else {"micro_batch": action.micro_batch}
    return {"name": str(action), "cat": _TRACE_CATEGORY[code], "ph": "X", "ts": round(start_s * 1e6, 3),
            "dur": round(max(0.0, end_s - start_s) * 1e6, 3), "pid": action.stage, "tid": 0, "args": args}


def simulate(
    table: Mapping[int, Sequence[Action]],
    costs: Sequence[StageCost],
    *,
    jitter_s: float = 0.0,
    seed: int = 0,
    events: list[dict] | None = None,
) -> SimResult:
    """Replay `table` with `costs` (one per stage). `jitter_s` > 0 adds an exponentially
    distributed extra delay of that mean to every send, drawn per message from `seed` (the same
    message gets the same delay whatever the schedule, so schedules compare fairly).

    With `events` (a list), every action is appended to it as a Chrome trace event (times from
    0 in microseconds, pid = stage, tid = replica 0): compute and waits span the stage's clock,
    a send spans its time on the link."""
    P = len(table)
    if sorted(table) != list(range(P)) or len(costs) != P:
        raise SimulationError(f"table has stages {sorted(table)} but {len(costs)} stage costs were given")
    _nonneg("simulate", jitter_s=jitter_s)
    lists = [[(_CODE[a.kind], a.micro_batch or 0) for a in table[s]] for s in range(P)]
    m = 1 + max((mb for lst in lists for _, mb in lst), default=0)
    delay = None
    if jitter_s > 0:
        delay = np.random.default_rng(seed).exponential(jitter_s, size=(P, 2, m)).tolist()
    recomputes = [any(c == _R for c, _ in lst) for lst in lists]
    recomputed = [{mb for c, mb in lst if c == _R} for lst in lists]
    split = [any(c == _W for c, _ in lst) for lst in lists]   # a stage splits all its backwards or none
    tied = {s for s in range(P) if costs[s].tied_allreduce_s > 0}
    tied = tied if len(tied) > 1 else set()   # one holder sums its copies locally
    tied_ready: dict[int, float] = {}   # stage -> when it reached its ALLREDUCE
    message = [0.0] * P

    clock = [0.0] * P
    idx = [0] * P
    compute = [0.0] * P
    arrive_act: list[dict[int, float]] = [{} for _ in range(P)]  # at stage s, by micro-batch
    arrive_grad: list[dict[int, float]] = [{} for _ in range(P)]
    link_free_down = [0.0] * P  # link s -> s+1
    link_free_up = [0.0] * P  # link s -> s-1
    held = [0] * P
    peak = [0] * P
    progressed = True
    while progressed:
        progressed = False
        for s in range(P):
            lst, c, t, i = lists[s], costs[s], clock[s], idx[s]
            keep = c.input_bytes + (0 if recomputes[s] else c.activation_bytes)
            b_cost, w_cost = c.split() if split[s] else (c.backward_s, 0.0)
            while i < len(lst):
                code, mb = lst[i]
                t_before = t
                if code == _F:
                    f = c.forward_s if mb in recomputed[s] else c.forward_graph_s
                    t += f
                    compute[s] += f
                    held[s] += keep
                    peak[s] = max(peak[s], held[s] + c.working_bytes)
                elif code == _B:
                    t += b_cost
                    compute[s] += b_cost
                    peak[s] = max(peak[s], held[s] + c.working_bytes)
                    if split[s]:
                        held[s] += c.split_bytes
                    else:
                        held[s] -= c.input_bytes + c.activation_bytes
                elif code == _W:
                    t += w_cost
                    compute[s] += w_cost
                    peak[s] = max(peak[s], held[s] + c.working_bytes)
                    held[s] -= c.input_bytes + c.activation_bytes + c.split_bytes
                elif code == _R:
                    t += c.recompute_s
                    compute[s] += c.recompute_s
                    held[s] += c.activation_bytes
                    peak[s] = max(peak[s], held[s] + c.working_bytes)
                elif code == _RA:
                    got = arrive_act[s].get(mb)
                    if got is None:
                        break
                    t = max(t, got) + costs[s - 1].send_act.recv_s
                    message[s] += costs[s - 1].send_act.recv_s
                elif code == _RG:
                    got = arrive_grad[s].get(mb)
                    if got is None:
                        break
                    t = max(t, got) + costs[s + 1].send_grad.recv_s
                    message[s] += costs[s + 1].send_grad.recv_s
                elif code == _SA:
                    t += c.send_act.send_s
                    message[s] += c.send_act.send_s
                    start = t_before = max(t, link_free_down[s])
                    link_free_down[s] = start + c.send_act.transfer_s
                    extra = delay[s][0][mb] if delay else 0.0
                    arrive_act[s + 1][mb] = link_free_down[s] + c.send_act.latency_s + extra
                elif code == _SG:
                    t += c.send_grad.send_s
                    message[s] += c.send_grad.send_s
                    start = t_before = max(t, link_free_up[s])
                    link_free_up[s] = start + c.send_grad.transfer_s
                    extra = delay[s][1][mb] if delay else 0.0
                    arrive_grad[s - 1][mb] = link_free_up[s] + c.send_grad.latency_s + extra
                elif code == _AR:
                    if s in tied:   # meet the other holders of the tied weights first
                        tied_ready.setdefault(s, t)
                        if len(tied_ready) < len(tied):
                            break
                        t = max(tied_ready.values()) + c.tied_allreduce_s
                    t += c.allreduce_s
                else:
                    t += c.step_s
                if events is not None:
                    end = link_free_down[s] if code == _SA else link_free_up[s] if code == _SG else t
                    events.append(_trace_event(table[s][i], code, t_before, end))
                peak[s] = max(peak[s], held[s])
                i += 1
                progressed = True
            clock[s], idx[s] = t, i
    stuck = [s for s in range(P) if idx[s] < len(lists[s])]
    if stuck:
        raise ScheduleError(
            "simulated table deadlocks: " + ", ".join(f"{table[s][idx[s]]} never receives" for s in stuck)
        )
    total = max(clock)
    stages = []
    for s in range(P):
        n_ar = sum(1 for code, _ in lists[s] if code == _AR)
        n_opt = sum(1 for code, _ in lists[s] if code == _OPT)
        ar = n_ar * (costs[s].allreduce_s + (costs[s].tied_allreduce_s if s in tied else 0.0))
        st = n_opt * costs[s].step_s
        stages.append(
            StageReport(
                compute_s=compute[s],
                allreduce_s=ar,
                step_s=st,
                idle_s=max(0.0, total - compute[s] - ar - st - message[s]),
                finish_s=clock[s],
                peak_bytes=int(costs[s].static_bytes + peak[s]),
                message_s=message[s],
            )
        )
    return SimResult(total, tuple(stages))
