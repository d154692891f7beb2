"""The one interpreter of schedule tables: runs a stage's action list for one mini-batch.

The simulator replays the same lists with calibrated costs ([Note: a schedule is data]), so this module
must not reorder or add work: every action in the list is executed, in order, and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import fx, nn

from trainer.engine.comm import PeerChannel
from trainer.engine.precision import Precision, autocast
from trainer.engine.split_backward import WeightPass, backward_input, backward_weight
from trainer.errors import ConfigError
from trainer.graph.evaluation import evaluation_module
from trainer.graph.keyed_random import draws_in_evaluation, draws_unkeyed
from trainer.graph.keyed_rng import Draws, drawing
from trainer.graph.partition import ACTIVATION
from trainer.graph.written import BufferSnapshot, writes_input, written_buffers
from trainer.planning.schedule import Action, Kind

log = logging.getLogger("varuna")

__all__ = ["StageExecutor"]

_CATEGORY = {
    Kind.FORWARD: "forward", Kind.RECOMPUTE: "recompute", Kind.BACKWARD: "backward", Kind.WEIGHT: "backward",
    Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv", Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send",
    Kind.ALLREDUCE: "allreduce", Kind.STEP: "optimizer",
}


class StageExecutor:
    """Runs one stage's actions. Holds per-micro-batch state only while a step runs."""

    def __init__(self, module: nn.Module, *, stage: int, stages: int, takes_activation: bool,
                 channel: PeerChannel | None, device: torch.device, precision: Precision,
                 recorder=None) -> None:
        self.module, self.stage, self.stages = module, stage, stages
        self.last = stage == stages - 1
        self.takes_activation = takes_activation
        self.channel, self.device, self.precision = channel, device, precision
        self.recorder = recorder
        self._on_cpu = device.type == "cpu"   # received tensors are CPU tensors already
        # Keyed random ops replay on recompute from their key alone; only a random op the capture
        # could not key needs torch's generator state saved for it.
        # [Note: randomness belongs to the sample]
        self._saves_rng = draws_unkeyed(module)
        # Buffers the forward writes (BatchNorm's statistics): a recompute must not write them a
        # second time, nor an evaluation at all.
        self._written = written_buffers(module)
        # A stage that writes what it receives in place (`h.mul_(2)` after a CutPoint) gets a copy:
        # the received tensor is a leaf autograd refuses to see written, and without grad (the
        # forward of a stage that recomputes) the write reached the activation kept for the recompute.
        self._copies_activation = takes_activation and isinstance(module, fx.GraphModule) and writes_input(
            module, ACTIVATION)
        self._running = module
        self._evaluating: tuple[tuple[int, ...], nn.Module] | None = None   # (its tensors' ids, the module)

    def run(self, actions: Sequence[Action], micro_inputs: Sequence[Mapping[str, torch.Tensor]],
            weights: Sequence[float], *, loss_scale: float = 1.0, training: bool = True,
            handlers: Mapping[Kind, Callable[[], None]] | None = None,
            before_last_backward: Callable[[], None] | None = None,
            draws: Sequence[Draws] | None = None) -> float:
        """Execute `actions`; return this stage's sum of weighted micro-batch losses (0 unless last).
        `before_last_backward` runs just before the final BACKWARD or WEIGHT, the last action that
        adds to the parameters' gradients (to overlap their reduction).
        `draws[m]` keys micro-batch m's random ops (its step and first example); without it,
        every micro-batch draws as examples 0.. of step 0."""
        self._inputs, self._weights, self._scale = micro_inputs, weights, loss_scale
        self._draws = draws if draws is not None else [Draws(training=training)] * len(micro_inputs)
        self._training = training
        self._act: dict[int, torch.Tensor] = {}
        self._stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._rng: dict[int, tuple] = {}
        self._grad_out: dict[int, torch.Tensor] = {}
        self._grad_in: dict[int, torch.Tensor] = {}
        self._outbox: dict[int, torch.Tensor] = {}
        self._weigh: dict[int, WeightPass] = {}
        self._before: dict[int, BufferSnapshot] = {}   # written buffers as a recomputed forward found them
        self._losses: list[torch.Tensor] = []
        # A micro-batch recomputed later keeps no graph from its first forward.
        self._recompute_set = {a.micro_batch for a in actions if a.kind is Kind.RECOMPUTE}
        # A micro-batch with a WEIGHT pass splits its backward ([Note: a schedule is data]).
        self._split = {a.micro_batch for a in actions if a.kind is Kind.WEIGHT}
        handlers = handlers or {}
        last_backward = max((i for i, a in enumerate(actions) if a.kind in (Kind.BACKWARD, Kind.WEIGHT)), default=-1)
        dispatch = self._DISPATCH
        recorder = self.recorder if getattr(self.recorder, "enabled", self.recorder is not None) else None

        def execute(kind: Kind, micro_batch: int | None) -> None:
            if kind in handlers:
                handlers[kind]()
            else:
                dispatch[kind](self, micro_batch)

        self._running = self.module if training else self._evaluation_module()
        for i, action in enumerate(actions):
            if i == last_backward and before_last_backward is not None:
                before_last_backward()
            if recorder is None:   # no span (and no action text) per action when not tracing
                execute(action.kind, action.micro_batch)
                continue
            with recorder.span(str(action), _CATEGORY[action.kind], action.micro_batch):
                execute(action.kind, action.micro_batch)
                if self.device.type == "cuda":   # a span is the kernels' time, not their launch's
                    torch.cuda.synchronize(self.device)
        if self._stash or self._act or self._grad_out or self._outbox or self._rng or self._weigh or self._before:
            raise RuntimeError(f"stage {self.stage}: the schedule left work undone (stashed "
                               f"{sorted(self._stash)}, unsent {sorted(self._outbox)}, received {sorted(self._act)}, "
                               f"not weighed {sorted(self._weigh)}, not recomputed {sorted(self._before)})")
        return self.loss_so_far()

    def loss_so_far(self) -> float:
        """Sum of the weighted losses of the micro-batches forwarded so far in this run."""
        return float(sum(self._losses)) if self._losses else 0.0

    # -- compute -------------------------------------------------------------------------------

    def _call(self, m: int, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        kwargs = dict(self._inputs[m])
        x = None
        if self.takes_activation:
            x = self._act[m]
            if grad and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            kwargs[ACTIVATION] = x.clone() if self._copies_activation else x
        with torch.set_grad_enabled(grad), autocast(self.precision, self.device), drawing(self._draws[m]):
            try:
                out = self._running(**kwargs)
            except IndexError as exc:   # torch's own words name no input: "index out of range in self"
                if "index out of range" not in str(exc):
                    raise   # another IndexError ("Dimension out of range"): its own words say enough
                shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self._inputs[m].items()
                                   if isinstance(v, torch.Tensor))
                raise ConfigError(f"the model indexed outside one of its tables on a micro-batch of {shapes}: {exc}",
                                  hint="a sequence longer than the model's position embeddings, or a token id "
                                       "past its vocabulary: check the batch's lengths and ids against the "
                                       "model's config") from exc
        return x, out

    def _forward(self, m: int) -> None:
        keep_graph = self._training and (self.last or m not in self._recompute_set)
        if self._training and not keep_graph:
            if self._saves_rng:
                self._rng[m] = self._rng_state()
            if self._written:
                self._before[m] = BufferSnapshot(self.module, self._written)
        x, out = self._call(m, keep_graph)
        if self.last:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                what = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                        else f"a {type(out).__name__}")
                raise ConfigError(f"the model's forward returned {what}; it must return the scalar loss",
                                  hint="compute the loss inside forward (e.g. F.cross_entropy(logits, labels)) "
                                       "and return it alone")
            # a micro-batch that weighs nothing (no token its loss averages: 0/0, NaN) adds nothing
            weight = self._weights[m]
            self._losses.append(out.detach().float() * weight if weight else torch.zeros((), device=out.device))
        if keep_graph:
            self._stash[m] = (x, out)
        elif not self.last:
            self._outbox[m] = out   # kept only until it is sent
        if not self._training:
            self._act.pop(m, None)

    def _recompute(self, m: int) -> None:
        before = self._before.pop(m, None)
        # the forward runs again on the buffers it first saw, written into copies: the module's
        # own keep what the forwards wrote, once per micro-batch, as in an eager loop
        with before.in_place_of_current() if before is not None else contextlib.nullcontext():
            if m not in self._rng:
                self._stash[m] = self._call(m, True)
                return
            with torch.random.fork_rng(devices=self._rng_devices()):
                self._set_rng_state(self._rng.pop(m))
                x, out = self._call(m, True)
            self._stash[m] = (x, out)

    def _backward(self, m: int) -> None:
        x, out = self._stash.pop(m)
        if self.last:
            out, grad = out.float() * (self._weights[m] * self._scale), None
        else:
            grad = self._grad_out.pop(m)
        self._act.pop(m, None)
        if m in self._split:
            # read each time: a weight load may replace the module's parameter objects
            params = [p for p in self.module.parameters() if p.requires_grad]
            grad_in, self._weigh[m] = backward_input(out, grad, x if self.takes_activation else None, params)
            if grad_in is not None:
                self._grad_in[m] = grad_in
            return
        torch.autograd.backward(out, grad)
        if self.takes_activation and x is not None and x.grad is not None:
            self._grad_in[m] = x.grad

    def _weight(self, m: int) -> None:
        backward_weight(self._weigh.pop(m))

    # -- communication -------------------------------------------------------------------------

    def _recv_act(self, m: int) -> None:
        t = self.channel.recv("act", m)
        self._act[m] = t if self._on_cpu else t.to(self.device, non_blocking=True)

    def _send_act(self, m: int) -> None:
        out = self._outbox.pop(m) if m in self._outbox else self._stash[m][1]
        self.channel.send("act", m, out)

    def _recv_grad(self, m: int) -> None:
        t = self.channel.recv("grad", m)
        self._grad_out[m] = t if self._on_cpu else t.to(self.device, non_blocking=True)

    def _send_grad(self, m: int) -> None:
        self.channel.send("grad", m, self._grad_in.pop(m))

    def _stage_wide(self, _m) -> None:
        raise RuntimeError("ALLREDUCE and STEP need handlers from the caller")

    _DISPATCH = {
        Kind.FORWARD: _forward, Kind.RECOMPUTE: _recompute, Kind.BACKWARD: _backward, Kind.WEIGHT: _weight,
        Kind.RECV_ACT: _recv_act, Kind.SEND_ACT: _send_act,
        Kind.RECV_GRAD: _recv_grad, Kind.SEND_GRAD: _send_grad,
        Kind.ALLREDUCE: _stage_wide, Kind.STEP: _stage_wide,
    }

    # -- helpers -------------------------------------------------------------------------------

    def _evaluation_module(self) -> nn.Module:
        """The stage's graph as `model.eval()` would run it (trainer.graph.evaluation), built again
        when a weight load replaced the stage's tensors."""
        ids = tuple(id(t) for t in (*self.module.parameters(), *self.module.buffers()))
        if self._evaluating is None and (drawn := draws_in_evaluation(self.module)):
            # a probe's drop-path model evaluated 2e-2 off model.eval(), with no word
            log.warning("evaluate runs the captured training forward: its random ops %s draw as in training, "
                        "where model.eval() would skip a branch the model takes only when self.training "
                        "(drop-path, added noise); dropout is off. Evaluate such a model from an exported "
                        "checkpoint (varunactl export) to match model.eval()", ", ".join(drawn))
        if self._evaluating is None or self._evaluating[0] != ids:
            self._evaluating = (ids, evaluation_module(self.module))
        return self._evaluating[1]

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _rng_state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
