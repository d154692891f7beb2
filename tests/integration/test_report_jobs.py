"""The job report: its data (loss, cost arithmetic, price table, simulated and measured timelines),
its matplotlib pictures, the message when matplotlib is missing, and one real daemon job whose
`varunactl report` is checked file by file.

The tests of tests/unit/test_report.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from support import REPO
from support.png import png_size
from support.reports import morphed_report
from support.ring import Ring

from varunad.control.jobs import JobSpec, JobState
from varunad.control.records import encode_history
from varunad.ctl.cli import main as varunactl
from varunad.report import (
    DATA_FILES,
    PICTURES,
)
from varunad.report.pictures import EXTRA
from varunad.store.etcd import EtcdStore
from varunad.store.keys import Keys

# --- a run with a lost VM: its data and its pictures --------------------------------------------------------

@pytest.fixture(scope="module")
def morphed(tmp_path_factory):
    """The report of a 60-step job that ran 2x2 on steps 0-27, lost vm4 (lease, re-plan), and
    resumed as 2x1 from the checkpoint at step 20, traced in the new epoch (support.reports)."""
    return morphed_report(tmp_path_factory.mktemp("morphed"))


_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None   # as if it were not installed: importing it raises ModuleNotFoundError
import varunad.node.leader, varunad.report   # the daemon's side: records the data, draws nothing
from varunad.ctl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_matplotlib_varunactl_report_says_in_one_line_which_extra_to_install(morphed, tmp_path):
    report, _ = morphed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for args in (["--from", str(report), "--out", str(tmp_path)], ["--traces", str(report / "trace.json")]):
        r = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, "report", *args], capture_output=True,
                           text=True, timeout=60, env=env, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert r.stderr == f"varunactl report: the pictures need matplotlib, which is not installed: {EXTRA}\n"
        assert EXTRA == "pip install 'varunad[report]'"
    assert list(tmp_path.iterdir()) == []


async def test_varunactl_report_of_a_job_writes_the_data_then_draws_or_names_the_extra(etcd, etcd_root, tmp_path):
    """What the leader and daemons leave in etcd for a finished job; `varunactl report` against it,
    once with matplotlib and once as if it were not installed."""
    keys = Keys(etcd_root)
    spec = JobSpec(job="j", script="t.py", batch_size=8, steps=6, checkpoint_every=3, bundle_digest="0" * 64,
                   bundle_bytes=1, store=str(tmp_path / "store"))
    async with EtcdStore(etcd.endpoint) as store:
        await store.put(keys.job("j"), spec.encode())
        await store.put(keys.history_entry("j", 4, "vm1", 0), encode_history([(s, 2.0 - s / 10) for s in range(6)],
                                                                           span=(103.0, 118.0)))
        await store.put(keys.state("j"), JobState(job="j", state="done", reason="trained", epoch=4, epochs=(4,),
                                                  started_at=100.0, finished_at=120.0,
                                                  plan={"P": 1, "D": 1, "micro_batch_size": 8}).encode())
    base = ["--etcd", etcd.endpoint, "--root", etcd_root, "report", "j"]
    with_pictures = await asyncio.to_thread(varunactl, [*base, "--out", str(tmp_path / "a")])
    assert with_pictures == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
        ["loss.json", "cost.json", "report.json", "report.txt", "loss.png", "throughput.png"])
    assert png_size(tmp_path / "a" / "throughput.png") == (900, 550)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", _WITHOUT_MATPLOTLIB, *base, "--out", "b"],
                                capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr == (f"varunactl report: the pictures need matplotlib, which is not installed: {EXTRA} "
                        "(the report's data is in b/)\n")
    assert r.stdout.startswith("job      j: done (trained)\nrun      6 steps x batch 8 as 1x1\n"), r.stdout
    assert "plans    1x1: steps 0-5, 2.67 samples/s\n" in r.stdout   # 5 steps of 8 samples in 15 s
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["cost.json", "loss.json", "report.json",
                                                                  "report.txt"]


# --- a real job ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_daemon_job_ends_with_a_report_and_varunactl_report_redraws_it(tmp_path, etcd, etcd_root):
    """Two daemons, one slot each and 1 GiB, with the test script's calibration (five 300 MB
    segments): the job runs as a 2-stage pipeline, the workers trace their first steps into the
    job's store, and the leader writes the report there when the job is done."""
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0,
                extra=["--calibrate", "profile", "--memory", str(2**30), "--progress-interval", "0.5",
                       "--debounce", "0.2"])
    try:
        for name in ("r1", "r2"):
            ring.start(name)
        ring.wait_members(["r1", "r2"])
        ring.submit("rep", steps=5, every=5)
        st = ring.wait_state("rep", ("done", "failed"), timeout=150)
        assert st["state"] == "done", st
        P, D = st["plan"]["P"], st["plan"]["D"]
        assert P * D == 2 and P == 2, st["plan"]

        leader_report = ring.store_dir / "rep" / "report"
        ring.poll(lambda: (leader_report / "report.txt").exists(), timeout=30, what="the leader's report")
        out = tmp_path / "out"
        r = ring.varunactl("report", "rep", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "job      rep: done" in r.stdout and f"written to {out}/" in r.stdout, r.stdout

        for name in DATA_FILES:
            assert (out / name).is_file(), (name, r.stdout)
            assert (leader_report / name).is_file(), name
        assert not list(leader_report.glob("*.png"))   # the leader records data; varunactl draws
        assert png_size(out / "loss.png") == (900, 450) and png_size(out / "throughput.png") == (900, 550)
        for name in ("timeline.png", "timeline_predicted.png"):
            width, height = png_size(out / name)
            assert width == 1200 and height > 200, name
        report = json.loads((out / "report.json").read_text())
        # five steps can end before the leader has measured any slot twice: no speeds, no speed.png
        speeds = report["speeds"]["paces"] or report["speeds"]["stragglers"]
        assert f"pictures {', '.join(p for p in PICTURES if speeds or p != 'speed.png')}" in r.stdout, r.stdout
        assert report["measured"]["workers"] == 2 and report["measured"]["warm"], report["measured"]
        for name in ("trace.json", "trace_predicted.json"):
            doc = json.loads((out / name).read_text())
            spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
            assert {(e["pid"], e["tid"]) for e in spans} == {(s, 0) for s in range(P)}, name
            assert {"forward", "backward"} <= {e["cat"] for e in spans}, name
        step = report["measured"]["step"]
        assert all(e["args"]["step"] == step for e in json.loads((out / "trace.json").read_text())["traceEvents"]
                   if e["ph"] == "X")
        cost = json.loads((out / "cost.json").read_text())
        assert cost["device_hours"] > 0 and cost["spot_usd"] > 0 and cost["by_kind"][0]["kind"] == "cpu"
        assert cost["samples"] == 5 * 12 and cost["intervals"][0]["devices"] == 2
        assert report["predicted"]["step_s"] > 0 and "error" in report["predicted"]
        assert any(f"all 2 daemons that ran epoch {report['measured']['epoch']} shared one machine" in n
                   for n in report["notes"]), report["notes"]
        r = ring.varunactl("report", "nope", "--out", str(tmp_path / "nope"))
        assert r.returncode == 1 and r.stderr.strip() == "varunactl report: no job named nope (see `varunactl jobs`)"
    finally:
        ring.close()
