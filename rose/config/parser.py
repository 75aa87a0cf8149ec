"""The argument parser of rose's commands (`rose`, `rose-worker`): argparse, plus `--version` and, for a flag it
does not know, the flag it most likely meant (`--temprature: did you mean --temperature?`).

argparse reports a subcommand's unknown flags from the top-level parser, which does not know the subcommand's
flags; `Parser.parse_args` therefore reports them from the subcommand's parser. The only module that reads
argparse's parser internals (`_actions`).
"""

from __future__ import annotations

import argparse
import difflib
from importlib import metadata
from typing import Any, NoReturn

DISTRIBUTION = "rose-worker"  # pyproject's name


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def suggestion(flag: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of `parser` closest to `flag` (a misspelling), or None."""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
    return close[0] if close else None


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with `--version` and suggestions for unknown flags (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands: argparse._SubParsersAction | None = None
        self._command_dest: str | None = None

    def add_version(self) -> None:
        self.add_argument("--version", action="version", version=f"%(prog)s {version()}")

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        self._commands = super().add_subparsers(**kwargs)
        self._command_dest = kwargs.get("dest")
        return self._commands

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            target: argparse.ArgumentParser = self
            command = getattr(parsed, self._command_dest, None) if self._command_dest else None
            if self._commands is not None and command in self._commands.choices:
                target = self._commands.choices[command]
            unrecognized(target, extras)
        return parsed


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> NoReturn:
    """Exit with argparse's usage error for `extras`, naming the flag each unknown one most likely meant."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    hints = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            meant = suggestion(flag, parser)
            if meant is not None:
                hints.append(f"{flag}: did you mean {meant}?")
    if hints:
        message += " (" + "; ".join(hints) + ")"
    parser.error(message)
