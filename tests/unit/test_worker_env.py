"""trainer/worker_env.py: the VARUNA_* environment is derived from WorkerAssignment's fields, both
ways, so a field added to the assignment or to its plan reaches the worker with no edit to the
codec, the launcher or the engine's setup (issue 32)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.errors import ConfigError
from trainer.launch import worker_environment
from trainer.planning.parallel import PER_STAGE, ParallelPlan, per_replica_fields, per_stage_fields
from trainer.worker_env import WorkerAssignment, decode, encode, env_fields, env_name

# Every plan field away from its default; a field added to ParallelPlan must be given a value here
# (test_the_examples_leave_no_field_at_its_default says so).
FULL_PLAN = ParallelPlan(P=2, D=3, micro_batch_size=4, schedule="gpipe", cuts=(5,), recompute=(False, True),
                         ranks=((5, 4, 3), (2, 1, 0)), shares=(40, 36, 20))


def full_assignment(plan: ParallelPlan = FULL_PLAN, cls: type = WorkerAssignment, **more) -> WorkerAssignment:
    return cls(
        rank=4, plan=plan, endpoints=[f"tcp://10.0.0.{i}:70{i}" for i in range(plan.world_size)],
        dist_url="tcp://10.0.0.1:29500", job="gpt", epoch=17, threads=3, trace_dir="/tmp/traces",
        store="/mnt/ckpt", device="1", gpu_collectives="gloo", control="ipc:///tmp/ctl", checkpoint_every=5, keep_checkpoints=7,
        checkpoint_tmpdir="/tmp/stage", resume="latest", batch_size=96, steps=40, profile="/tmp/cal.json",
        profile_slots=2, profile_machine_slots=3, bind_address="10.0.0.4", peer_keys={"*": "abc", "tcp://10.0.0.1:701": "d=f"},
        trace_steps=12, capture_cache="/var/lib/varunad/captures/gpt/0123456789abcdef", **more)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def test_the_examples_leave_no_field_at_its_default():
    a = full_assignment()
    for obj in (a, a.plan):
        at_default = [f.name for f in dataclasses.fields(obj) if f.name != "extra"
                      and getattr(obj, f.name) == _default(f)]
        assert not at_default, f"give {at_default} of {type(obj).__name__} a non-default value in this test"


def test_every_field_round_trips_through_the_environment_exactly():
    a = full_assignment()
    env = a.to_env()
    assert WorkerAssignment.from_env(env) == a
    back = WorkerAssignment.from_env(env)
    for f in dataclasses.fields(a):   # same values and same types (tuples stay tuples)
        assert type(getattr(back, f.name)) is type(getattr(a, f.name)), f.name
    assert back.plan.ranks == ((5, 4, 3), (2, 1, 0)) and back.plan.recompute == (False, True)
    # the lone worker's minimum too: every optional field None, every default as it is
    least = WorkerAssignment(rank=0, plan=ParallelPlan(P=1, D=1), endpoints=["inproc://w"], dist_url="")
    assert WorkerAssignment.from_env(least.to_env()) == least


def test_the_names_people_use_are_the_derived_ones():
    """The names of the README, scripts and tests (and of the module's doc before the names were
    derived): the rule gives every one of them, so none is mapped by hand."""
    documented = {
        "VARUNA_RANK", "VARUNA_WORLD_SIZE", "VARUNA_PLAN", "VARUNA_ENDPOINTS", "VARUNA_DIST_URL", "VARUNA_BIND_ADDRESS",
        "VARUNA_JOB", "VARUNA_EPOCH", "VARUNA_THREADS", "VARUNA_TRACE_DIR", "VARUNA_STORE", "VARUNA_DEVICE",
        "VARUNA_GPU_COLLECTIVES",
        "VARUNA_CONTROL", "VARUNA_CHECKPOINT_EVERY", "VARUNA_KEEP_CHECKPOINTS", "VARUNA_CHECKPOINT_TMPDIR",
        "VARUNA_RESUME", "VARUNA_BATCH_SIZE", "VARUNA_STEPS", "VARUNA_PROFILE", "VARUNA_PROFILE_SLOTS",
        "VARUNA_PROFILE_MACHINE_SLOTS",
        "VARUNA_PEER_KEYS", "VARUNA_TRACE_STEPS", "VARUNA_CAPTURE_CACHE",
    }
    assert set(full_assignment().to_env()) == documented
    assert {env_name(f.name) for f, _ in env_fields(WorkerAssignment)} | {"VARUNA_WORLD_SIZE"} == documented


def test_hand_set_values_read_as_before():
    env = {**full_assignment().to_env(), "VARUNA_STORE": "/data/x", "VARUNA_CHECKPOINT_EVERY": "4",
           "VARUNA_CHECKPOINT_TMPDIR": "", "VARUNA_BIND_ADDRESS": "", "VARUNA_THREADS": "2"}
    a = WorkerAssignment.from_env(env)
    assert (a.store, a.checkpoint_every, a.checkpoint_tmpdir, a.bind_address, a.threads) == ("/data/x", 4, None, None, 2)
    assert full_assignment(extra={"EXTRA_FOR_TEST": "x"}).to_env()["EXTRA_FOR_TEST"] == "x"


@pytest.mark.parametrize("name, text, words", [
    ("VARUNA_ENDPOINTS", '["tcp://a:1", 2, 3, 4, 5, 6]', "VARUNA_ENDPOINTS: expected str, got 2"),
    ("VARUNA_PEER_KEYS", '{"*": 1}', "VARUNA_PEER_KEYS: expected str, got 1"),
    ("VARUNA_PEER_KEYS", '["*"]', "VARUNA_PEER_KEYS: expected dict"),
    ("VARUNA_EPOCH", "seven", "VARUNA_EPOCH: invalid literal"),
    ("VARUNA_PLAN", "{P: 2", "VARUNA_PLAN: a parallel plan is JSON"),
])
def test_a_malformed_variable_is_named(name, text, words):
    with pytest.raises(ConfigError, match=f"malformed worker assignment in the environment: {words}"):
        WorkerAssignment.from_env({**full_assignment().to_env(), name: text})


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_codec_round_trips_each_kind_of_type(data):
    kinds = {
        int: st.integers(), float: st.floats(allow_nan=False), bool: st.booleans(), str: st.text(min_size=1),
        int | None: st.none() | st.integers(), tuple[int, ...]: st.lists(st.integers()).map(tuple),
        tuple[bool, ...] | None: st.none() | st.lists(st.booleans()).map(tuple),
        tuple[tuple[int, ...], ...]: st.lists(st.lists(st.integers()).map(tuple)).map(tuple),
        tuple[str, int]: st.tuples(st.text(), st.integers()), list[float]: st.lists(st.floats(allow_nan=False)),
        dict[str, str]: st.dictionaries(st.text(), st.text()), dict[int, tuple[int, ...]]:
            st.dictionaries(st.integers(), st.lists(st.integers()).map(tuple)),
        dict[str, int | None]: st.dictionaries(st.text(), st.none() | st.integers()),
    }
    kind = data.draw(st.sampled_from(list(kinds)))
    value = data.draw(kinds[kind])
    if value is None:
        return   # None is the variable absent
    back = decode(encode(value, kind), kind)
    assert back == value and type(back) is type(value)
    if kind is float:
        assert math.copysign(1, back) == math.copysign(1, value)


def test_bools_read_as_people_write_them():
    assert [decode(t, bool) for t in ("1", "0", "true", "False")] == [True, False, True, False]
    with pytest.raises(ValueError, match="expected 1 or 0"):
        decode("yes", bool)


# -- a field added to the plan, and one added to the assignment ---------------------------------------

Wider = dataclasses.make_dataclass(
    "Wider", [("interleave", int, dataclasses.field(default=1)),
              ("stage_weights", tuple[float, ...] | None, dataclasses.field(default=None, metadata=PER_STAGE))],
    bases=(ParallelPlan,), frozen=True, slots=True, kw_only=True)

Assigned = dataclasses.make_dataclass(
    "Assigned", [("plan", Wider), ("warm_up", bool, dataclasses.field(default=False)),
                 ("slot_names", tuple[str, ...] | None, dataclasses.field(default=None))],
    bases=(WorkerAssignment,), frozen=True, slots=True, kw_only=True)


def _wider(plan: ParallelPlan = FULL_PLAN, **more):
    return Wider(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}, interleave=3,
                 stage_weights=(0.25, 1.5), **more)


def test_a_new_field_reaches_the_worker_with_no_edit_outside_the_plan_and_its_reader():
    """The fields are a subclass's here; added to ParallelPlan or WorkerAssignment themselves they
    take the same path: the launcher's (and the daemon's) worker_environment, the worker's from_env."""
    a = full_assignment(_wider(), cls=Assigned, warm_up=True, slot_names=("a", "b"))
    env = worker_environment(a, base={})
    assert env["VARUNA_WARM_UP"] == "1" and env["VARUNA_SLOT_NAMES"] == '["a", "b"]'
    back = Assigned.from_env(env)
    assert back == a and back.plan.interleave == 3 and back.plan.stage_weights == (0.25, 1.5)


# -- trainer/engine/setup.py: a stage_to_rank_map keeps the plan's other fields -----------------------

def _assign(monkeypatch, a: WorkerAssignment, stage_to_rank_map):
    from trainer.engine import setup
    monkeypatch.setattr(setup, "WorkerAssignment", type(a))   # reads the new fields' type from the environment
    for name, value in a.to_env().items():
        monkeypatch.setenv(name, value)
    return setup.assignment_for(stage_to_rank_map).plan


@pytest.mark.parametrize("plan", [FULL_PLAN, _wider()], ids=["plan", "a-new-field"])
def test_a_stage_to_rank_map_keeps_every_field_the_shape_does_not_size(monkeypatch, plan):
    a = full_assignment(plan, cls=Assigned if isinstance(plan, Wider) else WorkerAssignment)
    renumbered = _assign(monkeypatch, a, {0: [0, 1, 2], 1: [3, 4, 5]})
    assert type(renumbered) is type(plan) and renumbered.ranks == ((0, 1, 2), (3, 4, 5))
    assert [f.name for f in dataclasses.fields(plan) if getattr(renumbered, f.name) != getattr(plan, f.name)] == ["ranks"]
    reshaped = _assign(monkeypatch, a, {0: [0, 1], 1: [2, 3], 2: [4, 5]})
    assert type(reshaped) is type(plan) and (reshaped.P, reshaped.D) == (3, 2)
    changed = {f.name for f in dataclasses.fields(plan) if getattr(reshaped, f.name) != getattr(plan, f.name)}
    per_stage, per_replica = per_stage_fields(plan), per_replica_fields(plan)
    assert {"cuts", "recompute"} <= set(per_stage) and ("stage_weights" in per_stage) == isinstance(plan, Wider)
    assert per_replica == ("shares",)   # sized by D: three replicas' shares say nothing of two
    assert changed == {"P", "D", "ranks", *per_stage, *per_replica}
    assert all(getattr(reshaped, name) is None for name in (*per_stage, *per_replica))


# -- derived names never take a variable another module owns ------------------------------------------

def test_a_field_named_like_a_variable_another_module_owns_is_refused():
    Clash = dataclasses.make_dataclass("Clash", [("security", str, dataclasses.field(default="x"))],
                                       bases=(WorkerAssignment,), frozen=True, kw_only=True)
    with pytest.raises(TypeError, match="VARUNA_SECURITY"):
        env_fields(Clash)


def test_every_varuna_variable_the_code_spells_is_derived_or_owned_elsewhere():
    """OWNED_ELSEWHERE stays complete: a module that starts reading VARUNA_X without listing it
    fails here, before a field of that name could override it."""
    import re

    from support import REPO

    from trainer.worker_env import OWNED_ELSEWHERE
    root = REPO
    spelled = {m for pkg in ("trainer", "varunad", "protocol") for f in (root / pkg).rglob("*.py")
               for m in re.findall(r"[\"'](VARUNA_[A-Z0-9_]+)[\"']", f.read_text())}
    derived = {env_name(f.name) for f, _ in env_fields(WorkerAssignment)}
    assert spelled - derived - OWNED_ELSEWHERE == set()


def test_a_script_asking_for_a_gpu_on_a_cpu_slot_is_told_where_it_trains(caplog):
    """A probe's script passed device="cuda": under the daemon of a GPU-less ring it trained on the
    CPU with no word, as it would on a fleet whose GPU driver failed."""
    import torch

    from trainer.engine.setup import choose_device

    slot = WorkerAssignment(rank=0, plan=ParallelPlan(P=1, D=1), endpoints=[""], dist_url="", device="cpu")
    with caplog.at_level("WARNING", logger="varuna"):
        assert choose_device(slot, 0, "cuda") == torch.device("cpu")
    assert "asks for device 'cuda', but this worker's slot is the CPU" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="varuna"):
        assert choose_device(slot, 0, torch.device("cuda", 0)) == torch.device("cpu")
    assert "asks for device device(type='cuda', index=0)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="varuna"):
        assert choose_device(slot, 0, -1) == torch.device("cpu")   # no choice of the script's: nothing to say
        assert choose_device(slot, 0, 0) == torch.device("cpu")    # a local rank, as Varuna's scripts pass it
    assert not caplog.text
    free = WorkerAssignment(rank=0, plan=ParallelPlan(P=1, D=1), endpoints=[""], dist_url="")
    assert choose_device(free, -1, torch.device("cpu")) == torch.device("cpu")   # a device object is taken as is
