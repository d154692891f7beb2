"""varunactl's duration options take a finite number of seconds above 0 (a few, 0 or more): `watch
--interval 0` polled as fast as it could and `--interval -1` was taken without a word."""

from __future__ import annotations

import pytest

from varunad.ctl.cli import main


@pytest.mark.parametrize("argv, words", [
    (["watch", "j", "--interval", "0"], "--interval: must be more than 0 seconds, got 0"),
    (["watch", "j", "--interval", "-1"], "--interval: must be more than 0 seconds, got -1"),
    (["--timeout", "nan", "status"], "--timeout: must be more than 0 seconds, got nan"),
    (["up", "2", "--ttl", "soon"], "--ttl: 'soon' is not a number of seconds"),
    (["down", "--grace", "-5"], "--grace: must be 0 or more seconds, got -5"),
])
def test_a_bad_duration_is_refused_with_its_option(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err
