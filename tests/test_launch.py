"""The local launcher, with real worker processes."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

import trainer.launch as launch_mod
from trainer.errors import ConfigError
from trainer.launch import launch, plan_assignments
from trainer.worker_env import WorkerAssignment

_ROOT = Path(launch_mod.__file__).resolve().parent.parent

# Worker scripts read the environment directly (not through trainer.worker_env) so that they start
# in a fraction of a second: these tests are about processes, not about the engine.
_PRINT_ASSIGNMENT = """
    import json, os, sys
    print(json.dumps({
        "rank": int(os.environ["VARUNA_RANK"]),
        "plan": json.loads(os.environ["VARUNA_PLAN"]),
        "endpoints": json.loads(os.environ["VARUNA_ENDPOINTS"]),
        "dist_url": os.environ["VARUNA_DIST_URL"],
        "threads": os.environ["VARUNA_THREADS"],
        "omp": os.environ["OMP_NUM_THREADS"],
        "extra": os.environ.get("EXTRA_FOR_TEST"),
        "argv": sys.argv[1:],
    }))
    print("a line on stderr", file=sys.stderr)
"""

_RANK1_FAILS = """
    import os, pathlib, sys, time
    rank = int(os.environ["VARUNA_RANK"])
    pathlib.Path(sys.argv[1], f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        # Fail only once every worker is up, so that the others really have to be stopped.
        world = int(os.environ["VARUNA_WORLD_SIZE"])
        while len(list(pathlib.Path(sys.argv[1]).glob("pid*"))) < world:
            time.sleep(0.01)
        print("rank 1 about to fail", flush=True)
        raise RuntimeError("boom from rank 1")
    time.sleep(120)
"""

_WAIT_FOR_SIGNAL = """
    import os, signal, sys, time
    if os.environ["VARUNA_RANK"] == "0":
        # A worker that ignores polite requests: the launcher has to escalate to SIGKILL.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
"""


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer.launch", *args]


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


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


def test_the_launcher_refuses_a_directory_in_one_line(tmp_path, capsys):
    from trainer.launch import main

    with pytest.raises(SystemExit) as stop:
        main(["-P", "1", str(tmp_path)])
    assert stop.value.code == 2 and "is a directory, not a script" in capsys.readouterr().err


def test_every_worker_sees_its_own_assignment(tmp_path):
    script = _script(tmp_path, "show.py", _PRINT_ASSIGNMENT)
    result = launch(script, ["--flag", "7"], stages=2, replicas=2, schedule="1f1b",
                    env={"EXTRA_FOR_TEST": "yes"}, timeout=120)
    assert result.returncode == 0, result.errors
    seen = [json.loads(out) for out in result.outputs]
    threads = str(max(1, launch_mod._available_cores() // 4))
    for rank, info in enumerate(seen):
        assert info["rank"] == rank
        stage, replica = rank % 2, rank // 2
        assert info["plan"]["ranks"][stage][replica] == rank
        assert info["threads"] == info["omp"] == threads
        assert info["plan"]["schedule"] == "1f1b" and info["extra"] == "yes"
        assert info["argv"] == ["--flag", "7"]
        assert info["endpoints"] == seen[0]["endpoints"] and info["dist_url"] == seen[0]["dist_url"]
    assert len(set(seen[0]["endpoints"])) == 4
    assert all(err == "a line on stderr\n" for err in result.errors)


def test_cli_prefixes_each_line_with_stage_and_replica(tmp_path):
    script = _script(tmp_path, "show.py", _PRINT_ASSIGNMENT)
    proc = subprocess.run(_cli("--stages", "2", "--replicas", "1", str(script), "x"), env=_cli_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    by_prefix = {line[:6]: json.loads(line[7:]) for line in proc.stdout.splitlines()}
    assert set(by_prefix) == {"[s0r0]", "[s1r0]"}
    assert by_prefix["[s1r0]"]["rank"] == 1 and by_prefix["[s1r0]"]["argv"] == ["x"]
    assert "[s0r0] a line on stderr" in proc.stderr


def test_a_failing_worker_stops_the_others(tmp_path):
    script = _script(tmp_path, "fail.py", _RANK1_FAILS)
    result = launch(script, [str(tmp_path)], stages=2, replicas=2, timeout=120, grace=2)
    assert result.returncode not in (0, 124)  # 124 would mean the others had to be timed out
    assert result.failed_rank == 1
    assert "rank 1 (stage 1, replica 0)" in result.reason
    assert "boom from rank 1" in result.errors[1]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert not any(psutil.pid_exists(p) for p in pids)


def test_cli_failure_exits_non_zero_with_the_rank_and_its_stderr(tmp_path):
    script = _script(tmp_path, "fail.py", _RANK1_FAILS)
    proc = subprocess.run(_cli("-P", "2", "-D", "1", "--grace", "2", str(script), str(tmp_path)),
                          env=_cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.index("[launch]"):]
    assert "rank 1 (stage 1, replica 0) exited with code 1" in report
    assert "RuntimeError: boom from rank 1" in report


def test_sigint_to_the_launcher_stops_every_worker(tmp_path):
    script = _script(tmp_path, "wait.py", _WAIT_FOR_SIGNAL)
    launcher = subprocess.Popen(_cli("-P", "2", "-D", "1", "--grace", "1", str(script)), env=_cli_env(),
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready = _read_lines_until(launcher, count=2, marker=b"ready", limit_s=120)
        assert ready == 2
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len(workers) >= 2
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 128 + signal.SIGINT
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()


def test_timeout_stops_the_job(tmp_path):
    script = _script(tmp_path, "wait.py", _WAIT_FOR_SIGNAL)
    result = launch(script, stages=1, replicas=2, timeout=1, grace=1)
    assert result.returncode == 124
    assert "timed out" in result.reason
    assert result.outputs == ["ready\n", "ready\n"]


def test_missing_script_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such script"):
        launch(tmp_path / "nope.py", stages=1, replicas=1)


def _read_lines_until(proc: subprocess.Popen, *, count: int, marker: bytes, limit_s: float) -> int:
    """Read proc's stdout until `count` lines contain `marker`; gives up after limit_s."""
    # Raw os.read on the descriptor: a buffered readline could swallow the second line into
    # Python's buffer, where select() no longer sees it.
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + limit_s
    data = b""
    while data.count(marker) < count and time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    return data.count(marker)


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
    ports = launch_mod.free_ports(6)
    assert len(set(ports)) == 6
    low = launch_mod._ephemeral_low()
    assert all(launch_mod._LOWEST_PORT <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


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
