"""The local launcher, with real worker processes.

The tests of tests/unit/test_launch.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

import trainer.launch as launch_mod
from trainer.launch import launch
from trainer.worker_env import available_cores

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


def test_every_worker_sees_its_own_assignment(tmp_path):
    script = _script(tmp_path, "show.py", _PRINT_ASSIGNMENT)
    result = launch(script, ["--flag", "7"], stages=2, replicas=2, schedule="1f1b",
                    env={"EXTRA_FOR_TEST": "yes"}, timeout=120)
    assert result.returncode == 0, result.errors
    seen = [json.loads(out) for out in result.outputs]
    threads = str(max(1, available_cores() // 4))
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


