"""One varunad runs a job to the end, with the synthetic calibration (data-parallel only) or by
profiling the real script first (the default), serves its metrics, follows only its leader's
plans, and leaves the fleet at once on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from support import REPO
from support.metrics import metric_types, sample_value, scrape, scrape_when
from support.reference import reference_run
from support.ring import Ring

from trainer.launch import free_ports
from varunad.control.plans import PlanDoc
from varunad.node.metrics import METRIC_NAMES

pytestmark = pytest.mark.slow


def test_one_daemon_runs_a_job_serves_its_metrics_ignores_a_forged_plan_and_leaves_on_sigterm(
        tmp_path, etcd, etcd_root):
    """One daemon start for: a job with the synthetic calibration, every documented metric while it
    runs, a well-formed plan put by someone other than the leader (ignored: the job keeps its
    epoch), --keep-jobs, status, and a prompt exit on SIGTERM."""
    port = free_ports(1)[0]
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo", "--calibrate", "uniform", "--keep-jobs", "1", "--metrics-port", str(port))
        ring.wait_members(["solo"])
        assert ring.poll(ring.leader, timeout=20, what="a leader") == "solo"
        text = scrape_when(ring, port, lambda t: sample_value(t, "varunad_leader") == 1)
        assert set(METRIC_NAMES) <= metric_types(text), sorted(set(METRIC_NAMES) - metric_types(text))
        assert sample_value(text, "varunad_members") == 1 and sample_value(text, "varunad_workers") == 0

        ring.submit("solo-job", steps=6, every=2)
        epoch = ring.wait_step("solo-job", 1)["epoch"]
        # etcdctl put /varunad/plan '<a valid plan>': no leader wrote it, so neither the daemon nor
        # its leader acts on it (before, it stopped the workers and the job was planned again)
        forged = ring.call(ring.store.put(ring.keys.plan, PlanDoc.idle("forged").encode()))
        st = ring.wait_state("solo-job", ("done", "failed"), timeout=120)
        assert st["state"] == "done", st
        assert st["epoch"] == epoch, st
        assert (st["plan"]["P"], st["plan"]["D"], st["plan"]["calibrated"]) == (1, 1, False)
        reference = reference_run(6, 12)[0]
        assert [s for s, _ in st["loss_history"]] == list(range(6))
        for step, loss in st["loss_history"]:
            assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step])
        assert "no calibration of solo-job" in d.log_text()
        assert "no leader wrote it" in d.log_text()

        text = scrape(port)
        job = '{job="solo-job"}'
        assert sample_value(text, f"varunad_job_step{job}") == 5
        loss = sample_value(text, f"varunad_job_loss{job}")
        assert loss is not None and abs(loss - st["loss_history"][-1][1]) < 1e-6
        assert sample_value(text, f"varunad_samples_per_second{job}") > 0
        assert re.search(r'^varunad_stage_busy_fraction\{job="solo-job",rank="0",stage="0"\} ', text, re.M)
        assert sample_value(text, f"varunad_checkpoint_seconds_count{job}") >= 3  # after steps 2, 4 and 6
        # the plan now is the leader's idle one, written when the job was done, never the forgery
        assert sample_value(text, "varunad_plan_epoch") > forged and sample_value(text, "varunad_morphs_total") == 0
        assert sample_value(text, 'varunad_bad_documents_total{kind="plan"}') >= 1
        assert "serving Prometheus metrics on 127.0.0.1" in d.log_text()

        # --keep-jobs 1: the next job to start here deletes this one's bundle and worker logs
        state = tmp_path / "solo"
        assert sorted(p.name for p in (state / "logs").iterdir()) == ["solo-job"]
        ring.submit("next-job", steps=2, every=2)
        assert ring.wait_state("next-job", ("done", "failed"), timeout=120)["state"] == "done"
        for kind in ("bundles", "logs"):
            assert sorted(p.name for p in (state / kind).iterdir()) == ["next-job"], kind
        r = ring.varunactl("status")
        assert r.returncode == 0 and "leader    solo" in r.stdout and "solo-job: done" in r.stdout, r.stdout
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        left = time.monotonic() - sent
        assert not ring.member_present("solo") and ring.leader() is None, "the lease was not revoked"
        assert left < 10.0, f"leaving took {left:.1f}s with no workers to stop"
    finally:
        ring.close()


def test_the_default_profiles_the_real_script_before_planning(tmp_path, etcd, etcd_root):
    """No calibration in etcd: the daemon runs the job's script once with VARUNA_PROFILE (the
    Varuna object profiles the model and exits), stores the calibration, then plans from it. The
    host has two CPU slots (one thread each), so the profile measures both busy at once, as its
    training workers will run, and the calibration is stored for that kind of slot."""
    ring = Ring(tmp_path, etcd.endpoint, root=etcd_root, ttl=10.0)
    try:
        d = ring.start("solo", "--slots", "2")
        ring.wait_members(["solo"])
        member = json.loads(ring.call(ring.store.get(ring.keys.member("solo"))).value)
        assert member["device_kind"] == "cpu-2slots"
        script = REPO / "examples" / "train_gpt.py"
        r = ring.varunactl("submit", "--name", "prof", "--batch-size", "8", "--steps", "3", "--checkpoint-every",
                           "3", str(script), "--", "--preset", "tiny")
        assert r.returncode == 0, r.stderr
        st = ring.wait_state("prof", ("done", "failed"), timeout=240)
        assert st["state"] == "done", st
        assert st["plan"]["calibrated"] is True
        assert "stored the calibration of prof for cpu-2slots" in d.log_text()
        # The profiler itself names what it measured: one slot of a host with two busy at once.
        written = list((tmp_path / "solo" / "calibration").glob("*.json"))
        assert written and {json.loads(f.read_text())["device_kind"] for f in written} == {"cpu-2slots"}
        assert [s for s, _ in st["loss_history"]] == [0, 1, 2]
    finally:
        ring.close()
