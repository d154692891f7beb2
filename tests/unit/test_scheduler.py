"""A learning-rate scheduler given to set_optimizer is stepped by Varuna, once per applied
optimizer step, so the checkpoint taken inside step() holds it in step with the parameters and
a resumed run uses the learning rates the uninterrupted one did. One real worker in this process.
"""

from __future__ import annotations

import pytest
import torch
from support.normed import Normed, normed_batch

from trainer import Varuna
from trainer.errors import ConfigError


def _worker(lr_lambda):
    v = Varuna(Normed(), {0: [0]}, normed_batch, 8, 4)
    opt = torch.optim.SGD(v.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    v.set_optimizer(opt, lr_scheduler=sched)
    return v, opt, sched


def _train(v, opt, steps):
    out = []
    for _ in range(steps):
        lr = opt.param_groups[0]["lr"]
        loss, _ = v.step(normed_batch(8))
        out.append((v.iteration - 1, lr, loss))
    return out


def _decay(step):
    return 1.0 / (1 + step)


def test_a_resumed_run_uses_the_uninterrupted_learning_rates(tmp_path):
    v, opt, _ = _worker(_decay)
    try:
        whole = _train(v, opt, 6)
    finally:
        v.close()
    assert [lr for _, lr, _ in whole] == pytest.approx([0.05 * _decay(s) for s in range(6)])
    v, opt, _ = _worker(_decay)
    try:
        first = _train(v, opt, 3)
        v.checkpoint(str(tmp_path))
    finally:
        v.close()
    v, opt, sched = _worker(_decay)
    try:
        assert v.load_checkpoint(str(tmp_path)) == 3 and sched.last_epoch == 3
        rest = _train(v, opt, 3)
    finally:
        v.close()
    resumed = first + rest
    assert [s for s, _, _ in resumed] == list(range(6))
    for (_, lr_a, loss_a), (_, lr_b, loss_b) in zip(whole, resumed):
        assert lr_b == pytest.approx(lr_a) and loss_b == pytest.approx(loss_a, rel=1e-6)


def test_a_script_that_also_steps_the_scheduler_is_told_to_stop(tmp_path):
    v, opt, sched = _worker(_decay)
    try:
        v.step(normed_batch(8))
        sched.step()   # the habit of plain PyTorch loops: here it would skip a step of the schedule
        with pytest.raises(ConfigError, match="last_epoch moved outside Varuna") as err:
            v.step(normed_batch(8))
        assert "remove the script's own scheduler.step()" in str(err.value.hint)
    finally:
        v.close()


def test_a_scheduler_state_loaded_after_set_optimizer_is_named_with_where_to_load_it():
    """A probe's resume loaded its own scheduler state after set_optimizer and was told to remove
    a scheduler.step() it never called."""
    v, opt, sched = _worker(_decay)
    try:
        sched.load_state_dict({**sched.state_dict(), "last_epoch": 3})
        with pytest.raises(ConfigError, match=r"load_state_dict\(\) after set_optimizer") as err:
            v.step(normed_batch(8))
        assert "before set_optimizer" in str(err.value.hint)
    finally:
        v.close()


def test_a_scheduler_that_steps_on_a_metric_is_refused_at_set_optimizer():
    """ReduceLROnPlateau failed at the first step with step() missing its metric."""
    v = Varuna(Normed(), {0: [0]}, normed_batch, 8, 4)
    try:
        opt = torch.optim.SGD(v.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        with pytest.raises(ConfigError, match=r"ReduceLROnPlateau: its step\(\) needs metrics") as err:
            v.set_optimizer(opt, lr_scheduler=plateau)
        assert "step it yourself with the metric" in err.value.hint
        v.set_optimizer(opt)   # without it, the script steps it itself
        v.step(normed_batch(8))
        plateau.step(1.0)
    finally:
        v.close()


def test_a_scheduler_the_script_steps_itself_is_said_at_the_first_step_and_after_a_resume_that_restarts_it(
        tmp_path, caplog):
    """A probe's port stepped a warmup LambdaLR itself, as every PyTorch loop does: a resumed run
    started the warmup over (lr 2.9e-4 where the uninterrupted run had 4.8e-4), with no word."""
    def worker(last_epoch: int = -1):
        v = Varuna(Normed(), {0: [0]}, normed_batch, 8, 4)
        opt = torch.optim.SGD(v.parameters(), lr=0.05)
        for g in opt.param_groups:
            g.setdefault("initial_lr", g["lr"])   # what a scheduler built at a later epoch needs
        v.set_optimizer(opt)
        return v, torch.optim.lr_scheduler.LambdaLR(opt, _decay, last_epoch=last_epoch)

    v, sched = worker()
    try:
        with caplog.at_level("WARNING", logger="varuna"):
            v.step(normed_batch(8))
            sched.step()
        assert "scheduler LambdaLR was built on this optimizer but not given" in caplog.text
        assert "lr_scheduler=sched" in caplog.text
        v.checkpoint(str(tmp_path))
    finally:
        v.close()
    # built afresh; built from the step it resumes at; restored by the script, to where it was and to its
    # start (its attributes then live in a dict of their own, which is what refers to the optimizer)
    for last_epoch, restore, said in ((-1, None, True), (0, None, False), (-1, 1, False), (-1, 0, True)):
        caplog.clear()
        v, sched = worker(last_epoch)
        if restore is not None:
            sched.load_state_dict({**sched.state_dict(), "last_epoch": restore})
        try:
            assert v.load_checkpoint(str(tmp_path)) == 1
            with caplog.at_level("WARNING", logger="varuna"):
                v.step(normed_batch(8))
            assert ("learning-rate schedule started over: LambdaLR, a scheduler not given to set_optimizer, is at "
                    "its start in this run, resumed at step 1" in caplog.text) == said, caplog.text
        finally:
            v.close()


def test_a_step_past_the_jobs_last_one_ends_the_script_with_status_0(caplog):
    """A probe's script looped to its own --steps 300 under a job of 10: status said "step 10 of
    10" while it trained on, and the job failed for want of checkpoint 10. Refused with an error,
    a job whose steps were all trained would fail; ended with status 0, it is done."""
    import dataclasses

    from trainer.engine.control import StepsDone

    v = Varuna(Normed(), {0: [0]}, normed_batch, 8, 4)
    try:
        v.set_optimizer(torch.optim.SGD(v.parameters(), lr=0.05))
        v.assignment = dataclasses.replace(v.assignment, steps=2)
        v.step(normed_batch(8))
        v.step(normed_batch(8))
        with caplog.at_level("ERROR", logger="varuna"), pytest.raises(StepsDone) as done:
            v.step(normed_batch(8))
        assert done.value.code == 0 and v.iteration == 2
        assert "step() called for step 2, past the last of the job's 2 steps" in caplog.text
    finally:
        v.close()
