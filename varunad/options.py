"""The argument parser of varunactl and varunad: option names exactly as written, and a misspelt
one named with what it was probably meant to be.

argparse takes any unique prefix (`--step 5` for `--steps`, `--stor` for `--store`), so a
shortened option works until a new option shares its prefix; and a misspelt required option
(`--chekpoint-every 5`) is reported as the required one missing, without naming the typo.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` without abbreviations, whose errors name unknown options."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        given = list(sys.argv[1:] if args is None else args)
        # what follows "--" is the script's, never an option of ours
        self._given = given[:given.index("--")] if "--" in given else given
        return super().parse_known_args(args, namespace)

    def _options(self) -> list[str]:
        """This parser's option strings and its subcommands' (an error of the top level's may
        be about any of them)."""
        found = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += sub._options() if isinstance(sub, Parser) else list(sub._option_string_actions)
        return found

    def error(self, message: str) -> NoReturn:
        known = self._options()
        unknown = [a.split("=", 1)[0] for a in self._given
                   if a.startswith("--") and a.split("=", 1)[0] not in known and a != "--"]
        hints = []
        for option in unknown:
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.7)
            hints.append(f"unknown option {option}" + (f" (did you mean {close[0]}?)" if close else ""))
        super().error("; ".join(hints + [message]) if hints else message)
