"""trainer.checkpoint.rescue: the survivors of a broken epoch save the step they hold, without a
collective, and only a checkpoint that every stage's files complete is ever loaded.

Workers here are plain objects holding real tensors and a real optimizer (the `Checkpointed`
protocol); the files, records, manifests and fences are the real store's. The daemon-level
behaviour (kill -9 in a 2x2 job, the fallback of a P x 1 job) is tests/integration/test_daemon_ring.py's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import contents, fences, reading, rescue
from trainer.checkpoint import store as ckpt_store
from trainer.engine.precision import LossScaler
from trainer.errors import CheckpointError
from trainer.planning.parallel import ParallelPlan

# Two stages, one layer file each; stage 1 also owns a buffer.
FILES = {"a.weight": "layer_000.pt", "b.weight": "layer_001.pt", "b.running": "layer_001.pt"}
STAGE_OF = {"a.weight": 0, "b.weight": 1, "b.running": 1}


class _Layout:
    files = FILES

    def writer_stage(self, name: str) -> int:
        return STAGE_OF[name]


def _worker(rank: int, stage: int, replica: int, *, iteration: int, epoch: int = 5, seed: int = 0, keep: int = 3):
    """A worker of a 2 x 2 job after `iteration` steps: replicas of a stage hold equal tensors."""
    gen = torch.Generator().manual_seed(100 * stage + iteration)   # the same for both replicas
    named = {n: (nn.Parameter(torch.randn(4, 3, generator=gen)) if n.endswith("weight") else torch.randn(3, generator=gen))
             for n in FILES if STAGE_OF[n] == stage}
    params = [t for t in named.values() if isinstance(t, nn.Parameter)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:   # momentum state, equal on both replicas
        opt.state[p] = {"momentum_buffer": p.detach() * 0.5}
    torch.manual_seed(seed)   # per-worker RNG: it differs between replicas, hence one meta file each
    return SimpleNamespace(rank=rank, stage=stage, replica=replica, plan=ParallelPlan(P=2, D=2), cuts=[1],
                           layout=_Layout(), assignment=SimpleNamespace(epoch=epoch, world_size=4, keep_checkpoints=keep),
                           device=torch.device("cpu"), optimizer=opt, scaler=LossScaler(1.0, 1.0, 1.0),
                           lr_scheduler=None, iteration=iteration, named_tensors=lambda named=named: named)


def _periodic(store: str, it: int) -> None:
    """A complete ordinary checkpoint at `it`, written the way rank 0 commits one."""
    d = reading.checkpoint_dir(store, it)
    entries = [ckpt_store.write_tensors(d, name, {"params": {}, "buffers": {}, "optim": {}})
               for name in sorted(set(FILES.values()))]
    entries.append(ckpt_store.write_tensors(d, contents.META, {"iteration": it}))
    ckpt_store.write_manifest(d, entries, {"P": 2, "D": 2, "cuts": [1], "index": FILES}, iteration=it, epoch=4)


def test_survivors_of_every_stage_complete_the_step_they_hold(tmp_path):
    store = str(tmp_path)
    _periodic(store, 6)
    s0r0, s0r1, s1r1 = _worker(0, 0, 0, iteration=9), _worker(2, 0, 1, iteration=9, seed=1), _worker(3, 1, 1, iteration=9)
    assert rescue.save_from_memory(s0r0, store) is None          # stage 1 not saved yet
    assert ckpt_store.latest_complete(store) == 6
    assert rescue.save_from_memory(s0r1, store) is None
    done = rescue.save_from_memory(s1r1, store)
    assert done == reading.checkpoint_dir(store, 9)
    manifest = reading.verify(done)
    assert manifest["meta"]["source"] == rescue.SOURCE and manifest["epoch"] == 5
    assert manifest["meta"]["meta_file"] == "meta-rank3.pt" and manifest["meta"]["index"] == FILES
    assert ckpt_store.latest_complete(store) == 9
    # the second replica of stage 0 found its layer recorded and wrote only its own meta file
    records = ckpt_store.read_writer_records(done, rescue.rescue_token(5))
    assert [e.name for e in records[2]] == ["meta-rank2.pt"]
    assert [e.name for e in records[0]] == ["layer_000.pt", "meta-rank0.pt"]
    # what it holds is the survivors' memory
    saved = reading.read_tensors(done, "layer_001.pt")
    assert torch.equal(saved["params"]["b.weight"], s1r1.named_tensors()["b.weight"])
    assert torch.equal(saved["optim"]["b.weight"]["momentum_buffer"], s1r1.named_tensors()["b.weight"] * 0.5)
    assert torch.equal(saved["buffers"]["b.running"], s1r1.named_tensors()["b.running"])
    # a later survivor of the same step finds it complete and writes nothing
    assert rescue.save_from_memory(_worker(1, 1, 0, iteration=9), store) == done
    assert 1 not in ckpt_store.read_writer_records(done, rescue.rescue_token(5))


def test_the_survivor_that_commits_keeps_the_jobs_number_of_checkpoints(tmp_path):
    """A job cancelled (or ended) right after a rescue writes no later checkpoint that would prune:
    the commit itself leaves --keep-checkpoints complete ones; a step still incomplete prunes nothing."""
    store = str(tmp_path)
    for it in (2, 4, 6):
        _periodic(store, it)
    assert rescue.save_from_memory(_worker(0, 0, 0, iteration=9, keep=2), store) is None
    assert reading.list_checkpoints(store) == [2, 4, 6, 9]
    assert rescue.save_from_memory(_worker(3, 1, 1, iteration=9, keep=2), store) is not None
    assert reading.list_checkpoints(store) == [6, 9]


def test_a_stage_with_no_survivor_leaves_the_step_incomplete(tmp_path):
    store = str(tmp_path)
    _periodic(store, 6)
    for w in (_worker(0, 0, 0, iteration=9), _worker(2, 0, 1, iteration=9)):
        assert rescue.save_from_memory(w, store) is None
    assert ckpt_store.latest_complete(store) == 6
    # said as what it is (the job's status shows the skip): no writer died
    with pytest.raises(CheckpointError, match="saved it from memory, but no survivor held every stage"):
        reading.verify(reading.checkpoint_dir(store, 9))
    # an ordinary checkpoint's writers that died before the manifest
    ordinary = reading.checkpoint_dir(store, 12)
    ckpt_store.write_writer_record(ordinary, "ab" * 16, 0, [])
    with pytest.raises(CheckpointError, match=r"no manifest \(its writer died, or the store refused its writes\)"):
        reading.verify(ordinary)


def test_survivors_holding_different_steps_complete_neither(tmp_path):
    """One stage finished the broken step before the failure, the other did not."""
    store = str(tmp_path)
    _periodic(store, 6)
    assert rescue.save_from_memory(_worker(0, 0, 0, iteration=10), store) is None
    assert rescue.save_from_memory(_worker(1, 1, 0, iteration=9), store) is None
    assert ckpt_store.latest_complete(store) == 6


def test_a_survivor_killed_while_it_saves_never_counts(tmp_path):
    """Its files may be in place, but without its record the step is not complete."""
    store = str(tmp_path)
    _periodic(store, 6)
    assert rescue.save_from_memory(_worker(0, 0, 0, iteration=9), store) is None
    d = reading.checkpoint_dir(store, 9)
    ckpt_store.write_tensors(d, "layer_001.pt", {"params": {}, "buffers": {}, "optim": {}})   # then it died
    assert ckpt_store.latest_complete(store) == 6


def test_a_rescue_after_a_newer_epoch_chose_its_start_is_refused(tmp_path):
    store = str(tmp_path)
    _periodic(store, 6)
    fences.write_epoch_fence(store, 7, 6)   # epoch 7 started from 6 before the survivors of 5 wrote
    with pytest.raises(CheckpointError):
        rescue.save_from_memory(_worker(0, 0, 0, iteration=9), store)
    assert reading.list_checkpoints(store) == [6]


def test_the_next_epoch_loads_a_rescued_step_resharded(tmp_path):
    """A lone worker of the next plan (P = 1) loads both stages' layers and the survivor's meta."""
    store = str(tmp_path)
    s0, s1 = _worker(0, 0, 0, iteration=9), _worker(3, 1, 1, iteration=9)
    s1.scaler = LossScaler("dynamic", 2.0**10, 1.0)
    rescue.save_from_memory(s0, store)
    rescue.save_from_memory(s1, store)
    whole = {n: (nn.Parameter(torch.zeros(4, 3)) if n.endswith("weight") else torch.zeros(3)) for n in FILES}
    opt = torch.optim.SGD([t for t in whole.values() if isinstance(t, nn.Parameter)], lr=0.1, momentum=0.9)
    fresh = SimpleNamespace(rank=0, stage=0, replica=0, plan=ParallelPlan(P=1, D=1), cuts=[], layout=_Layout(),
                            assignment=SimpleNamespace(epoch=8, world_size=1), device=torch.device("cpu"),
                            optimizer=opt, scaler=LossScaler("dynamic", 1.0, 1.0), lr_scheduler=None, iteration=0,
                            named_tensors=lambda: whole)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert contents.load(fresh, store, None) == 9
    finally:
        dist.destroy_process_group()
    assert fresh.iteration == 9 and fresh.scaler.scale == 2.0**10
    for name, t in {**s0.named_tensors(), **s1.named_tensors()}.items():
        assert torch.equal(whole[name], t), name
    assert torch.equal(opt.state[whole["a.weight"]]["momentum_buffer"], s0.named_tensors()["a.weight"] * 0.5)


def test_the_rescue_signal_is_taken_only_under_a_daemon_and_says_whose_handler_it_replaces(caplog):
    import signal

    from trainer.engine.control import RESCUE_SIGNAL, ControlClient

    def scripts_own(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, RESCUE_SIGNAL)}
    try:
        signal.signal(RESCUE_SIGNAL, scripts_own)
        alone = ControlClient(None, job="j", epoch=1, rank=0)   # the launcher's worker: no daemon
        assert signal.getsignal(RESCUE_SIGNAL) is scripts_own
        assert signal.getsignal(signal.SIGTERM) == alone._on_sigterm
        under = ControlClient("tcp://127.0.0.1:9", job="j", epoch=1, rank=3)
        try:
            assert signal.getsignal(RESCUE_SIGNAL) == under._on_rescue
            assert "the script's own handler of it will not run" in caplog.text
            caplog.clear()
            again = ControlClient("tcp://127.0.0.1:9", job="j", epoch=2, rank=3)   # replacing our own: quiet
            again.close()
            assert "will not run" not in caplog.text
        finally:
            under.close()
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_closed_worker_ignores_the_rescue_signal_so_its_own_exit_status_stands():
    # the interpreter's finalisation would put the handler back to the default, which kills
    import signal

    from trainer.engine.control import RESCUE_SIGNAL, ControlClient

    before = signal.getsignal(RESCUE_SIGNAL)
    try:
        client = ControlClient("tcp://127.0.0.1:9", job="j", epoch=1, rank=0)
        assert signal.getsignal(RESCUE_SIGNAL) == client._on_rescue
        client.close()
        assert signal.getsignal(RESCUE_SIGNAL) is signal.SIG_IGN
        mine = lambda signum, frame: None   # noqa: E731 - a handler the script set after: left alone
        signal.signal(RESCUE_SIGNAL, mine)
        other = ControlClient("tcp://127.0.0.1:9", job="j", epoch=2, rank=0)
        signal.signal(RESCUE_SIGNAL, mine)
        other.close()
        assert signal.getsignal(RESCUE_SIGNAL) is mine
    finally:
        signal.signal(RESCUE_SIGNAL, before)


def test_a_rescue_between_steps_saves_at_once_and_one_inside_a_step_waits_for_it():
    """A script that evaluates or loads data between steps for longer than the daemon's abort
    grace was SIGKILLed with its newer state unsaved: the rescue only set a flag for the next
    step() (a probe: the job resumed from an older checkpoint, 3 steps redone, "the survivors
    held no common step newer than it"). The signal, real, now saves between steps at once."""
    import os
    import signal

    from trainer.engine.control import RESCUE_SIGNAL, ControlClient, StepAbandoned

    before = signal.getsignal(RESCUE_SIGNAL)
    client = ControlClient("tcp://127.0.0.1:9", job="j", epoch=1, rank=0)
    saved = []
    try:
        client.idle_rescue = lambda: saved.append("saved")
        client.in_step = True   # inside a step, where nothing is abandonable: the step acts on the flag
        os.kill(os.getpid(), RESCUE_SIGNAL)
        assert client.rescue_requested and saved == []
        client.in_step = False   # between steps
        os.kill(os.getpid(), RESCUE_SIGNAL)
        assert saved == ["saved"] and client.idle_rescue is None   # once
        os.kill(os.getpid(), RESCUE_SIGNAL)
        assert saved == ["saved"]
        client.abandonable = True   # mid-step compute: the step is abandoned, as before
        with pytest.raises(StepAbandoned):
            os.kill(os.getpid(), RESCUE_SIGNAL)
    finally:
        client.close()
        signal.signal(RESCUE_SIGNAL, before)
