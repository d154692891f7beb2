"""varunad's pieces without processes: config and its timing rules, job specs and bundles, plan
documents, and the leader's decisions from snapshot data (Patroni's layer of unit tests)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import zipfile

import pytest
from support.decisions import d, member, reports_for, run_plan, running, snapshot, spec

from varunad.cluster.facts import DaemonMember, detect_device_kind, detect_memory, gpu_count, gpu_models
from varunad.control.decide import LeaderMemory, epoch_failure, error_summary
from varunad.control.fleet import JobEntry
from varunad.control.jobs import (
    BundleError,
    JobSpec,
    JobSpecError,
    JobState,
    bundle_digest,
    pack_bundle,
    script_fingerprint,
    unpack_bundle,
)
from varunad.control.plans import PlanDoc, make_plan, uniform_calibration
from varunad.control.records import (
    WorkerRecord,
    WorkerReport,
    decode_history,
    encode_history,
    epoch_ranges,
    merge_history,
    merge_spans,
    progress_interval,
    steps_trained_twice,
)
from varunad.node.config import DaemonConfigError, load_config, parse_env_file
from varunad.node.housekeeping import LOGS, job_dir, prune_jobs

BASE = ["--etcd", "127.0.0.1:2379", "--store", "/tmp/store", "--plaintext"]


# --- config ---------------------------------------------------------------------------------------

def test_config_defaults_follow_the_ttl():
    c = load_config(BASE, environ={})
    assert c.ttl == 10 and c.loop_wait == 2 and c.retry_timeout == 2.5
    assert c.loop_wait + 2 * c.retry_timeout <= c.ttl
    c = load_config(BASE + ["--ttl", "4"], environ={})
    assert c.loop_wait + 2 * c.retry_timeout <= 4


def test_config_lowers_a_retry_timeout_that_breaks_the_rule(caplog):
    with caplog.at_level(logging.WARNING):
        c = load_config(BASE + ["--ttl", "6", "--loop-wait", "2", "--retry-timeout", "5"], environ={})
    assert c.retry_timeout == 2.0 and "lowering retry_timeout" in caplog.text
    with pytest.raises(DaemonConfigError, match="below --ttl"):
        load_config(BASE + ["--ttl", "4", "--loop-wait", "5"], environ={})


def test_config_precedence_flags_over_env_file_over_environment(tmp_path):
    env_file = tmp_path / "varunad.env"
    env_file.write_text("# comment\nVARUNAD_TTL=8\nVARUNAD_NAME='from-file'\nVARUNAD_STOP_GRACE=30\n")
    environ = {"VARUNAD_TTL": "20", "VARUNAD_NAME": "from-env", "VARUNAD_SLOTS": "2", "OTHER": "x"}
    c = load_config(BASE + ["--env-file", str(env_file), "--name", "from-flag"], environ=environ)
    assert (c.name, c.ttl, c.slots, c.stop_grace) == ("from-flag", 8.0, 2, 30.0)
    assert parse_env_file(env_file) == {"VARUNAD_TTL": "8", "VARUNAD_NAME": "from-file", "VARUNAD_STOP_GRACE": "30"}


@pytest.mark.parametrize("argv, message", [
    (["--store", "/s", "--plaintext"], "no etcd endpoint"),
    (["--etcd", "h:1", "--plaintext"], "no checkpoint store"),
    (["--etcd", "h:1", "--store", "/s"], "--curve-keys DIR"),
    (BASE + ["--ttl", "1"], "minimum lease"),
    (BASE + ["--name", "a/b"], "--name"),
    (BASE + ["--abort-grace", "70"], "shorter than --stop-grace"),
    (BASE + ["--keep-jobs", "0"], "--keep-jobs 0 must be at least 1"),
])
def test_config_refuses_unusable_settings(argv, message):
    with pytest.raises(DaemonConfigError, match=message):
        load_config(argv, environ={})


def _job_files(state, job: str, used: float, *, logs: bool = True) -> None:
    (state / "bundles" / job).mkdir(parents=True)
    (state / "bundles" / job / "train.py").write_text("pass\n")
    paths = [state / "bundles" / job / "train.py", state / "bundles" / job]
    if logs:
        (state / "logs" / job).mkdir(parents=True)
        (state / "logs" / job / "e1-r0.log").write_text("step 1\n")
        paths += [state / "logs" / job / "e1-r0.log", state / "logs" / job]
    for p in paths:
        os.utime(p, (used, used))


def test_housekeeping_keeps_the_most_recently_used_jobs(tmp_path):
    for job, used in (("a", 100.0), ("b", 300.0), ("c", 200.0), ("d", 50.0)):
        _job_files(tmp_path, job, used, logs=job != "c")
    os.utime(tmp_path / "logs" / "a" / "e1-r0.log", (400.0, 400.0))   # a's workers still wrote lately
    assert prune_jobs(tmp_path, 2, protect={"d"}) == ["c"]   # d is running: never touched
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["a", "b", "d"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["a", "b", "d"]
    assert prune_jobs(tmp_path, 2) == ["d"] and prune_jobs(tmp_path, 2) == []
    assert prune_jobs(tmp_path / "missing", 1) == []
    with pytest.raises(ValueError, match="at least 1"):
        prune_jobs(tmp_path, 0)
    assert job_dir(tmp_path, LOGS, "a") == tmp_path / "logs" / "a"
    with pytest.raises(ValueError, match="unknown kind"):
        job_dir(tmp_path, "cache", "a")   # a kind pruning would never see


# --- jobs and bundles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"batch_size": 10, "chunk_size": 0}, "micro-batch size must be a positive integer"),
    ({"steps": 0}, "steps must be a positive integer"),
    ({"checkpoint_every": -1}, "checkpoint interval"),
    ({"batch_size": True}, "batch size"),
    ({"job": "a b"}, "job name"),
    ({"script": "../x.py"}, "relative path"),
    ({"schedule": "zigzag"}, "schedule 'zigzag' is not one of varuna, gpipe, 1f1b, zb-h1, or 'auto' to let"),
    ({"schedule": None}, "schedule None is not one of"),
    # the leader enumerates the batch's divisors: a batch of 10**9 stalled every leader in turn
    ({"batch_size": 10**9}, "more than 16777216 examples per step"),
    # each VM would resolve it in its own directory, and no checkpoint would ever be complete
    ({"store": "relative/dir"}, "absolute path .* or a URL, got 'relative/dir'"),
    ({"args": ("--x", "a\x00b")}, "an argument holds a NUL character"),
    ({"steps": 10**30}, "steps must be at most 9007199254740992"),
    ({"batch_size": 16, "chunk_size": 32}, "micro-batch size 32 is larger than the global batch 16"),
    # a 5000-character name was echoed whole
    ({"job": "x" * 5000}, r"^job name 'x{60}'\.\.\. \(5000 characters\) must be 1\.\.128"),
])
def test_job_spec_refuses(kw, message):
    with pytest.raises(JobSpecError, match=message):
        spec(**kw)


def test_job_spec_round_trip_and_hand_written_values():
    s = spec(args=("--x", "1"), chunk_size=4)
    assert JobSpec.decode(s.encode(), job="j") == s
    assert s.micro_batch_sizes() == [4] and spec().micro_batch_sizes() == [1, 2, 3, 4, 6, 12]
    assert spec(batch_size=36).micro_batch_sizes() == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert spec(store="/mnt/ckpt").store == "/mnt/ckpt" and spec(store="s3://b/p").store == "s3://b/p"
    for bad, message in [(b"{", "not JSON"), (b"[]", "not a JSON object"), (b'{"job": "j", "zap": 1}', "unknown"),
                         (b'{"job": "j"}', "malformed")]:
        with pytest.raises(JobSpecError, match=message):
            JobSpec.decode(bad, job="j")
    with pytest.raises(JobSpecError, match="names job"):
        JobSpec.decode(spec(job="k").encode(), job="j")
    assert script_fingerprint(s) != script_fingerprint(spec(args=("--x", "2"), chunk_size=4))


def test_a_job_may_leave_the_schedule_to_the_planner():
    assert spec(schedule="auto").schedule == "auto" and spec(schedule="zb-h1").schedule == "zb-h1"


def test_job_state_round_trip():
    st = JobState(job="j").but(state="running", epoch=7, epochs=(7,), plan={"P": 2})
    assert JobState.decode(st.encode()) == st


def test_bundle_packs_the_script_directory_and_unpacks_once(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("import pkg.helper\n")
    (src / "pkg" / "helper.py").write_text("X = 1\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    data, rel = pack_bundle(src / "train.py")
    assert rel == "train.py"
    assert sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == ["pkg/helper.py", "train.py"]
    again, _ = pack_bundle(src / "train.py")
    assert bundle_digest(again) == bundle_digest(data)  # same files, same digest
    out = unpack_bundle(data, bundle_digest(data), tmp_path / "dest")
    assert (out / "pkg" / "helper.py").read_text() == "X = 1\n"
    assert unpack_bundle(data, bundle_digest(data), tmp_path / "dest") == out
    with pytest.raises(BundleError, match="digest"):
        unpack_bundle(data, "0" * 64, tmp_path / "dest2")


def test_bundle_size_limit_names_the_biggest_files(tmp_path):
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "weights.bin").write_bytes(os.urandom(256 * 1024))  # does not compress
    with pytest.raises(BundleError, match=r"weights\.bin"):
        pack_bundle(tmp_path / "train.py", limit=64 * 1024)


def test_unpack_refuses_entries_outside_the_bundle(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../evil.py", "x")
    data = buf.getvalue()
    with pytest.raises(BundleError, match="unsafe"):
        unpack_bundle(data, bundle_digest(data), tmp_path / "dest")
    assert not (tmp_path / "evil.py").exists()


# --- plans ----------------------------------------------------------------------------------------

def test_a_failed_workers_error_is_summed_up_by_the_exception_that_ended_it():
    tail = ("rank 0 on vm1 exited with code 1; last output:\n"
            "step 3 loss 4.1\n"
            "Traceback (most recent call last):\n"
            '  File "train.py", line 9, in <module>\n'
            '    raise ValueError("boom from user script")\n'
            "ValueError: boom from user script\n"
            "WARNING:varuna:rank 0: closing\n")   # what atexit handlers print after the traceback
    assert error_summary(tail) == "rank 0 on vm1 exited with code 1: ValueError: boom from user script"
    assert error_summary("rank 0 on vm1 exited with code 1; last output:\ntrainer.errors.ConfigError: bad (hint)") \
        == "rank 0 on vm1 exited with code 1: trainer.errors.ConfigError: bad (hint)"
    # no traceback: the exit code and the last line printed (not a reason by itself); nothing
    # printed: the first line, saying so
    assert error_summary("rank 1 on vm2 exited with code 3; last output:\nfailing on purpose\n") == \
        "rank 1 on vm2 exited with code 3: exit code 3 after printing: failing on purpose"
    assert error_summary("rank 1 on vm2 killed by SIGKILL; last output:\n") == \
        "rank 1 on vm2 killed by SIGKILL (no output)"
    assert error_summary("vm1 could not get the job's files: gone") == "vm1 could not get the job's files: gone"
    assert error_summary("") == "" and len(error_summary("x" * 1000)) == 300
    # torch.distributed prefixes a worker's traceback lines with its rank
    assert error_summary("rank 2 on vm3 exited with code 1; last output:\n[rank2]: RuntimeError: closed by peer\n"
                         "[rank2]:[W1122] ProcessGroupGloo destroyed\n") == \
        "rank 2 on vm3 exited with code 1: [rank2]: RuntimeError: closed by peer"


def test_a_calibration_run_out_of_memory_is_not_called_the_scripts_fault():
    """A probe's capped slot: "failed: out of memory; last output:; ... fix the script"."""
    from varunad.control.decide import calibration_failed
    from varunad.node.oom import OOM_WORDS

    said = calibration_failed("big", "vm1", f"rank 0 on vm1 {OOM_WORDS}; last output:\n")
    assert said.startswith("the calibration run of big on vm1 ran out of memory (the kernel's OOM killer ended "
                           "it): it runs the model segment by segment on one slot"), said
    assert "fix the script" not in said and "give that VM more memory" in said
    script = calibration_failed("j", "vm2", "rank 0 on vm2 exited with code 1; last output:\nValueError: bad arg\n")
    assert script.startswith("the calibration run of j on vm2 failed: ValueError: bad arg; its workers would fail")


def test_device_kinds_tell_apart_gpu_models_and_shared_cpu_hosts(tmp_path, caplog):
    # The NVIDIA driver's per-GPU file, as /proc/driver/nvidia/gpus/<bus id>/information has it.
    for bus, model in (("0000:07:00.0", "NVIDIA A100-SXM4-80GB"), ("0000:0f:00.0", "NVIDIA A100-SXM4-80GB")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-1\n")
    (tmp_path / "0000:10:00.0").mkdir()   # a GPU whose file cannot be read is skipped
    assert gpu_models(str(tmp_path)) == ["NVIDIA A100-SXM4-80GB"] * 2
    assert gpu_models(str(tmp_path / "absent")) == []
    assert detect_device_kind(2, gpus=2, models=gpu_models(str(tmp_path))) == "NVIDIA A100-SXM4-80GB"
    assert detect_device_kind(1, gpus=1, models=["Odd/Name GPU"]) == "Odd-Name GPU"   # a key component
    assert detect_device_kind(1, gpus=1, models=[]) == "cuda"                            # no driver file
    with caplog.at_level(logging.WARNING, logger="varunad.cluster.facts"):
        assert detect_device_kind(2, gpus=2, models=["Tesla T4", "NVIDIA A100"]) == "cuda"
    assert "mixes GPU models" in caplog.text
    # CPU slots of one host share its cores: a slot of a busy 4-slot host is a kind of its own.
    assert detect_device_kind(1, gpus=0) == "cpu"
    assert detect_device_kind(4, gpus=0) == "cpu-4slots"


def test_gpu_slots_follow_cuda_visible_devices(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    dev = str(tmp_path)
    assert gpu_count({}, dev=dev) == 4
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}, dev=dev) == 2
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f1c,MIG-1"}, dev=dev) == 2
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, dev=dev) == 1   # CUDA stops at the first non-device
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}, dev=dev) == 0
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, dev=str(tmp_path / "none")) == 0


def test_a_gpu_slot_gets_the_smallest_gpus_memory(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '81920\\n40960\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert detect_memory(2, gpus=2) == 40960 * 2**20
    smi.write_text("#!/bin/sh\nexit 9\n")   # the driver cannot answer: host memory shared out, as on CPU
    assert detect_memory(2, gpus=2) == detect_memory(2)


def test_member_facts_round_trip_and_old_readers_ignore_them():
    from varunad.cluster.membership import Member

    m = member("d1", slots=2)
    assert DaemonMember.decode(m.encode()) == m
    assert Member.decode(m.encode()).name == "d1"
    with pytest.raises(ValueError, match="worker ports"):
        DaemonMember(**{**json.loads(m.encode()), "worker_ports": [1]})
    # a link probe's ports are its own: never a worker's stream port or the job's rendezvous
    with pytest.raises(ValueError, match="overlap"):
        DaemonMember(**{**json.loads(m.encode()), "probe_ports": [m.worker_ports[0], 30000]})
    with pytest.raises(ValueError, match="two TCP ports"):
        DaemonMember(**{**json.loads(m.encode()), "probe_ports": [30000]})


def test_make_plan_places_ranks_and_the_rendezvous_on_rank_0():
    s = spec()
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2, 3)] + [(member("d4", draining=True), 104)]
    doc, _ = make_plan(s, members, {"cpu": uniform_calibration(s, "cpu")}, calibrated=False, reason="test")
    assert (doc.plan.P, doc.plan.D) == (1, 3)  # synthetic calibration: data parallel only
    assert doc.members == ("d1", "d2", "d3") and doc.incarnations == {"d1": 101, "d2": 102, "d3": 103}
    rank0 = next(x for x in doc.slots if x.rank == 0)
    assert doc.dist_url == f"tcp://10.0.0.{rank0.member[-1]}:{20000 + 10 * int(rank0.member[-1]) + 9}"
    assert doc.endpoints() == [f"tcp://10.0.0.{x.member[-1]}:{20000 + 10 * int(x.member[-1]) + 1}"
                               for x in sorted(doc.slots, key=lambda x: x.rank)]
    assert PlanDoc.decode(doc.encode()) == doc
    assert doc.plan.recompute == (False,)  # the planner's per-stage choice travels with the plan
    assert doc.slots_on("d2")[0].endpoint.endswith(":20021")


def test_a_job_that_leaves_the_schedule_to_the_planner_gets_a_plan_naming_one():
    s = spec(schedule="auto")
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2)]
    doc, result = make_plan(s, members, {"cpu": uniform_calibration(s, "cpu")}, calibrated=False, reason="test")
    assert doc.plan.schedule == result.parallel.schedule == "varuna"   # no pipeline: the first of equals
    assert result.ruled_out[-1].startswith("the other schedules: gpipe (1x2)")
    assert json.loads(doc.encode())["schedule"] == "varuna"   # the previous release's flat form too
    assert PlanDoc.decode(doc.encode()) == doc


def test_a_plan_document_checks_its_placement_and_reads_the_previous_release_form():
    s = spec()
    members = [(member(f"d{i}"), 100 + i) for i in (1, 2)]
    doc, _ = make_plan(s, members, {"cpu": uniform_calibration(s, "cpu")}, calibrated=False, reason="test")
    raw = json.loads(doc.encode())
    mine = {k: v for k, v in raw.items() if k in PlanDoc.__dataclass_fields__}   # without the flat copy
    with pytest.raises(ValueError, match="ranks 0..1 once each"):
        PlanDoc(**{**mine, "slots": raw["slots"][:1]})
    with pytest.raises(ValueError, match="two workers on one slot"):
        PlanDoc(**{**mine, "slots": [{**x, "member": "d1", "slot": 0} for x in raw["slots"]]})
    for bad, words in (({"slot": -5}, "slot of rank 0 must be an int >= 0"), ({"slot": True}, "int >= 0"),
                       ({"member": "a/b"}, "member of rank 0"), ({"endpoint": "10.0.0.1:80"}, "URL"),
                       ({"rank": "0"}, "rank must be an int")):
        with pytest.raises(ValueError, match=words):
            PlanDoc(**{**mine, "slots": [{**raw["slots"][0], **bad}, raw["slots"][1]]})
    with pytest.raises(ValueError, match="rendezvous URL"):
        PlanDoc(**{**mine, "dist_url": "somewhere"})
    with pytest.raises(ValueError, match="plan is malformed: JSON nested too deeply"):
        PlanDoc.decode(b"[" * 100_000)
    with pytest.raises(ValueError, match="plan is malformed.*increasing cut points"):
        PlanDoc.decode(json.dumps({**raw, "plan": {**raw["plan"], "cuts": [3]}}).encode())
    with pytest.raises(ValueError, match="plan is malformed.*P"):
        PlanDoc.decode(json.dumps({**raw, "plan": {"D": 2}}).encode())
    # The release before ParallelPlan wrote P, D, ... flat, and each slot's stage and replica; this
    # one writes that form beside the plan (a daemon of that release reads it), and reads it back.
    assert (raw["pipeline_depth"], raw["data_depth"], raw["cuts"], raw["recompute"]) == (1, 2, [], [False])
    assert [(x["rank"], x["stage"], x["replica"]) for x in raw["slots"]] == [(0, 0, 0), (1, 0, 1)]
    flat = {k: v for k, v in raw.items() if k != "plan"}
    assert PlanDoc.decode(json.dumps(flat).encode()) == doc
    # uneven shares have no flat form: a daemon of that release must refuse the plan, not run it evenly
    uneven = dataclasses.replace(doc, plan=doc.plan.replace(shares=(7, 5)))
    raw = json.loads(uneven.encode())
    assert "pipeline_depth" not in raw and raw["plan"]["shares"] == [7, 5]
    assert PlanDoc.decode(uneven.encode()) == uneven
    flat["slots"][1]["replica"] = 0   # two workers in one cell: refused, not guessed at
    with pytest.raises(ValueError, match="plan is malformed"):
        PlanDoc.decode(json.dumps(flat).encode())
    for P, D in ((10**9, 10**9), (-2, -3), ("2", 1)):   # junk sizes: refused at once, nothing built from them
        with pytest.raises(ValueError, match="plan is malformed"):
            PlanDoc.decode(json.dumps({**flat, "pipeline_depth": P, "data_depth": D}).encode())
    flat["slots"][1].update(stage=-1, replica=1)   # a negative index must not count from the end
    with pytest.raises(ValueError, match="plan is malformed"):
        PlanDoc.decode(json.dumps(flat).encode())


# --- the leader's decisions -------------------------------------------------------------------------

def test_decide_starts_the_head_of_the_queue_and_clears_an_empty_one():
    assert d(snapshot()).action == "start"
    done = {"j": JobState(job="j", state="done")}
    assert d(snapshot(states=done, plan=run_plan(), epoch=50)).action == "idle"
    assert d(snapshot(states=done, plan=PlanDoc.idle("x"), epoch=51)).action == "nothing"


def test_decide_fails_a_bad_spec_and_cancels_on_request():
    bad = JobEntry("bad", None, "job spec is not JSON", 3)
    dec = d(snapshot(jobs=[bad, JobEntry("j", spec(), None, 5)]))
    assert (dec.action, dec.job) == ("fail", "bad") and "not JSON" in dec.reason
    assert d(snapshot(cancels=("j",))).action == "cancel"


def test_decide_follows_an_epoch_to_its_end():
    plan = run_plan()
    assert d(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50))).action == "nothing"
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50, "done")))
    assert dec.action == "done"
    stopped = reports_for(plan, 50, "stopped")
    assert d(snapshot(plan=plan, epoch=50, states=running(), reports=stopped)).action == "start"
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50, overrides={1: "failed"})))
    assert (dec.action, dec.failure, dec.checkpoint) == ("abort", True, False) and "boom" not in dec.reason


def test_the_failure_a_job_is_judged_by_is_the_raise_not_a_neighbours_broken_connection():
    plan = run_plan()
    reports = reports_for(plan, 50, overrides={0: "failed", 1: "failed"})
    words = {0: "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4711",
             1: "ValueError: failing on purpose"}
    for m, rep in reports.items():
        reports[m] = dataclasses.replace(rep, workers=tuple(
            dataclasses.replace(w, error=f"rank {w.rank} on {m} exited with code 1; last output:\n{words[w.rank]}")
            if w.rank in words else w for w in rep.workers))
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=reports)
    dec = d(snap)
    assert dec.action == "abort" and dec.reason.startswith("rank 1 on ") and "failing on purpose" in dec.reason, dec
    assert epoch_failure(snap, plan, "j", 50) == dec.reason
    # read after the stop: the snapshot's plan is the stop plan, the records the run plan's
    stopped = dataclasses.replace(snap, plan=PlanDoc(kind="stop", reason="t", job="j", stop_epoch=50))
    assert epoch_failure(stopped, plan, "j", 50) == dec.reason
    # only the broken connection reported so far: that is the failure until the raise is read
    reports = reports_for(plan, 50, overrides={0: "failed"})
    assert d(snapshot(plan=plan, epoch=50, states=running(), reports=reports)).reason.startswith("rank 0 on ")
    assert epoch_failure(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50)), plan, "j",
                         50) is None


def test_a_worker_whose_script_ended_early_is_the_root_failure_and_is_not_retried():
    """One rank's script exits 0 after step 4 of the job's 10 (a break on some ranks only, one
    replica's data running out): its peers then fail on broken connections. Read after the stop, the early end is the cause (not a
    transient one, never retried); a worker that exited 0 after the last step is no cause."""
    from varunad.control.failures import classify
    plan = run_plan()
    reports = reports_for(plan, 50, overrides={0: "failed", 1: "done"})
    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8089: Connection reset by peer"
    for m, rep in reports.items():
        reports[m] = dataclasses.replace(rep, workers=tuple(
            dataclasses.replace(w, error=f"rank 0 on {m} exited with code 1; last output:\n{gloo}")
            if w.rank == 0 else w for w in rep.workers))
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=reports)
    root = epoch_failure(snap, plan, "j", 50)
    assert root is not None and root.startswith("rank 1 on ") and "the script ended at step 4 of 10" in root, root
    assert classify(root, None) == "fail"
    # every step trained: the exit was the end, and the broken connection is what is left
    finished = {m: dataclasses.replace(rep, workers=tuple(dataclasses.replace(w, step=9) if w.rank == 1 else w
                                                          for w in rep.workers)) for m, rep in reports.items()}
    root = epoch_failure(snapshot(plan=plan, epoch=50, states=running(), reports=finished), plan, "j", 50)
    assert root is not None and root.startswith("rank 0 on ") and "Connection reset" in root, root
    # nor is one that trained no step of its epoch (resumed at the last step: nothing was left)
    idle = {m: dataclasses.replace(rep, workers=tuple(dataclasses.replace(w, step=-1) if w.rank == 1 else w
                                                      for w in rep.workers)) for m, rep in reports.items()}
    root = epoch_failure(snapshot(plan=plan, epoch=50, states=running(), reports=idle), plan, "j", 50)
    assert root is not None and root.startswith("rank 0 on "), root


def test_decide_morphs_when_a_member_of_the_plan_leaves_or_is_noticed_leaving():
    plan = run_plan()
    members = {f"d{i}": (member(f"d{i}"), 100 + i) for i in (1, 3)}
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50), members=members))
    assert (dec.action, dec.checkpoint, dec.failure) == ("abort", False, False) and "d2" in dec.reason
    members = {f"d{i}": (member(f"d{i}"), 100 + i) for i in (1, 2, 3)}
    members["d2"] = (member("d2"), 999)  # the same name, registered again: its workers died with it
    reports = reports_for(plan, 50)
    reports["d2"] = WorkerReport(member="d2")  # what the new process reports (its old report went with its lease)
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports, members=members))
    assert dec.action == "abort" and "d2" in dec.reason
    members["d2"] = (member("d2", draining=True), 102)
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50), members=members))
    assert (dec.action, dec.checkpoint) == ("abort", True) and "preemption" in dec.reason


def test_decide_considers_a_newcomer_once():
    plan = run_plan(("d1", "d2"))
    memory = LeaderMemory()
    snap = snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50))
    dec = d(snap, memory)
    assert dec.action == "consider" and "d3" in dec.reason
    memory.considered = (50, frozenset((m.name, lease) for m, lease in snap.usable()))
    assert d(snap, memory).action == "nothing"
    # the same VM back under its name with a new registration (lost, then restarted) is a newcomer again
    members = dict(snap.members)
    members["d3"] = (members["d3"][0], members["d3"][1] + 1000)
    again = snapshot(plan=plan, epoch=50, states=running(), reports=reports_for(plan, 50), members=members)
    assert d(again, memory).action == "consider"


def test_decide_waits_for_a_stop_then_plans():
    plan = run_plan()
    stop = PlanDoc.stop("j", 50, checkpoint=True, reason="x")
    alive = reports_for(plan, 50)
    assert d(snapshot(plan=stop, epoch=51, states=running(), reports=alive)).action == "await_stop"
    gone = reports_for(plan, 50, "stopped")
    assert d(snapshot(plan=stop, epoch=51, states=running(), reports=gone)).action == "start"


def test_decide_gives_up_on_an_epoch_that_never_starts():
    plan = run_plan()
    memory = LeaderMemory(epoch_seen={50: 0.0})
    reports = reports_for(plan, 50, step=-1)
    assert d(snapshot(plan=plan, epoch=50, states=running(), reports=reports), memory, now=30.0).action == "nothing"
    dec = d(snapshot(plan=plan, epoch=50, states=running(), reports=reports), memory, now=61.0)
    assert (dec.action, dec.failure) == ("abort", True)


def test_decide_adopts_a_plan_whose_state_was_not_written():
    plan = run_plan()
    dec = d(snapshot(plan=plan, epoch=60, states=running(50), reports=reports_for(plan, 60)))
    assert dec.action == "adopt"


def test_history_merge_keeps_the_newest_epoch_per_step():
    per_epoch = {10: [(0, 1.0), (1, 2.0), (2, 3.0)], 20: [(2, 3.5), (3, 4.0)]}
    assert merge_history(per_epoch) == [(0, 1.0), (1, 2.0), (2, 3.5), (3, 4.0)]
    assert epoch_ranges(per_epoch) == {10: (0, 2), 20: (2, 3)}
    assert steps_trained_twice(epoch_ranges(per_epoch)) == 1


def test_steps_trained_twice_counts_each_step_an_earlier_epoch_had_reached():
    assert steps_trained_twice({}) == 0
    assert steps_trained_twice({"5": [0, 9], "7": [10, 19]}) == 0          # resumed right after
    assert steps_trained_twice({"5": [0, 9], "7": [6, 19]}) == 4           # from a checkpoint at 6
    # an epoch that died early still redoes only what the furthest epoch before it had reached
    assert steps_trained_twice({5: (0, 9), 7: (6, 7), 9: (8, 12)}) == 2 + 2
    assert steps_trained_twice({9: (8, 12), 5: (0, 9)}) == 2               # by epoch, not by key order


def test_history_entries_carry_their_span_and_refuse_a_bad_one():
    pairs = [(3, 1.5), (1, 2.0)]
    assert decode_history(encode_history(pairs, (10.0, 12.5))) == ([(1, 2.0), (3, 1.5)], (10.0, 12.5))
    assert decode_history(encode_history(pairs)) == ([(1, 2.0), (3, 1.5)], None)   # an older daemon's entry
    for bad in (b'{"steps": [], "span": [2.0, 1.0]}', b'{"steps": [], "span": "soon"}', b'{"steps": [], "span": [1]}'):
        with pytest.raises(ValueError, match="span is malformed"):
            decode_history(bad)
    assert merge_spans([(10.0, 20.0), (9.5, 19.0)]) == (9.5, 20.0) and merge_spans([]) is None


def test_failures_that_cannot_go_away_fail_at_once_transient_ones_are_retried():
    from varunad.control.failures import cause, classify

    config = "rank 0 on vm1 exited with code 1: trainer.errors.ConfigError: batch 64 vs 32 (pass the job's)"
    assert cause(config) == "ConfigError: batch 64 vs 32 (pass the job's)"
    assert classify(config, None) == "fail"
    assert classify("rank 0 on vm1 exited with code 1: SyntaxError: invalid syntax", None) == "fail"
    peer = "rank 1 on vm2 exited with code 1: [rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:5"
    assert cause(peer).startswith("RuntimeError: Connection closed") and classify(peer, peer) == "retry"
    boom = "rank 0 on vm1 exited with code 3: failing on purpose"
    assert classify(boom, None) == "retry"          # new: one fresh start shows whether it repeats
    assert classify(boom, boom.replace("vm1", "vm2")) == "fail"   # the same words again, on any VM
    assert classify(boom, "rank 0 on vm1 exited with code 3: something else") == "retry"
    # the same store failure at another epoch or checkpoint is the same failure; other numbers tell apart
    store = "rank 0 on vm1 exited with code 1: CheckpointError: could not write /proc/nope/epochs/{}.json: [Errno 2]"
    assert classify(store.format(67), store.format(55)) == "fail"
    ckpt = "rank 0 on vm1 exited with code 1: CheckpointError: could not write /s/j/varuna_ckpt_{}/x.pt: [Errno 2]"
    assert classify(ckpt.format(30), ckpt.format(20)) == "fail"
    loader = "rank 0 on vm1 exited with code 1: RuntimeError: DataLoader worker (pid {}) is killed by signal: Killed."
    assert classify(loader.format(12345), loader.format(23456)) == "retry"
    # a worker killed from outside, twice in the same words: not the script's doing
    killed = error_summary("rank 1 on vm2 killed by SIGKILL; last output:\nstep 17855 loss 2.1\n")
    assert killed == "rank 1 on vm2 killed by SIGKILL: killed by SIGKILL after printing: step 17855 loss 2.1"
    assert classify(killed, killed) == "retry"


def test_a_workers_error_keeps_its_first_line_past_the_tail_it_keeps():
    """A worker that printed more than the record keeps lost the line saying who ended how: the
    job's reason read "rank 0 on vm1 failed: st output:", the same on every attempt, so a kill -9
    repeated by an operator failed the job as deterministic, blaming the survivor."""
    from varunad.node.supervisor import _TAIL_BYTES, _clip

    output = "".join(f"step {i:05d} loss 4.123456\n" for i in range(1000))
    error = f"rank 1 on vm2 killed by SIGKILL; last output:\n{output}"
    kept = _clip(error)
    assert len(kept) <= _TAIL_BYTES and kept.startswith("rank 1 on vm2 killed by SIGKILL; last output:\nstep ")
    assert kept.endswith("step 00999 loss 4.123456\n")
    assert error_summary(kept) == "rank 1 on vm2 killed by SIGKILL: killed by SIGKILL after printing: step 00999 loss 4.123456"
    assert _clip("short") == "short"


def test_the_progress_interval_grows_with_the_job_so_the_fleet_writes_a_bounded_rate():
    assert progress_interval(1.0, 4) == 1.0 and progress_interval(2.5, 4) == 2.5   # the flag, for small jobs
    for world in (100, 300, 1000):
        interval = progress_interval(1.0, world)
        assert interval >= 1.0 and world / interval <= 100.0 + 1e-9, (world, interval)
    assert progress_interval(1.0, 300) < progress_interval(1.0, 1000)


def test_workers_count_as_progressing_through_a_checkpoint_write_for_the_whole_lease():
    """An etcd outage longer than the lease fences the workers unless they progress. A worker that
    last reported a step the job checkpoints after stands still for the write, so it is given the
    whole lease; after any other step, twice its step interval (at least a third of the lease): an
    outside probe saw a healthy worker killed in the middle of its checkpoint."""
    import time
    from types import SimpleNamespace

    from varunad.node.stopping import WorkerStopping

    def workers(step: int, ago: float, every: int):
        return SimpleNamespace(alive=lambda: [SimpleNamespace(rank=0)], _step_interval={0: 0.2},
                               checkpoint_every=every,
                               reporter=SimpleNamespace(progress={0: SimpleNamespace(step=step, at=time.time() - ago)}))

    assert WorkerStopping.progressing(workers(step=9, ago=3.0, every=10), 5.0)       # writing checkpoint 10
    assert not WorkerStopping.progressing(workers(step=8, ago=3.0, every=10), 5.0)   # stuck mid-step
    assert not WorkerStopping.progressing(workers(step=9, ago=6.0, every=10), 5.0)   # past the lease
    assert WorkerStopping.progressing(workers(step=8, ago=1.0, every=10), 5.0)


def test_a_calibration_run_that_never_ends_fails_the_job_after_the_stall_timeout():
    """A script that hangs before Varuna() held its calibration, and every job queued behind it,
    for good: the stall check needs a first step, which a calibration run never reports."""
    from varunad.control.decide import decide

    plan = PlanDoc(kind="profile", job="j", reason="calibrating cpu on d1", profile_member="d1",
                   incarnations={"d1": 101})
    snap = snapshot(plan=plan, epoch=40)
    memory = LeaderMemory()
    memory.epoch_seen[40] = 0.0
    waiting = decide(snap, memory, now=1000.0, start_timeout=120.0, stall_timeout=1800.0)
    assert (waiting.action, waiting.job) == ("wait", "j"), waiting
    hung = decide(snap, memory, now=1801.0, start_timeout=120.0, stall_timeout=1800.0)
    assert (hung.action, hung.job) == ("fail", "j"), hung
    assert hung.reason.startswith("the calibration run on d1 did not finish within 1800s (--stall-timeout)")
    assert decide(snap, memory, now=1e9, start_timeout=120.0).action == "wait"   # 0: no bound


def test_a_morph_that_waits_for_a_calibration_waits_for_it_and_does_not_start_it_again():
    """A morphing job whose next plan needs a kind calibrated (a VM of a new kind joined, then
    one of the plan's was lost): "start" each cycle wrote a new calibration plan, whose run
    replaced the one just begun, 30,000 plan epochs in 2.5 minutes (a probe)."""
    from varunad.control.decide import decide

    plan = PlanDoc(kind="profile", job="j", reason="calibrating cpu-b on d3", profile_member="d3",
                   incarnations={"d3": 103})
    states = {"j": JobState(job="j", state="morphing", epoch=30, epochs=(20, 30))}
    memory = LeaderMemory()
    memory.epoch_seen[41] = 0.0
    calibrating = {"d3": WorkerReport(member="d3", job="j", epoch=41, workers=(WorkerRecord(rank=0, slot=0),))}
    waiting = decide(snapshot(plan=plan, epoch=41, states=states, reports=calibrating), memory, now=10.0,
                     start_timeout=60.0, stall_timeout=1800.0)
    assert (waiting.action, waiting.job) == ("wait", "j") and "d3 is calibrating" in waiting.reason, waiting
    ended = {"d3": WorkerReport(member="d3", job="j", epoch=41, workers=(WorkerRecord(rank=0, slot=0, outcome="done"),))}
    done = decide(snapshot(plan=plan, epoch=41, states=states, reports=ended), memory, now=20.0, start_timeout=60.0)
    assert (done.action, done.job) == ("start", "j") and "calibration run on d3 ended" in done.reason, done
    hung = decide(snapshot(plan=plan, epoch=41, states=states, reports=calibrating), memory, now=1801.0,
                  start_timeout=60.0, stall_timeout=1800.0)
    assert hung.action == "fail", hung   # bounded by --stall-timeout, as a start's calibration is


def test_a_leaving_daemon_waits_for_the_leader_to_see_it_leave_but_not_for_ever():
    """A notice's workers stop at a step boundary by themselves: a probe's daemon was gone 0.5 s after
    SIGTERM, before the leader read it draining, and the morph said the VM was lost."""
    import asyncio
    import time
    from types import SimpleNamespace

    from varunad.node.daemon import plan_after
    from varunad.store.keys import Keys

    class _Plan:
        def __init__(self, writes_at: float, epoch: int) -> None:
            self.start, self.writes_at, self.epoch = time.monotonic(), writes_at, epoch

        async def get(self, key, *, timeout=None):
            assert key == "/t/plan"
            moved = time.monotonic() - self.start >= self.writes_at
            return SimpleNamespace(mod_revision=self.epoch + (5 if moved else 0))

    keys = Keys("/t/")
    assert asyncio.run(plan_after(_Plan(0.3, 40), keys, 40, within=5.0))
    began = time.monotonic()
    assert not asyncio.run(plan_after(_Plan(99.0, 40), keys, 40, within=0.4))
    assert 0.35 <= time.monotonic() - began < 2.0
