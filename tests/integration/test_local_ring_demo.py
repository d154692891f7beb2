"""The local ring (`varunactl up/down`), live progress, and the README's demo in its --quick size.

Progress rendering is tested on status documents alone; the ring tests start the real etcd binary
and real daemons, and check with psutil that `down` leaves no process of theirs behind.


The tests of tests/unit/test_local_ring.py that need processes or a real etcd (tests/README.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support import REPO, TESTS
from support.png import png_size
from support.waiting import until

from varunad.cluster.facts import machine_id
from varunad.ctl import local
from varunad.node.metrics import METRIC_NAMES


def _metric_types(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


# --- up and down ------------------------------------------------------------------------------------------


def _ring_processes(base: Path) -> list[psutil.Process]:
    """Live processes whose command line or working directory is under ``base``."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "status"]):
        info = p.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        where = " ".join(info["cmdline"] or []) + " " + (info["cwd"] or "")
        if str(base) in where:
            found.append(p)
    return found


def _survivors(ring: local.Ring) -> list[str]:
    out = []
    for rec in (ring.etcd_proc, *ring.daemons):
        if local.alive(rec):
            out.append(f"{rec.name} pid {rec.pid}")
        try:
            group = [p.pid for p in psutil.process_iter() if os.getpgid(p.pid) == rec.pid
                     and p.status() != psutil.STATUS_ZOMBIE]
        except (psutil.Error, ProcessLookupError):
            group = []
        out += [f"{rec.name}'s group: pid {pid}" for pid in group]
    return out


def _varunactl(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varunad.ctl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=60, cwd=REPO)


@pytest.mark.slow
def test_up_finds_down_stops_everything(tmp_path):
    state = tmp_path / "ring"
    base = local.free_port_range(3)
    env = {k: v for k, v in os.environ.items() if k not in ("VARUNAD_ETCD", "VARUNAD_LOCAL_DIR")}
    try:
        # varunactl's options after N are its own; what follows -- goes to every daemon
        up = _varunactl("up", "2", "--dir", str(state), "--ttl", "3", "--metrics-port", str(base),
                        "--", "--calibrate", "uniform", env=env)
        assert up.returncode == 0, up.stderr
        ring = local.read_ring(state)
        # not the default directory: the hint says how other commands find this ring
        assert f"export VARUNAD_LOCAL_DIR={state}" in up.stdout
        recorded = json.loads((state / local.RING_FILE).read_text())
        assert recorded["etcd"] == ring.etcd and [d["name"] for d in recorded["daemons"]] == ["vm1", "vm2"]
        assert [d.metrics_port for d in ring.daemons] == [base, base + 1]
        assert all(Path(d.log).is_file() for d in ring.daemons)
        for d in ring.daemons:
            cmdline = psutil.Process(d.pid).cmdline()
            assert cmdline[-2:] == ["--calibrate", "uniform"] and "--dir" not in cmdline
        # no --etcd and no $VARUNAD_ETCD: varunactl finds the ring from its state directory
        env |= {"VARUNAD_LOCAL_DIR": str(state)}
        nodes = _varunactl("nodes", "--json", env=env)
        assert nodes.returncode == 0, nodes.stderr
        members = json.loads(nodes.stdout)
        assert sorted(m["name"] for m in members) == ["vm1", "vm2"]
        # both daemons report this host's boot id, its cores and their one-thread workers: they
        # know they share its cores (the planner counts them, `nodes` says so)
        assert {m["machine"] for m in members} == {machine_id()} != {""}
        assert all(m["sharing_machine_with"] == 1 and m["threads"] == 1 and m["cores"] >= 1 for m in members)
        table = _varunactl("nodes", env=env)
        assert table.returncode == 0 and table.stdout.count("shares machine") == 2, table.stdout + table.stderr
        # submit and watch a short job, also without --etcd; not a terminal: plain lines
        script = str(TESTS / "daemon_job" / "train_job.py")
        sub = _varunactl("submit", "--name", "t", "--batch-size", "8", "--steps", "4", "--checkpoint-every", "2",
                         script, env=env)
        assert sub.returncode == 0, sub.stderr
        watch = _varunactl("watch", "t", "--interval", "0.3", env=env)
        assert watch.returncode == 0, watch.stdout + watch.stderr
        assert watch.stdout.splitlines()[-1].startswith("t 4/4 done: loss ") and "\r" not in watch.stdout
        report = state / "store" / "t" / "report" / "report.json"
        until(report.exists, "report.json (the leader writes it after done)", timeout=60, interval=0.2)
        again = _varunactl("up", "1", env=env)
        assert again.returncode == 1 and "already up" in again.stderr
        # the demo's helpers: a VM vanishes, another boots
        local.kill_daemon("vm2", state)
        assert not local.alive(ring.daemon("vm2"))
        added = local.add_daemon(state)
        assert added.name == "vm3" and added.metrics_port == (base + 2 if base else None)
        ring = local.read_ring(state)
        stopped = local.down(state, timeout=20)
        assert stopped == ["stopped vm1 (pid %d)" % ring.daemons[0].pid, "stopped vm3 (pid %d)" % added.pid,
                           "stopped etcd (pid %d)" % ring.etcd_proc.pid]
        assert _survivors(ring) == [] and _ring_processes(state) == []
        assert not (state / local.RING_FILE).exists()
        assert local.down(state) == []  # idempotent
        # a second ring in the same directory keeps the first one's report, checkpoints and logs
        second = _varunactl("up", "1", "--dir", str(state), "--", "--calibrate", "uniform", env=env)
        assert second.returncode == 0, second.stderr
        kept = list((state / "earlier").iterdir())
        assert len(kept) == 1 and f"kept the earlier ring's store, logs and report in {kept[0]}" in second.stdout
        assert (kept[0] / "store" / "t" / "report" / "report.json").is_file()
        assert (kept[0] / "store" / "t" / "varuna_ckpt_4" / "manifest.json").is_file()
        assert (kept[0] / "logs" / "vm1.log").is_file() and not (state / "store" / "t").exists()
    finally:
        local.down(state, timeout=5)   # a no-op once the test's own down has run


@pytest.mark.slow
def test_quick_demo_morphs_and_finishes_with_lower_loss(tmp_path):
    state = tmp_path / "demo"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        run = subprocess.run([sys.executable, str(REPO / "examples" / "local_ring.py"), "--quick", "--dir", str(state)],
                             capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    finally:
        leftovers = _ring_processes(state)
        for p in leftovers:  # never leave a ring running, even when the demo failed
            p.kill()
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert leftovers == [] and not (state / local.RING_FILE).exists()
    assert re.search(r"^\*\*\* kill -9 vm\d at step \d+", out, re.M), out
    # the morph line says where the new epoch's state comes from
    assert re.search(r"^morph \d+x\d+ -> \d+x\d+ \(stopped, re-planned in [\d.]+s, resuming from "
                     r"(replicas at step \d+|checkpoint \d+ \(.+\))\): ", out, re.M), out
    assert re.search(r"^resumed at step \d+ in epoch \d+ after training stood still [\d.]+s "
                     r"\(the report counts the same\)$", out, re.M), out
    summary = re.search(r"^demo: gpt done at step 240 in \d+s, (\d+) morph\(s\) .* resuming from .*, (\d+) step\(s\) "
                        r"trained twice, loss ([\d.]+) -> ([\d.]+)$", out, re.M)
    assert summary, out
    morphs, first, last = int(summary[1]), float(summary[3]), float(summary[4])
    if "resuming from replicas" in out:   # nothing is trained twice when the survivors held every stage
        assert int(summary[2]) == 0, out
    assert morphs >= 1 and last < first
    assert "stopped etcd" in out
    # the VM that calibrated the model kept its export for the job's workers: its first worker loaded
    # it (one that exported again would have written it anew, after the calibration)
    calibrated = list(state.glob("vm*/calibration/calibration-*.json"))
    assert len(calibrated) == 1, calibrated
    kept = list((calibrated[0].parent.parent / "captures").glob("*/*/capture-*.pt2"))
    assert len(kept) == 1 and kept[0].stat().st_mtime <= calibrated[0].stat().st_mtime, kept

    report = state / "report"
    assert png_size(report / "loss.png") == (900, 450) and png_size(report / "throughput.png") == (900, 550)
    for name in ("timeline.png", "timeline_predicted.png"):
        width, height = png_size(report / name)
        assert width == 1200 and height > 200, name
    doc = json.loads((report / "report.json").read_text())
    P, D = doc["plan"]["P"], doc["plan"]["D"]
    spans = [e for e in json.loads((report / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(s, r) for s in range(P) for r in range(D)}
    cost = json.loads((report / "cost.json").read_text())
    assert cost["device_hours"] > 0
    # The stall runs from the last step before the kill to the first after: beyond the leader's
    # stop and re-plan, it holds the lease wait and the new workers' start-up (seconds, at least).
    replanned = sum(float(x) for x in re.findall(r"^morph .*re-planned in ([\d.]+)s[,)]", out, re.M))
    assert cost["morphs"]["downtime_s"] >= replanned + 1.0, (cost["morphs"], replanned)
    served = [(state / "metrics" / f"{name}.txt").read_text() for name in ("vm1", "vm2", "vm3")
              if (state / "metrics" / f"{name}.txt").exists()]
    assert len(served) == 2, out  # the survivors; the killed daemon serves nothing
    for text in served:
        assert set(METRIC_NAMES) <= _metric_types(text), sorted(set(METRIC_NAMES) - _metric_types(text))
    assert sum(float(line.split()[-1]) for text in served for line in text.splitlines()
               if line.startswith("varunad_leader ")) == 1


@pytest.mark.slow
def test_the_demo_stops_its_ring_when_it_is_terminated(tmp_path):
    """SIGTERM (a `timeout`, a kill) ended the demo without its `finally`, and the ring trained on
    behind it (a probe found etcd, three daemons and a worker left): it now stops the ring as
    Ctrl-C does, and exits 143."""
    import signal

    state = tmp_path / "demo"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "local_ring.py"), "--quick", "--dir", str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("etcd on "):   # the ring is up and the job about to be submitted
                break
        assert any(line.startswith("etcd on ") for line in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
        assert "stopping the ring ..." in rest and "stopped etcd" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
        leftovers = _ring_processes(state)
        for p in leftovers:
            p.kill()
    assert leftovers == [] and not (state / local.RING_FILE).exists(), leftovers
