"""What every worker of a job decides the same way, and the optimizer step that follows.

At the end of a step the workers sum a few numbers (the squared gradient norm, the loss, overflow,
whether any was asked to checkpoint or to stop) up and down a two-level tree over the ZeroMQ
channel, so every worker takes the same branch: skip the step or apply it (clipped, unscaled),
checkpoint, stop. The control flags ride in that one exchange (trainer.engine.control).

`StepAgreement` is a part of `trainer.engine.varuna.Varuna`: it reads the worker's channel,
statistics tree, control line, parameters, optimizer and scaler, and sets the flags that say
where the state stands within the step (`_applying`, `_applied`) and what was agreed (`_agreed`).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from trainer.engine.precision import squared_norms
from trainer.errors import ConfigError

__all__ = ["StepAgreement"]

log = logging.getLogger("varuna")


class StepAgreement:
    def _stop_asked(self) -> bool:
        """Whether any worker was asked to stop (or to save and leave); collective."""
        self.control.poll()
        asked = torch.tensor([float(self.control.stop_requested or self.control.rescue_requested)])
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        return bool(asked[0] > 0)

    def _agree(self, stats: torch.Tensor) -> torch.Tensor:
        """The sum of `stats` over all workers, the same on every one.

        Over the ZeroMQ channel, up and down a two-level tree (`setup.stats_tree`): a replica's
        stage 0 finishes a step last (its final backward waits for everyone else's),
        so the others' statistics are already waiting when it gets there, and the root needs no
        round trip at all; a gloo all-reduce of a few numbers costs ~0.4 ms and more at every step
        even on one machine, and its ring grows with the world. A lone worker has nothing to agree."""
        if self.channel is None:
            return stats
        total = stats
        for child in self._stats_children:   # a fixed order: every worker gets the same bits
            total = total + self.channel.recv_stats(child)
        if self._stats_parent is not None:
            self.channel.send_stats(self._stats_parent, total)
            total = self.channel.recv_stats(self._stats_parent).clone()
        for child in self._stats_children:
            self.channel.send_stats(child, total)
        return total

    def _optimizer_step(self, clip: float | None) -> dict[str, object]:
        """Agree on the loss, the gradient norm and overflow in one exchange (`_agree`), then step."""
        with_grad = [p for p in self.parameters() if p.grad is not None]
        squares = squared_norms([p.grad for p in with_grad])
        # An inf/nan anywhere makes its parameter's norm non-finite: one check on the total
        # (tied copies included) is the overflow test.
        finite = math.isfinite(sum(squares))
        counted = {id(p) for p in self._norm_params}
        sq = sum(v for p, v in zip(with_grad, squares) if id(p) in counted)
        if not finite and self.precision != "fp16":
            log.warning("rank %d: non-finite gradients at step %d in %s; skipping the step",
                        self.rank, self.iteration, self.precision)
        last = self.stage == self.plan.P - 1
        local_loss = self.executor.loss_so_far() if last else 0.0
        self.control.poll()
        stats = torch.tensor([sq if finite else math.inf, local_loss, 0.0 if finite else 1.0,
                              float(self.control.checkpoint_requested), float(self.control.stop_requested)],
                             dtype=torch.float64)
        stats = self._agree(stats)
        # From here the step is applied: a rescue waits for it to be whole (the next boundary).
        self.control.abandonable = False
        self._applying = True
        self._agreed = {"checkpoint": bool(stats[3] > 0), "stop": bool(stats[4] > 0)}
        scale = self.scaler.scale
        overflow = bool(stats[2] > 0)
        # every replica holds the same reduced gradients: the norm counts one replica's stages
        norm = math.sqrt(stats[0] / self.plan.D) / scale if not overflow else math.inf
        if not overflow:
            factor = 1.0 / scale
            if clip is not None and norm > clip:
                factor *= clip / (norm + 1e-6)
            if factor != 1.0:
                for p in self.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)
            self._check_scheduler()
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                self._scheduler_steps = getattr(self.lr_scheduler, "last_epoch", None)
        self.scaler.update(overflow)
        self.grad_norm = norm
        self._applying, self._applied = False, True
        return {"loss": float(stats[1]), "overflow": overflow}

    def _check_scheduler(self) -> None:
        sched = self.lr_scheduler
        if sched is None or self._scheduler_steps is None:
            return
        if getattr(sched, "last_epoch", None) != self._scheduler_steps:
            raise ConfigError(f"the learning-rate scheduler's last_epoch moved outside Varuna ({sched.last_epoch}, "
                              f"{self._scheduler_steps} expected): a scheduler.step() of the script's own, or a "
                              "scheduler.load_state_dict() after set_optimizer",
                              hint="step() steps the scheduler given to set_optimizer: remove the script's own "
                                   "scheduler.step(); load a saved scheduler state before set_optimizer (Varuna's "
                                   "checkpoints keep it and restore it by themselves)")
