"""The local launcher, with real worker processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import trainer.launch as launch_mod
from trainer.errors import ConfigError
from trainer.launch import _parser, launch, plan_assignments
from trainer.worker_env import WorkerAssignment

# Worker scripts read the environment directly (not through trainer.worker_env) so that they start
# in a fraction of a second: these tests are about processes, not about the engine.


def test_plan_numbers_ranks_replica_major_with_distinct_endpoints():
    plan = plan_assignments(3, 2, schedule="gpipe", threads=1)
    assert [a.rank for a in plan] == list(range(6))
    assert plan[0].plan.stage_to_rank == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert all(a.plan == plan[0].plan for a in plan) and plan[0].plan.schedule == "gpipe"
    assert [a.position() for a in plan] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    endpoints = plan[0].endpoints
    assert len(set(endpoints)) == 6 and all(e.startswith("tcp://127.0.0.1:") for e in endpoints)
    assert plan[0].dist_url not in endpoints
    assert all(a.endpoints == endpoints and a.dist_url == plan[0].dist_url for a in plan)
    with pytest.raises(ConfigError, match="schedule"):
        plan_assignments(2, 1, schedule="zigzag")
    with pytest.raises(ConfigError, match="at least one stage"):
        plan_assignments(0, 2)
    # flags that every worker would refuse are refused once, in the flags' words
    with pytest.raises(ConfigError, match=r"--cuts names 2 cut point\(s\); 2 stages need 1"):
        plan_assignments(2, 1, cuts=[1, 2])
    with pytest.raises(ConfigError, match="distinct cut-point indices"):
        plan_assignments(3, 1, cuts=[1, 1])
    with pytest.raises(ConfigError, match="need --store DIR"):
        plan_assignments(2, 1, checkpoint_every=5)
    with pytest.raises(ConfigError, match="need --store DIR"):
        plan_assignments(2, 1, checkpoint_tmpdir="/tmp/x")
    assert plan_assignments(3, 1, cuts=[1, 2], store="/tmp/s", checkpoint_every=5)[0].plan.cuts == (1, 2)
    # one GPU per worker, or a refusal that says how many there are
    if torch.cuda.device_count() >= 2:
        assert [a.device for a in plan_assignments(2, 1, device="cuda")] == ["0", "1"]
    else:
        with pytest.raises(ConfigError, match=f"each of the 2 workers on a GPU of its own; this host shows "
                                              f"{torch.cuda.device_count()}"):
            plan_assignments(2, 1, device="cuda")
    assert [a.device for a in plan_assignments(2, 1, device="cpu")] == ["cpu", "cpu"]


def test_the_launcher_passes_shares_into_the_plan_and_refuses_them_in_the_flags_words():
    assert {a.plan.shares for a in plan_assignments(1, 3, shares=[6, 4, 2])} == {(6, 4, 2)}
    assert plan_assignments(2, 2)[0].plan.shares is None
    with pytest.raises(ConfigError, match="--shares names 2 share"):
        plan_assignments(1, 3, shares=[6, 6])
    with pytest.raises(ConfigError, match=r"examples >= 1.*--shares"):
        plan_assignments(1, 2, shares=[12, 0])
    assert _parser().parse_args(["-P", "1", "-D", "3", "--shares", "10,10,4", "s.py"]).shares == [10, 10, 4]
    with pytest.raises(SystemExit):
        _parser().parse_args(["-P", "1", "-D", "2", "--shares", "10,x", "s.py"])


def test_the_launcher_refuses_a_directory_in_one_line(tmp_path, capsys):
    from trainer.launch import main

    with pytest.raises(SystemExit) as stop:
        main(["-P", "1", str(tmp_path)])
    assert stop.value.code == 2 and "is a directory, not a script" in capsys.readouterr().err


def test_missing_script_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such script"):
        launch(tmp_path / "nope.py", stages=1, replicas=1)


def test_the_plan_round_trips_through_the_environment_whole():
    a = plan_assignments(2, 1)[1]
    flagged = replace(a, plan=a.plan.replace(recompute=(False, True), cuts=(3,), micro_batch_size=4))
    env = flagged.to_env()
    assert json.loads(env["VARUNA_PLAN"])["recompute"] == [False, True]
    back = WorkerAssignment.from_env(env)
    assert back == flagged and back.plan.recompute == (False, True) and back.position() == (1, 0)
    assert WorkerAssignment.from_env(a.to_env()).plan.recompute is None
    with pytest.raises(ValueError, match=r"one true/false per stage \(2\)"):
        a.plan.replace(recompute=(True, True, False))
    with pytest.raises(ConfigError, match="malformed worker assignment.*one true/false per stage"):
        WorkerAssignment.from_env({**env, "VARUNA_PLAN": env["VARUNA_PLAN"].replace("[false, true]", "[1, 0]")})
    with pytest.raises(ConfigError, match="malformed worker assignment.*JSON"):
        WorkerAssignment.from_env({**env, "VARUNA_PLAN": "{P: 2"})
    with pytest.raises(ConfigError, match="4 endpoints for 2 ranks"):
        replace(a, endpoints=a.endpoints * 2)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    # Outgoing connections take ports from the ephemeral range; a worker's endpoint there can be
    # taken before the worker binds it ("Address already in use").
    import socket

    from trainer.net.ports import LOWEST_PORT, ephemeral_low
    ports = launch_mod.free_ports(6)
    assert len(set(ports)) == 6
    low = ephemeral_low()
    assert all(LOWEST_PORT <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_daemons_reserved_ports_are_held_and_below_the_ephemeral_range():
    # a new epoch's worker on its daemon's reserved port failed with "Address already in use":
    # the port, drawn by bind(0), had become an outgoing connection's source port meanwhile
    import socket

    from trainer.net.ports import LOWEST_PORT, ephemeral_low
    from varunad.cluster.facts import PortReservation
    held = PortReservation("127.0.0.1", count=5)
    try:
        assert len(set(held.ports)) == 5
        assert all(LOWEST_PORT <= p < ephemeral_low() for p in held.ports), held.ports
        for p in held.ports:   # held: nobody else binds them until released
            with socket.socket() as s, pytest.raises(OSError):
                s.bind(("127.0.0.1", p))
        held.release(held.ports[0])
        with socket.socket() as s:
            s.bind(("127.0.0.1", held.ports[0]))
    finally:
        held.close()


def test_two_daemons_on_one_host_never_reserve_the_same_port(monkeypatch):
    """Sockets that both set SO_REUSEADDR bind one port while neither listens: drawn that way, a
    daemon's reservation came back a port short (the same port drawn twice), and another
    daemon on the host could hold the same ports. Here every draw tries the same few ports."""
    import random

    from trainer.net import ports as ports_mod
    from varunad.cluster.facts import PortReservation

    base = ports_mod.LOWEST_PORT + random.randrange(0, 5000)

    class _FewPorts:   # draws from 6 ports only, each many times
        def __init__(self):
            self.n = 0

        def randrange(self, low, high):
            self.n += 1
            return base + self.n % 6

    monkeypatch.setattr(ports_mod.random, "Random", _FewPorts)
    first = PortReservation("127.0.0.1", count=4)
    second = PortReservation("127.0.0.1", count=4)   # 2 of the 6 left, then the kernel's choice
    try:
        assert len(first.ports) == len(set(first.ports)) == 4
        assert len(second.ports) == len(set(second.ports)) == 4
        assert not set(first.ports) & set(second.ports), (first.ports, second.ports)
    finally:
        first.close()
        second.close()


def test_job_settings_read_the_plan_for_what_the_plan_decides(monkeypatch):
    from trainer.worker_env import job_setting
    a = plan_assignments(2, 2)[0]
    monkeypatch.delenv("VARUNA_PLAN", raising=False)
    assert job_setting("micro_batch", 8) == 8
    monkeypatch.setenv("VARUNA_PLAN", a.plan.to_json())   # the launcher's plan: micro-batch left to the script
    assert job_setting("micro_batch", 8) == 8
    monkeypatch.setenv("VARUNA_PLAN", a.plan.replace(micro_batch_size=3).to_json())
    assert job_setting("micro_batch", 8) == 3
    monkeypatch.setenv("VARUNA_STEPS", "17")
    assert job_setting("steps", 5) == 17


def test_a_variable_the_plan_replaced_is_named_not_silently_ignored(caplog):
    env = {**plan_assignments(2, 1)[0].to_env(), "VARUNA_MICRO_BATCH": "4", "VARUNA_CUTS": "[3]"}
    a = WorkerAssignment.from_env(env)
    assert a.plan.micro_batch_size is None and a.plan.cuts is None
    assert "VARUNA_CUTS, VARUNA_MICRO_BATCH are no longer read" in caplog.text
