"""`varunactl keys generate|show`: files, modes, refusals, one-line errors."""

from __future__ import annotations

import os
import stat

import pytest

from protocol.security import load_key_pair, load_public_key
from varunad.ctl.cli import main


def test_generate_then_show(tmp_path, capsys):
    assert main(["keys", "generate", "--dir", str(tmp_path / "keys"), "--name", "vm-1"]) == 0
    public, secret = tmp_path / "keys" / "vm-1.key", tmp_path / "keys" / "vm-1.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    out = capsys.readouterr().out
    assert str(public) in out and str(secret) in out
    assert main(["keys", "show", str(public)]) == 0
    shown = capsys.readouterr().out.strip()
    assert shown.encode() == load_public_key(public) == load_key_pair(secret)[0]
    assert main(["keys", "show", str(secret)]) == 0   # the secret file names its public key too
    assert capsys.readouterr().out.strip() == shown


def test_generate_refuses_to_overwrite_without_force(tmp_path, capsys):
    args = ["keys", "generate", "--dir", str(tmp_path), "--name", "vm-1"]
    assert main(args) == 0
    before = load_key_pair(tmp_path / "vm-1.key_secret")
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err
    assert load_key_pair(tmp_path / "vm-1.key_secret") == before
    assert main([*args, "--force"]) == 0
    assert load_key_pair(tmp_path / "vm-1.key_secret") != before


@pytest.mark.parametrize("args, words", [
    (["keys", "show", "/nonexistent/x.key"], "does not exist"),
    (["keys", "generate", "--dir", "{tmp}", "--name", "a/b"], "no slashes"),
])
def test_errors_are_one_line_on_stderr(tmp_path, capsys, args, words):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and words in captured.err and captured.err.startswith("varunactl keys:")


def test_show_refuses_a_file_that_is_not_a_key(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    assert main(["keys", "show", str(path)]) == 1
    assert "no public key" in capsys.readouterr().err


def test_help_and_usage_errors(capsys):
    assert main(["--help"]) == 0
    assert "keys" in capsys.readouterr().out
    assert main(["keys", "generate", "--help"]) == 0
    assert "--force" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["keys", "generate", "--name", "x"]) == 2   # --dir is required
    assert "--dir" in capsys.readouterr().err


