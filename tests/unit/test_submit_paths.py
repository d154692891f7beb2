"""varunactl submit's note on a script argument that names a file from the submitting directory
but not from the script's own, where its workers run (varunad.ctl.commands.misplaced_paths)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr

from varunad.ctl import cli
from varunad.ctl.commands import misplaced_paths


def _tree(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text("print('hi')\n")
    (job / "input.txt").write_text("data\n")
    return job


def test_a_path_from_here_that_the_scripts_directory_lacks_is_named(tmp_path):
    """A probe's `-- --data job/input.txt` failed at calibration with FileNotFoundError: the
    workers run in the script's directory, where it is `input.txt`."""
    _tree(tmp_path)
    args = ["--data", "job/input.txt", "--out=job/train.py", "--steps", "3", "input.txt", "/etc/hostname", "-v"]
    assert misplaced_paths("job/train.py", args, cwd=str(tmp_path)) == ["job/input.txt", "job/train.py"]
    # from inside the script's directory every one of them names what the workers will find
    assert misplaced_paths("train.py", ["--data", "input.txt"], cwd=str(tmp_path / "job")) == []
    # an argument no path could be (a long prompt) is no path
    assert misplaced_paths("job/train.py", ["--prompt", "x" * 300, "a\0b"], cwd=str(tmp_path)) == []


def test_submit_prints_the_note_before_it_reaches_etcd(tmp_path, monkeypatch):
    _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with redirect_stderr(err):
        # no etcd at this address: the note comes first, then the connection fails
        cli.main(["--etcd", "127.0.0.1:9", "--timeout", "0.5", "submit", "--name", "x", "--batch-size", "8",
                  "--steps", "3", "--checkpoint-every", "3", "job/train.py", "--", "--data", "job/input.txt"])
    assert "'job/input.txt' is a path from this directory, but the script runs in its own directory's copy" in (
        err.getvalue()), err.getvalue()
    assert "give it as 'input.txt', relative to the script" in err.getvalue()
