"""The local ring (`varunactl up/down`), live progress, and the README's demo in its --quick size.

Progress rendering is tested on status documents alone; the ring tests start the real etcd binary
and real daemons, and check with psutil that `down` leaves no process of theirs behind.
"""

from __future__ import annotations

import pytest

from varunad.ctl import cli, local, progress


def status_doc(step: int, *, state: str = "running", P: int = 2, D: int = 2, epoch: int = 117,
               loss: float | None = 2.4123, rate: float | None = 84.2, morphs: tuple = (),
               reason: str = "planned") -> dict:
    """The fields of `varunactl status JOB --json` that progress reads."""
    return {"job": "gpt", "state": state, "reason": reason, "step": step, "epoch": epoch, "loss": loss,
            "samples_per_s": rate, "plan": {"P": P, "D": D, "micro_batch_size": 4}, "morphs": list(morphs)}


MORPH = {"reason": "vm3 left the fleet (its lease ended)", "from": "2x2", "to": "3x1", "duration_s": 4.81}


# --- progress ------------------------------------------------------------------------------------------

def test_bar_line_shows_step_loss_rate_plan_and_epoch():
    assert progress.bar_line(status_doc(30), 100) == \
        "gpt [######..............] 30/100 loss 2.412 84 samples/s 2x2 mb 4 epoch 117"
    queued = status_doc(0, state="queued", P=None, loss=None, rate=None, reason="calibrating gpt on vm1")
    assert progress.bar_line(queued, 100) == "gpt [....................] 0/100 queued (calibrating gpt on vm1)"
    assert progress.plain_line(queued, 100) == "gpt 0/100 queued (calibrating gpt on vm1)"
    # a log has room for the whole reason; the terminal's one redrawn line does not (a probe's CI log
    # read "(then 2 slots of its machine busy at…)")
    long = "calibrating gpt on vm1 (then 2 slots of its machine busy at once, to measure shared cores)"
    queued = {**queued, "reason": long}
    assert progress.plain_line(queued, 100) == f"gpt 0/100 queued ({long})"
    assert progress.bar_line(queued, 100).endswith("…)") and long not in progress.bar_line(queued, 100)
    # a calibration says how long it has run on the redrawn bar; a log's line, written on change, does not
    # (minutes of the same words read as stuck: a probe's loaded host calibrated for 5.5 minutes)
    calibrating = status_doc(0, state="queued", P=None, loss=None, rate=None, reason="calibrating gpt on vm1")
    assert progress.bar_line({**calibrating, "calibrating_s": 130.4}, 100).endswith("(calibrating gpt on vm1, 2m10s)")
    assert progress.plain_line({**calibrating, "calibrating_s": 130.4}, 100) == progress.plain_line(calibrating, 100)
    shown = progress.start("gpt", 100, tty=False)
    shown, text = progress.advance(shown, {**calibrating, "calibrating_s": 5.0}, now=0.0)
    assert text
    shown, text = progress.advance(shown, {**calibrating, "calibrating_s": 6.0}, now=1.0)
    assert text == ""


def test_terminal_output_redraws_one_line_and_prints_each_morph_once():
    shown = progress.start("gpt", 100, tty=True)
    shown, text = progress.advance(shown, status_doc(30), now=0.0)
    assert text == "\r\x1b[K" + progress.bar_line(status_doc(30), 100)
    shown, text = progress.advance(shown, status_doc(30), now=1.0)
    assert text == ""  # nothing changed: nothing written
    morphed = status_doc(31, P=3, D=1, morphs=(MORPH,))
    shown, text = progress.advance(shown, morphed, now=2.0)
    assert text == "\r\x1b[Kmorph 2x2 -> 3x1 (stopped, re-planned in 4.8s): vm3 left the fleet (its lease ended)\n" + \
        progress.bar_line(morphed, 100)
    shown, text = progress.advance(shown, status_doc(32, P=3, D=1, morphs=(MORPH,)), now=3.0)
    assert "morph" not in text and text.startswith("\r\x1b[K")
    assert progress.finish(shown) == "\n"


def test_plain_output_is_lines_throttled_by_steps_with_morphs_once():
    shown = progress.start("gpt", 100, tty=False, every_steps=10, every_s=1e9)
    out = []
    for step in range(0, 25):
        shown, text = progress.advance(shown, status_doc(step), now=float(step))
        out.append(text)
    lines = "".join(out).splitlines()
    assert lines == ["gpt 0/100 running: loss 2.412 84 samples/s 2x2 mb 4 epoch 117",
                     "gpt 10/100 running: loss 2.412 84 samples/s 2x2 mb 4 epoch 117",
                     "gpt 20/100 running: loss 2.412 84 samples/s 2x2 mb 4 epoch 117"]
    assert "\r" not in "".join(out) and "\x1b" not in "".join(out)
    # a new plan is a line at once, its morph a line of its own, printed once
    shown, text = progress.advance(shown, status_doc(21, P=3, D=1, epoch=130, morphs=(MORPH,)), now=30.0)
    assert text.splitlines() == ["morph 2x2 -> 3x1 (stopped, re-planned in 4.8s): vm3 left the fleet (its lease ended)",
                                 "gpt 21/100 running: loss 2.412 84 samples/s 3x1 mb 4 epoch 130"]
    shown, text = progress.advance(shown, status_doc(22, P=3, D=1, epoch=130, morphs=(MORPH,)), now=31.0)
    assert text == ""
    shown, text = progress.advance(shown, status_doc(100, state="done", P=3, D=1, epoch=130, morphs=(MORPH,)),
                                   now=32.0)
    assert text == "gpt 100/100 done: loss 2.412 3x1 mb 4 epoch 130\n"
    assert progress.finish(shown) == ""


def test_a_morph_is_closed_by_a_resumed_line_once_its_epoch_trained_a_step():
    shown = progress.start("gpt", 100, tty=False, every_steps=1000, every_s=1e9)
    morph = {**MORPH, "to_epoch": 130, "noticed_at": 1000.0}
    waiting = {**status_doc(30, state="morphing", P=3, D=1, epoch=130, morphs=(morph,)), "epochs": {"117": [0, 30]}}
    shown, text = progress.advance(shown, waiting, now=1.0, wall=1003.0)
    assert "resumed" not in text and text.startswith("morph 2x2 -> 3x1")
    trained = {**status_doc(21, P=3, D=1, epoch=130, morphs=(morph,)), "epochs": {"117": [0, 30], "130": [20, 21]}}
    shown, text = progress.advance(shown, trained, now=2.0, wall=1012.34)
    assert text.splitlines()[0] == "resumed at step 20 in epoch 130, 12.3s after the morph began"
    shown, text = progress.advance(shown, {**trained, "step": 22}, now=3.0, wall=1013.0)
    assert "resumed" not in text  # once
    # with the epochs' wall-clock spans, the whole stall: from the old epoch's last step (before the
    # leader noticed the loss) to the new epoch's first
    shown = progress.start("gpt", 100, tty=False, every_steps=1000, every_s=1e9)
    shown, _ = progress.advance(shown, waiting, now=1.0, wall=1003.0)
    spans = {"117": [900.0, 991.5], "130": [1012.0, 1012.0]}
    shown, text = progress.advance(shown, {**trained, "epoch_spans": spans}, now=2.0, wall=1012.34)
    assert text.splitlines()[0] == ("resumed at step 20 in epoch 130 after training stood still 20.5s "
                                    "(the report counts the same)")


def test_a_resumed_epoch_says_which_steps_it_redoes_and_why():
    doc = {**status_doc(24, P=1, D=1, epoch=130), "redoing": {"first": 20, "last": 29, "cause": "vm4 was lost"}}
    assert progress.plain_line(doc, 60).endswith("1x1 mb 4 epoch 130 redoing steps 20-29 after vm4 was lost")
    assert progress.bar_line(doc, 60).endswith("redoing steps 20-29 after vm4 was lost")
    assert "redoing" not in progress.plain_line({**doc, "redoing": None}, 60)


def test_plain_output_also_prints_after_every_s_seconds():
    shown = progress.start("gpt", 1000, tty=False, every_steps=100, every_s=30.0)
    shown, _ = progress.advance(shown, status_doc(1), now=0.0)
    shown, text = progress.advance(shown, status_doc(2), now=10.0)
    assert text == ""
    shown, text = progress.advance(shown, status_doc(3), now=31.0)
    assert text.startswith("gpt 3/1000 running")


def test_a_restart_after_a_failure_is_not_called_a_morph():
    restart = MORPH | {"from": "1x2", "to": "1x2", "restart": True, "reason": "rank 0 on vm1 exited with code 1: E"}
    assert progress.morph_line(restart) == \
        "restart 1x2 after a worker failed (stopped, re-planned in 4.8s): rank 0 on vm1 exited with code 1: E"
    assert progress.morph_line(MORPH | {"restart": False}).startswith("morph 2x2 -> 3x1 ")


def test_morph_line_says_where_the_new_epoch_resumes_from():
    assert progress.morph_line(MORPH | {"source": "replicas", "resumed_from": 137}) == \
        "morph 2x2 -> 3x1 (stopped, re-planned in 4.8s, resuming from replicas at step 137): " \
        "vm3 left the fleet (its lease ended)"
    fallback = MORPH | {"source": "checkpoint", "resumed_from": 120, "source_why": "stage 1 had no live replica (vm3)"}
    assert "resuming from checkpoint 120 (stage 1 had no live replica (vm3))): vm3 left" in progress.morph_line(fallback)
    assert "resuming" not in progress.morph_line(MORPH | {"source": "", "resumed_from": -1})


def test_morph_line_is_one_line_even_when_the_reason_quotes_output():
    morph = MORPH | {"reason": "rank 0 on vm1 failed: exited with code 1; last output:\nTraceback (most recent..."}
    assert progress.morph_line(morph) == \
        "morph 2x2 -> 3x1 (stopped, re-planned in 4.8s): rank 0 on vm1 failed: exited with code 1; last output:"


# --- up and down ------------------------------------------------------------------------------------------

def test_missing_etcd_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(local.LocalRingError, match="apt-get install -y etcd-server"):
        local.up(1, tmp_path / "ring")
    assert cli.main(["up", "1", "--dir", str(tmp_path / "ring")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("varunactl up: no `etcd` binary on PATH; install it with") and err.count("\n") == 1


def test_down_without_a_ring_is_a_no_op(tmp_path, capsys):
    assert local.down(tmp_path) == []
    assert cli.main(["down", "--dir", str(tmp_path)]) == 0
    assert "no ring is up" in capsys.readouterr().out




def test_a_ring_larger_than_one_machine_should_run_is_refused_before_anything_starts(tmp_path, capsys):
    # an outside tester's `up 1000` filled 15 of 23 GB with daemons before it was stopped
    assert cli.main(["up", str(local.MAX_LOCAL_DAEMONS + 1), "--dir", str(tmp_path / "ring")]) == 1
    err = capsys.readouterr().err
    assert f"at most {local.MAX_LOCAL_DAEMONS}" in err and err.count("\n") == 1
    assert not (tmp_path / "ring").exists()


def test_a_ring_whose_etcd_stopped_is_named_where_etcd_cannot_be_reached(tmp_path, monkeypatch):
    """A probe restarted its ring's etcd by hand: varunactl then fell back to 127.0.0.1:2379 and
    said "no ring is up here?", with no word of the ring recorded in its directory."""
    import subprocess
    import sys

    from varunad.ctl.commands import _unreachable
    from varunad.ctl.local import Ring, RingProc, _write_ring, default_etcd

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()   # a pid that ran and is gone: the ring's etcd, stopped
    monkeypatch.setenv("VARUNAD_LOCAL_DIR", str(tmp_path))
    monkeypatch.delenv("VARUNAD_ETCD", raising=False)
    _write_ring(Ring(dir=str(tmp_path), etcd="127.0.0.1:19512", root="/r/", store=str(tmp_path / "store"), ttl=5.0,
                     etcd_proc=RingProc(name="etcd", pid=done.pid, create_time=0.0, log=str(tmp_path / "etcd.log"))))
    assert default_etcd() == "127.0.0.1:2379"
    words = str(_unreachable(default_etcd(), Exception("failed to connect: Connection refused"), 5.0))
    assert f"the local ring of {tmp_path} is down (its etcd at 127.0.0.1:19512 stopped)" in words, words
    assert "--etcd 127.0.0.1:19512" in words
    # an etcd someone named elsewhere is not the local ring's
    assert "no ring is up here?" in str(_unreachable("10.0.0.5:2379", Exception("Connection refused"), 5.0))
    (tmp_path / "ring.json").unlink()
    assert "no ring is up here?" in str(_unreachable("127.0.0.1:2379", Exception("Connection refused"), 5.0))
