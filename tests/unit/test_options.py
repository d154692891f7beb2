"""varunactl's and varunad's option parsing (varunad.options): names as written, typos named."""

from __future__ import annotations

import io
from contextlib import redirect_stderr

import pytest

from varunad import __version__
from varunad.ctl import cli
from varunad.node.config import build_parser


def _error(argv: list[str]) -> str:
    err = io.StringIO()
    with redirect_stderr(err):
        assert cli.main(argv) == 2
    return err.getvalue()


def test_a_misspelt_option_is_named_with_the_one_meant():
    said = _error(["submit", "--name", "x", "--batch-size", "8", "--steps", "3", "--chekpoint-every", "5", "t.py"])
    assert "unknown option --chekpoint-every (did you mean --checkpoint-every?)" in said, said
    said = _error(["--etcd", "127.0.0.1:9", "status", "--jsn"])
    assert "unknown option --jsn (did you mean --json?)" in said, said


def test_a_shortened_option_is_refused_not_guessed():
    # argparse took any unique prefix: `--step 5` set --steps, until an option shares the prefix
    said = _error(["submit", "--name", "x", "--batch-size", "8", "--step", "3", "--checkpoint-every", "5", "t.py"])
    assert "unknown option --step (did you mean --steps?)" in said, said
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--etcd", "127.0.0.1:2379", "--stor", "/tmp/x"])


def test_what_follows_the_double_dash_is_the_scripts_and_version_is_printed(capsys):
    parser = cli._parser()
    ns = parser.parse_args(["submit", "--name", "x", "--batch-size", "8", "--steps", "3", "--checkpoint-every", "3",
                            "t.py", "--", "--chekpoint", "--step"])
    assert ns.name == "x" and "--chekpoint" in ns.script_args
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"varunactl {__version__}"
