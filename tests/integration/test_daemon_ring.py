"""varunad end to end: real daemons, real etcd, real workers, loopback; no mocks.

One ring of daemons (d1..d3, one slot each, TTL 4 s, CURVE keys) serves every scenario in turn;
each scenario leaves d1..d3 alive and no job running. The daemons run with --calibrate profile
and 1 GiB per slot: the first job is calibrated by running its script once (the test script
writes a calibration whose model does not fit one slot), so the jobs run as pipelines (P >= 2)
and morph between P x D shapes. The job is the tiny GPT with dropout 0 and SGD with momentum:
after any morph its loss history must equal the uninterrupted single-process run
(tests/support/reference.py) within 1e-4 relative, and no epoch may redo more steps than the
checkpoint interval.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq
from support import REPO
from support.etcd_server import EtcdServer
from support.reference import keyed_reference_run, reference_run
from support.ring import JOB_SCRIPT, Ring

from protocol.messages import Ping, Pong, decode, encode

pytestmark = pytest.mark.slow

TTL = 4.0
STEPS, BATCH, EVERY = 24, 12, 3
SLEEP = ("--step-sleep", "0.3")
NAMES = ["d1", "d2", "d3"]


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS, BATCH)[0]


@pytest.fixture(scope="module")
def ring_etcd():
    server = EtcdServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for name in NAMES + ["d4", "operator"]:
        r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "keys", "generate", "--dir", str(d), "--name", name],
                           capture_output=True, text=True, cwd=str(REPO))
        assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def ring(tmp_path_factory, ring_etcd, curve_keys):
    # each daemon plays a VM of its own: the job's workers sleep rather than compute, so they share
    # no cores, and the 2x2 its calibration makes best must not be crowded onto this host's two
    r = Ring(tmp_path_factory.mktemp("ring"), ring_etcd.endpoint, root="/ring/", ttl=TTL, curve_keys=curve_keys,
             own_machines=True,
             extra=["--calibrate", "profile", "--memory", str(2**30), "--stop-grace", "30", "--abort-grace", "2",
                    "--max-restarts", "1", "--progress-interval", "0.5", "--debounce", "0.3"])
    for name in NAMES:
        r.start(name)
    r.wait_members(NAMES)
    yield r
    r.close()


@pytest.fixture
def healthy(ring, ring_etcd):
    """d1..d3 alive and registered, etcd running, before and after each scenario."""
    ring_etcd.resume()
    for name in NAMES:
        d = ring.daemons.get(name)
        if d is None or not d.alive:
            ring.start(name)
    ring.wait_members(NAMES, timeout=3 * TTL + 20)
    yield ring
    ring_etcd.resume()


def check_history(status, reference, *, every=EVERY, steps=STEPS):
    """Every step once, equal to the reference; consecutive epochs redo at most `every` steps."""
    history = status["loss_history"]
    print(f"\n{status['job']}: epochs {status['epochs']}; morphs: "
          + "; ".join(f"{m['from']} -> {m['to']} ({m['reason'][:60]})" for m in status["morphs"]))
    assert [s for s, _ in history] == list(range(steps)), status["epochs"]
    for step, loss in history:
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    ranges = sorted((int(e), tuple(r)) for e, r in status["epochs"].items())
    for (_, (first1, last1)), (_, (first2, _)) in zip(ranges, ranges[1:]):
        assert first2 <= last1 + 1, f"steps {last1 + 1}..{first2 - 1} were never run: {ranges}"
        assert last1 - first2 + 1 <= every, f"more than {every} steps redone: {ranges}"
    # every epoch that ran has its wall-clock span, and each starts after the one before ended
    spans = [status["epoch_spans"][str(e)] for e, _ in ranges]
    assert all(t0 <= t1 for t0, t1 in spans), spans
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    return ranges


def test_submit_refuses_bad_specs_with_a_reason(ring, tmp_path):
    cases = [
        (["--batch-size", "12", "--chunk-size", "0"], "micro-batch size must be a positive integer"),
        (["--batch-size", "12", "--steps", "0"], "steps must be a positive integer"),
        (["--batch-size", "-12"], "batch size must be a positive integer"),
        (["--batch-size", "12", "--checkpoint-every", "0"], "checkpoint interval"),
    ]
    for extra, why in cases:
        args = ["submit", "--name", "bad", "--steps", "5", "--checkpoint-every", "1", *extra, str(JOB_SCRIPT)]
        r = ring.varunactl(*args)
        assert r.returncode != 0 and why in r.stderr, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = ring.varunactl("submit", "--name", "bad", "--batch-size", "12", "--steps", "5", "--checkpoint-every", "1",
                       str(tmp_path / "missing.py"))
    assert r.returncode != 0 and "no such script" in r.stderr
    r = ring.varunactl("submit", "--name", "bad", "--batch-size", "12", "--steps", "5", "--checkpoint-every", "1",
                       str(tmp_path))
    assert r.returncode != 0 and "is a directory; give the training script in it" in r.stderr, r.stderr
    big = tmp_path / "big"
    big.mkdir()
    (big / "job.py").write_text("print('hi')\n")
    (big / "data.bin").write_bytes(os.urandom(2 << 20))
    r = ring.varunactl("submit", "--name", "bad", "--batch-size", "12", "--steps", "5", "--checkpoint-every", "1",
                       str(big / "job.py"))
    assert r.returncode != 0 and "data.bin" in r.stderr and "MiB" in r.stderr, r.stderr
    # etcd unreachable: refused in bounded time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "varunad.ctl.cli", "--etcd", dead, "--timeout", "2", "submit", "--name",
                        "bad", "--batch-size", "12", "--steps", "5", "--checkpoint-every", "50", str(JOB_SCRIPT)],
                       capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert r.returncode != 0 and "cannot reach etcd" in r.stderr
    # a spec that is valid but never checkpoints is let through, with a note saying so
    assert "note: --checkpoint-every 50 is more than --steps 5: no checkpoint before the end" in r.stderr
    assert time.monotonic() - start < 20
    assert ring.call(ring.store.get(ring.keys.job("bad"))) is None


@pytest.mark.chaos  # the chaos suite's kill -9 of this kind (tests/integration/chaos/ does not repeat it)
def test_kill9_of_a_non_leader_morphs_and_the_job_finishes(healthy, reference):
    ring = healthy
    ring.submit("kill-member", steps=STEPS, script_args=SLEEP)
    st = ring.wait_step("kill-member", 2)
    assert st["plan"]["P"] >= 2, "the calibration should make the planner pipeline the model"
    ring.wait_checkpoint("kill-member", 6)
    leader = ring.leader()
    victim = next(m for m in st["plan"]["members"] if m != leader)
    epoch = ring.status("kill-member")["epoch"]
    ring.daemons[victim].kill9()
    st = ring.wait_state("kill-member", ("done", "failed"))
    assert st["state"] == "done", st
    assert st["epoch"] != epoch and victim not in st["plan"]["members"]
    assert st["restarts"] == 0, "losing a member is not a failure of the job"
    check_history(st, reference)
    # the morph says what happened in our words first: which VM, and what the job does now
    lost = [m for m in st["morphs"] if victim in m["reason"]]
    assert lost and lost[0]["reason"].startswith(f"{victim} was lost ("), st["morphs"]
    assert "re-planning on the VMs left" in lost[0]["reason"] and "[rank" not in lost[0]["reason"], lost[0]
    assert lost[0]["cause"] == f"{victim} was lost" and not lost[0]["restart"]
    # one replica per stage (P x 1): the lost VM's stage has no survivor, so the new epoch resumes
    # from the store, and the morph record says which stage and why
    assert lost[0]["source"] == "checkpoint" and f"had no live replica ({victim})" in lost[0]["source_why"], lost[0]
    by_epoch = dict(sorted((int(e), tuple(r)) for e, r in st["epochs"].items()))
    assert by_epoch[lost[0]["to_epoch"]][0] == lost[0]["resumed_from"], (by_epoch, lost[0])
    # the epoch after the loss fenced the store where it resumed, and wrote its epoch into its checkpoints
    # (so nothing the lost epoch's workers committed after that could be loaded: trainer.checkpoint.fences)
    from trainer.checkpoint.fences import read_epoch_fences
    from trainer.checkpoint.reading import checkpoint_dir, verify
    store = str(ring.store_dir / "kill-member")
    assert read_epoch_fences(store).get(st["epoch"], -1) >= 6, read_epoch_fences(store)
    assert verify(checkpoint_dir(store, STEPS))["epoch"] == st["epoch"]
    # the status command a user runs says the same
    r = ring.varunactl("status", "kill-member", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {"job", "state", "step", "epoch", "plan", "loss_history"} <= doc.keys()
    assert doc["state"] == "done" and doc["step"] == STEPS and doc["loss_history"] == st["loss_history"]
    assert {"P", "D", "micro_batch_size"} <= doc["plan"].keys()
    text = ring.varunactl("status", "kill-member")
    assert text.returncode == 0 and f": {victim} was lost (" in text.stdout, text.stdout


@pytest.mark.chaos
def test_kill9_in_a_2x2_resumes_from_the_survivors_memory(healthy, reference):
    """Every stage keeps a live replica when one VM of a 2x2 job dies: the survivors abandon the
    broken step, save the step they hold, and the new epoch starts there. No step is trained twice."""
    ring = healthy
    # a checkpoint every 12 steps: the store's newest is well behind the step the VM dies in
    with _a_2x2_job(ring, "replicas", every=12):
        st = ring.wait_step("replicas", 15)
        epoch = st["epoch"]
        leader = ring.leader()
        victim = "d4" if leader != "d4" else next(m for m in st["plan"]["members"] if m != leader)
        killed_at = time.time()
        ring.daemons[victim].kill9()
        st = ring.wait_state("replicas", ("done", "failed"))
        assert st["state"] == "done", st
        assert st["restarts"] == 0 and victim not in st["plan"]["members"], st
        ranges = dict(check_history(st, reference, every=0))   # every step once: none redone
        lost = next(m for m in st["morphs"] if m["from_epoch"] == epoch)
        assert lost["source"] == "replicas" and lost["cause"] == f"{victim} was lost", lost
        assert ranges[lost["to_epoch"]][0] == ranges[epoch][1] + 1 == lost["resumed_from"] > 12, (ranges, lost)
        from trainer.checkpoint.reading import checkpoint_dir, verify
        manifest = verify(checkpoint_dir(str(ring.store_dir / "replicas"), lost["resumed_from"]))
        assert manifest["meta"]["source"] == "replicas" and manifest["epoch"] == epoch, manifest
        text = ring.varunactl("status", "replicas", "--json")
        assert json.loads(text.stdout)["morphs"][-1]["source"] == "replicas", text.stdout
        # the spares of the first epoch imported after its traced steps (5 from step 0), not beside them
        started = [int(m) for n in NAMES + ["d4"] for m in re.findall(
            rf"starting spare workers after step (\d+) of replicas epoch {epoch}\b", ring.daemons[n].log_text())]
        assert started and min(started) >= 4, started
        # the survivors' daemons started the new epoch's workers in spares, torch already imported
        spared = [n for n in st["plan"]["members"]
                  if f"epoch {lost['to_epoch']} runs in the spare of slot 0" in ring.daemons[n].log_text()]
        assert spared, "no worker of the new epoch ran in a spare"
        # ... one that had imported what the job's script imports (trainer.spare --imports-of)
        ahead = [n for n in spared if re.search(rf"imported \d+ modules \S*{JOB_SCRIPT.name} imports",
                                                (ring.base / n / "spares" / "slot0.log").read_text())]
        assert ahead, "no spare imported the job's script's imports"
        # ... and loaded the model their VM exported in the epoch before: one kept program per VM,
        # written before the kill (a worker that exported again would have written it anew)
        for n in st["plan"]["members"]:
            kept = list((ring.base / n / "captures" / "replicas").glob("*/capture-*.pt2"))
            assert len(kept) == 1 and kept[0].stat().st_mtime < killed_at, (n, kept)


def test_a_morph_with_dropout_trains_the_plain_loops_model(healthy):
    """With dropout 0.1 the model depends on every mask: a 2x2 job that loses a VM and goes on
    at another P x D from the survivors' memory still trains, step for step, what the plain
    single-process loop over the keyed-random capture trains (tests/support/reference.py), so a morph
    does not change the model."""
    ring = healthy
    reference = keyed_reference_run(STEPS, BATCH, dropout=0.1)
    # the masks matter: without them the losses differ by more than the comparison allows
    plain = reference_run(STEPS, BATCH)[0]
    assert any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(reference, plain))
    with _a_2x2_job(ring, "dropout", every=6, script_args=("--dropout", "0.1")):
        st = ring.wait_step("dropout", 8)
        epoch, leader = st["epoch"], ring.leader()
        victim = "d4" if leader != "d4" else next(m for m in st["plan"]["members"] if m != leader)
        ring.daemons[victim].kill9()
        st = ring.wait_state("dropout", ("done", "failed"))
        assert st["state"] == "done", st
        lost = next(m for m in st["morphs"] if m["from_epoch"] == epoch)
        # another P x D, resumed from the survivors' memory (every stage of the 2x2 kept a replica)
        assert lost["from"] != lost["to"] and lost["source"] == "replicas", lost
        check_history(st, reference, every=0)   # and no step trained twice


@pytest.mark.chaos
def test_losing_both_replicas_of_a_stage_falls_back_to_the_store(healthy, reference):
    """Two VMs of a 2x2 job die at once, and they held both replicas of one stage: that stage's
    state survives nowhere, so the new epoch resumes from the store's checkpoint and says why."""
    ring = healthy
    with _a_2x2_job(ring, "both", every=6):
        ring.wait_checkpoint("both", 6)
        st = ring.wait_step("both", 8)
        epoch, leader = st["epoch"], ring.leader()
        # the stage none of whose replicas runs on the leader; the second VM dies while the
        # survivors of the first loss may already be saving their state
        stage_of = _stage_members(ring)
        stage = next(s for s, ms in stage_of.items() if leader not in ms)
        victims = sorted(stage_of[stage])
        assert len(victims) == 2, stage_of
        for v in victims:
            ring.daemons[v].kill9()
        st = ring.wait_state("both", ("done", "failed"))
        assert st["state"] == "done", st
        check_history(st, reference, every=6)
        lost = next(m for m in st["morphs"] if m["from_epoch"] == epoch)
        assert lost["source"] == "checkpoint" and lost["resumed_from"] >= 6, lost
        assert f"stage {stage} had no live replica ({', '.join(victims)})" in lost["source_why"], lost
        # the checkpoint carried the losses before it into the history of the epoch that trained
        # them (a daemon lost right after it would have taken them along), and no step is missing
        kept = ring.call(ring.store.get(ring.keys.history_entry("both", epoch, "checkpoint", lost["resumed_from"])))
        assert kept is not None and st["unrecorded"] == [], (kept, st["unrecorded"])


@contextlib.contextmanager
def _a_2x2_job(ring, job: str, *, every: int, script_args: tuple[str, ...] = ()):
    """d4 joins d1..d3 and `job` runs as 2x2 (its calibration makes data parallelism nearly free);
    d4 leaves again afterwards, if it is still alive."""
    d4 = ring.start("d4")
    try:
        ring.wait_members(NAMES + ["d4"])
        ring.submit(job, steps=STEPS, every=every, script_args=SLEEP + ("--cheap-allreduce", *script_args))
        st = ring.wait_step(job, 2, timeout=180)
        assert (st["plan"]["P"], st["plan"]["D"]) == (2, 2), st["plan"]
        yield
    finally:
        if d4.alive:
            d4.proc.send_signal(signal.SIGTERM)
            d4.proc.wait(60)


def _stage_members(ring) -> dict[int, set[str]]:
    """stage -> the members running it, from the plan in etcd."""
    from varunad.control.fleet import read_plan

    doc, _ = ring.call(read_plan(ring.store, ring.keys, timeout=5.0))
    return doc.members_by_stage()


@pytest.mark.chaos  # the chaos suite's kill -9 of this kind (tests/integration/chaos/ does not repeat it)
def test_a_store_emptied_under_a_running_job_is_named_when_it_resumes_from_scratch(healthy):
    """A storage probe's `rm -rf` of a running job's checkpoints, then a lost VM: the job resumed
    from scratch under an INFO line that read like a first start ('no complete checkpoint yet'),
    though 51 checkpoints had been written. Now the morph record says the store lost them."""
    import shutil

    ring = healthy
    ring.submit("emptied", steps=STEPS, script_args=SLEEP)
    st = ring.wait_step("emptied", 2)
    assert st["plan"]["P"] >= 2 and st["plan"]["D"] == 1, st["plan"]   # a lost VM takes a stage's only replica
    ring.wait_checkpoint("emptied", 6)
    victim = next(m for m in st["plan"]["members"] if m != ring.leader())
    ring.daemons[victim].kill9()
    for ckpt in (ring.store_dir / "emptied").glob("varuna_ckpt_*"):
        shutil.rmtree(ckpt, ignore_errors=True)
    st = ring.wait_state("emptied", ("done", "failed"))
    assert st["state"] == "done", st
    lost = next(m for m in st["morphs"] if victim in m["reason"])
    assert lost["source"] == "scratch" and lost["resumed_from"] == 0, lost
    assert f"had no live replica ({victim})" in lost["source_why"], lost
    assert "holds no complete checkpoint, though the job trained to step" in lost["source_why"], lost


def test_kill9_of_the_leader_elects_another_within_a_ttl_and_the_job_finishes(healthy, reference):
    ring = healthy
    ring.submit("kill-leader", steps=STEPS, script_args=SLEEP)
    ring.wait_step("kill-leader", 2)
    ring.wait_checkpoint("kill-leader", 6)
    old = ring.leader()
    assert old is not None
    killed = time.monotonic()
    ring.daemons[old].kill9()
    new = ring.poll(lambda: (name := ring.leader()) not in (None, old) and name, timeout=3 * TTL,
                    what="a new leader", interval=0.05)
    elapsed = time.monotonic() - killed
    print(f"\n{new} leads {elapsed:.2f}s after {old} was killed (TTL {TTL:g}s)")
    assert elapsed < TTL + 2.5, f"{new} took {elapsed:.1f}s to lead after {old} died (TTL {TTL}s)"
    st = ring.wait_state("kill-leader", ("done", "failed"))
    assert st["state"] == "done", st
    assert old not in st["plan"]["members"]
    check_history(st, reference)


def test_scale_up_then_a_preemption_notice(healthy, reference):
    ring = healthy
    # slower steps: the leader takes d4 in once its spare has imported torch (seconds on this host),
    # and the job must still run then, and through the notice after
    ring.submit("scale", steps=STEPS, script_args=("--step-sleep", "0.7"))
    st = ring.wait_step("scale", 3)
    first = st["epoch"]
    d4 = ring.start("d4", "--scale-up-threshold", "0")
    try:
        st = ring.poll(lambda: (s := ring.status("scale"))["epoch"] != first and "d4" in s["plan"]["members"] and s,
                       timeout=90, what="a scale-up morph onto d4")
        morph = st["morphs"][-1]
        assert morph["checkpoint"] and "d4" in morph["reason"], morph
        # the leader took d4 in once its spare had imported torch: its first worker did not wait for an import
        first = f"epoch {morph['to_epoch']} runs in the spare of slot 0"
        # the status shows the plan the moment it is written; d4 starts its worker a moment later
        started = f"started 1 worker(s) of scale epoch {morph['to_epoch']} "
        ring.poll(lambda: started in ring.daemons["d4"].log_text(), timeout=30, what="d4's first worker of the new epoch")
        assert f"{first} (pid" in ring.daemons["d4"].log_text(), "d4's first worker did not start in a spare"
        assert "its imports done" in ring.daemons["d4"].log_text().split(first, 1)[1].splitlines()[0]
        ring.wait_step("scale", max(st["step"], 0) + 2)
        # SIGTERM (a preemption notice) to a member of the plan that does not lead
        victim = "d4" if ring.leader() != "d4" else next(m for m in st["plan"]["members"] if m != "d4")
        before = ring.status("scale")["epoch"]
        sent = time.monotonic()
        ring.daemons[victim].proc.send_signal(signal.SIGTERM)
        gone = ring.poll(lambda: not ring.member_present(victim) and time.monotonic(), timeout=60,
                         what=f"{victim}'s member key to disappear", interval=0.05)
        ring.daemons[victim].proc.wait(30)
        exited = time.monotonic()
        print(f"\n{victim}: member key gone {gone - sent:.2f}s, process exited {exited - sent:.2f}s after SIGTERM")
        # the key went with the revoked lease while the daemon was still leaving, not a TTL later
        assert gone <= exited + 0.5, f"member key gone {gone - sent:.1f}s, process exit {exited - sent:.1f}s after SIGTERM"
        st = ring.poll(lambda: (s := ring.status("scale"))["epoch"] != before and s["state"] == "running"
                       and victim not in s["plan"]["members"] and s, timeout=60, what="a morph without the leaver")
        notice = st["morphs"][-1]
        assert notice["checkpoint"] and "preemption notice" in notice["reason"], notice
        st = ring.wait_state("scale", ("done", "failed"))
        assert st["state"] == "done", st
        ranges = check_history(st, reference)
        # the notice's checkpoint is taken at the step where every worker stopped: nothing is redone
        by_epoch = dict(ranges)
        assert by_epoch[notice["to_epoch"]][0] == by_epoch[notice["from_epoch"]][1] + 1, ranges
    finally:
        if d4.alive:
            d4.proc.send_signal(signal.SIGTERM)
            d4.proc.wait(60)


def test_etcd_paused_below_a_ttl_is_not_a_morph(healthy, ring_etcd, reference):
    ring = healthy
    ring.submit("pause", steps=STEPS, script_args=SLEEP)
    st = ring.wait_step("pause", 4)
    epoch, morphs, leader = st["epoch"], len(st["morphs"]), ring.leader()
    with ring_etcd.paused():
        time.sleep(TTL / 2)  # the fault itself: etcd frozen for half a TTL
    st = ring.wait_state("pause", ("done", "failed"))
    assert st["state"] == "done", st
    assert (st["epoch"], len(st["morphs"])) == (epoch, morphs), st["morphs"]
    assert ring.leader() == leader
    check_history(st, reference)


def test_garbage_and_a_hand_written_bad_spec_are_refused_and_logged(healthy, curve_keys):
    ring = healthy
    target = ring.daemons["d2"]
    member = json.loads(ring.call(ring.store.get(ring.keys.member("d2"))).value)
    endpoint = member["endpoint"]
    host, port = endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    # raw bytes that are not ZMTP at all
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(os.urandom(512))
    # an authenticated client (the operator's key) sending garbage, another version, extra frames
    from protocol.security import Security, SecurityConfig

    sec = Security(SecurityConfig(mode="curve", secret_key_file=str(curve_keys / "operator.key_secret"),
                                  allowed_keys_dir=str(curve_keys)))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sec.apply_control_client(sock, sec.member_public_key("d2"))
    sock.connect(endpoint)
    try:
        bad_version = bytearray(encode(Ping(sender="operator", nonce=1)))
        bad_version[1] = 2  # [PROTOCOL_VERSION=2, ...]
        sock.send(os.urandom(64))
        sock.send(bytes(bad_version))
        sock.send_multipart([b"a", b"b"])
        sock.send(encode(Ping(sender="operator", nonce=7)))
        assert sock.poll(10_000), "the daemon stopped answering after garbage"
        reply = decode(sock.recv())
        assert isinstance(reply, Pong) and reply.nonce == 7
    finally:
        sock.close(0)
        ctx.term()
    ring.poll(lambda: target.log_text().count("dropped a malformed control message") >= 3, timeout=10,
              what="three dropped messages in d2's log")
    assert target.alive
    # garbage on the local worker socket too
    line = next(ln for ln in target.log_text().splitlines() if "worker control socket at" in ln)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(line.rsplit(" ", 1)[1])
    sock.send(b"\xc1garbage")
    sock.close()
    ctx.term()
    ring.poll(lambda: "dropped a malformed message on the worker socket" in target.log_text(), timeout=10,
              what="the worker socket's drop in d2's log")
    # a spec written by hand that is not a spec: that job fails with the reason, the fleet carries on
    ring.call(ring.store.put(ring.keys.job("handmade"), b'{"job": "handmade", "script": 5'))
    st = ring.wait_state("handmade", ("failed",), timeout=30)
    assert "not JSON" in st["reason"], st
    assert all(ring.daemons[n].alive for n in NAMES)
    assert set(NAMES) <= set(ring.members())


def test_a_worker_that_fails_the_same_way_twice_fails_the_job(healthy):
    ring = healthy
    ring.submit("crash", steps=8, script_args=("--fail-at", "1"))
    st = ring.wait_state("crash", ("done", "failed"), timeout=240)
    assert st["state"] == "failed", st
    # one fresh start to see whether it repeats; it does, word for word: no more restarts
    assert st["restarts"] == 1 and "again on a fresh start" in st["reason"], st
    # the reason leads with what the script printed last, then which worker
    assert st["reason"].startswith("exit code 3 after printing: failing on purpose (rank 0 on d") and "exited with code 3" in st["reason"], st
    assert st["morphs"] and all(m["restart"] for m in st["morphs"]), st["morphs"]   # restarts, not morphs
    assert "failing on purpose" in (st["error"] or "") or "exited with code 3" in (st["error"] or ""), st["error"]
    r = ring.varunactl("logs", "crash")
    assert r.returncode == 0 and "failing on purpose" in r.stdout, r.stdout[-2000:]
    r = ring.varunactl("jobs")
    assert r.returncode == 0 and "crash" in r.stdout and "failed" in r.stdout
    r = ring.varunactl("nodes")
    assert r.returncode == 0 and all(n in r.stdout for n in NAMES), r.stdout
    r = ring.varunactl("logs", "crash", "--follow", timeout=60)  # returns once the job has ended
    assert r.returncode == 0 and "failing on purpose" in r.stdout


def test_values_a_hand_wrote_do_not_end_or_stall_a_running_job_and_cancel_stops_it(healthy):
    """A probe's hand-written values each broke a running job: a "done" state ended it, a progress
    record of step 1e9 restarted it as stuck, a history chunk of step 1e999 crashed `varunactl status`."""
    ring = healthy
    ring.submit("cancel-me", steps=500, script_args=SLEEP)
    st = ring.wait_step("cancel-me", 1)
    put = lambda key, value: ring.call(ring.store.put(key, value))   # noqa: E731
    put(ring.keys.progress_of("cancel-me") + "zz", json.dumps({
        "job": "cancel-me", "epoch": st["epoch"], "rank": 0, "step": 10**9, "loss": 1.0, "samples_per_s": 1.0,
        "busy_fraction": 0.5}))
    put(ring.keys.history_entry("cancel-me", st["epoch"], "d9", 0), '{"steps": [[1e999, 0.0]]}')
    put(ring.keys.state("cancel-me"), json.dumps({"job": "cancel-me", "state": "done"}))
    # the leader writes its own state back, and the job trains on in the same epoch
    ring.poll(lambda: (s := ring.status("cancel-me"))["state"] == "running" and s["step"] >= st["step"] + 3,
              timeout=60, what="cancel-me running on past the hand-written values")
    assert "was changed by someone other than the leader" in ring.daemons[ring.leader()].log_text()
    r = ring.varunactl("status", "cancel-me")
    assert r.returncode == 0 and "of 500" in r.stdout, r.stdout + r.stderr
    st2 = ring.status("cancel-me")
    assert st2["epoch"] == st["epoch"] and st2["restarts"] == 0 and st2["step"] < 500, st2
    r = ring.varunactl("cancel", "cancel-me", "--wait", "30")
    assert r.returncode == 0 and "cancel-me is cancelled" in r.stdout, r.stdout + r.stderr
    st = ring.status("cancel-me")
    assert st["state"] == "cancelled" and st["step"] < 500

    def no_workers():
        reports = ring.call(ring.store.get_prefix(ring.keys.workers))
        return all(not any(w["outcome"] in ("starting", "running") for w in json.loads(kv.value)["workers"])
                   for kv in reports)

    ring.poll(no_workers, timeout=30, what="every worker of the cancelled job gone")
    r = ring.varunactl("cancel", "cancel-me")
    assert r.returncode == 1 and "already cancelled" in r.stderr
