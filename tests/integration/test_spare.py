"""trainer.spare: a process started ahead with torch imported runs a worker script as `python
script args` would: its arguments, directory, environment, output and exit status. Real processes.
The daemon's use of it (a morph's workers started in spares) runs in every daemon ring test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from support.waiting import until

from trainer import spare

SCRIPT = """
import json, os, sys
ahead = "torch._dynamo" in sys.modules
import torch
print(json.dumps({"ahead": ahead, "nice": os.getpriority(os.PRIO_PROCESS, 0), "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "job": os.environ.get("JOB_VAR"), "spare_only": os.environ.get("SPARE_ONLY"),
                  "stdin": sys.stdin.read(), "threads": os.environ.get("OMP_NUM_THREADS")}), flush=True)
if sys.argv[1] == "fail":
    raise RuntimeError("the script failed")
sys.exit(int(sys.argv[1]))
"""


def _spare(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARE_ONLY": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer.spare", *args], stdin=subprocess.PIPE, cwd=tmp_path,
                            env=env,
                            stdout=open(tmp_path / "spare.log", "wb"), stderr=subprocess.STDOUT)


def _order(tmp_path: Path, *args: str) -> tuple[dict, Path]:
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    (job / "train.py").write_text(SCRIPT)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "JOB_VAR": "from the job",
           "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    return {"script": str(job / "train.py"), "args": list(args), "cwd": str(job), "env": env, "log": str(log)}, log


def test_a_spare_runs_the_script_as_python_would(tmp_path):
    proc = _spare(tmp_path)
    order, log = _order(tmp_path, "3", "--flag")
    proc.communicate((json.dumps(order) + "\n").encode(), timeout=120)
    assert proc.returncode == 3
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["argv"] == ["3", "--flag"] and seen["name"] == "__main__"
    assert seen["cwd"] == order["cwd"] and seen["path0"] == order["cwd"]
    # the job's environment, and nothing left of the spare's
    assert seen["job"] == "from the job" and seen["spare_only"] is None and seen["threads"] == "1"
    assert seen["stdin"] == ""   # as a worker started afresh: /dev/null
    assert seen["ahead"]   # what torch.export's first call loads was imported before the order came
    # it imported at a lower priority and runs the worker at the one it started with
    assert seen["nice"] == os.getpriority(os.PRIO_PROCESS, 0), seen


def test_a_spare_imports_at_a_lower_priority(tmp_path):
    proc = _spare(tmp_path)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        seen = until(lambda: os.getpriority(os.PRIO_PROCESS, proc.pid) != mine
                     and os.getpriority(os.PRIO_PROCESS, proc.pid), "the spare's lower priority", timeout=30)
        assert seen == min(19, mine + spare.IMPORT_NICE)
    finally:
        proc.communicate(b"", timeout=120)
    assert proc.returncode == 0


def test_an_uncaught_exception_is_printed_and_exits_1(tmp_path):
    proc = _spare(tmp_path)
    order, log = _order(tmp_path, "fail")
    proc.communicate((json.dumps(order) + "\n").encode(), timeout=120)
    assert proc.returncode == 1
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: the script failed" in text


def test_a_spare_never_needed_exits_0(tmp_path):
    proc = _spare(tmp_path)
    proc.communicate(b"", timeout=120)
    assert proc.returncode == 0




def test_a_spare_says_when_its_imports_are_done(tmp_path):
    """The file `--ready` names appears once the imports are done, before any order: a daemon
    that just joined waits for it before the leader takes it into a running job."""
    ready = tmp_path / "slot0.ready"
    proc = _spare(tmp_path, "--ready", str(ready))
    try:
        until(ready.exists, "the spare's ready file", timeout=120)
        assert ready.read_text().strip() == str(proc.pid)
        assert proc.poll() is None   # still waiting for its order
        order, log = _order(tmp_path, "0")
        proc.communicate((json.dumps(order) + "\n").encode(), timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert json.loads(log.read_text().splitlines()[-1])["ahead"]


HF_SCRIPT = """
import json, sys
ahead = {m: m in sys.modules for m in ("transformers", "transformers.models.gpt2.modeling_gpt2", "wave", "mailbox")}
from transformers import GPT2LMHeadModel
import wave, mailbox
print(json.dumps({"ahead": ahead, "mailbox": mailbox.__file__}), flush=True)
"""


def test_a_spare_given_the_jobs_script_imports_its_packages_but_never_its_own_files(tmp_path):
    """`--imports-of`: the installed packages the script imports, and the names it takes from them
    (a lazy Hugging Face model class), are loaded before the order comes; a module of the script's
    own directory that shares an installed package's name stays the script's."""
    pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e .[test]")
    job = tmp_path / "hf"
    job.mkdir()
    (job / "train.py").write_text(HF_SCRIPT)
    (job / "mailbox.py").write_text("")   # the job's own mailbox.py, not the standard library's
    ready = tmp_path / "slot0.ready"
    proc = _spare(tmp_path, "--ready", str(ready), "--imports-of", str(job / "train.py"))
    try:
        until(ready.exists, "the spare's ready file", timeout=120)
        order, log = _order(tmp_path)
        order.update(script=str(job / "train.py"), cwd=str(job), args=[])
        proc.communicate((json.dumps(order) + "\n").encode(), timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-2000:]
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["ahead"] == {"transformers": True, "transformers.models.gpt2.modeling_gpt2": True, "wave": True,
                             "mailbox": False}
    assert seen["mailbox"] == str(job / "mailbox.py")


def test_a_script_beside_a_module_the_spare_imported_gets_its_own(tmp_path):
    """A `numpy.py` next to the script: the spare imported numpy ahead, so it execs a fresh
    interpreter for the script, in its own process, where `import numpy` finds the script's file."""
    job = tmp_path / "own"
    job.mkdir()
    (job / "numpy.py").write_text("MINE = True\n")
    (job / "train.py").write_text("import json, os, sys\nimport numpy\n"
                                  "print(json.dumps({'numpy': numpy.__file__, 'pid': os.getpid(), 'argv': sys.argv[1:]}))\n"
                                  "sys.exit(4)\n")
    proc = _spare(tmp_path)
    order, log = _order(tmp_path)
    order.update(script=str(job / "train.py"), cwd=str(job), args=["x"])
    proc.communicate((json.dumps(order) + "\n").encode(), timeout=120)
    assert proc.returncode == 4, log.read_text()[-2000:]
    text = log.read_text()
    seen = json.loads(text.splitlines()[-1])
    assert seen == {"numpy": str(job / "numpy.py"), "pid": proc.pid, "argv": ["x"]}, seen
    assert "holds numpy" in text and "fresh interpreter" in text
