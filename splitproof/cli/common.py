"""What every subcommand of the ``splitproof`` command shares: exit codes, one-line usage errors, number types."""

from __future__ import annotations

import argparse
import os

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are a :class:`UsageError` (one line, no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


def number(kind: type, check, expected: str):
    """An argparse type: ``kind(text)`` that must satisfy ``check``, else a one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = number(int, lambda v: v >= 1, "a positive integer")
positive_float = number(float, lambda v: 0 < v < float("inf"), "a positive finite number")
nonnegative_int = number(int, lambda v: v >= 0, "an integer >= 0")


def flag(dest: str) -> str:
    """The command-line spelling of an argparse destination: ``loss_mode`` -> ``--loss-mode``."""
    return "--" + dest.replace("_", "-")


def check_output_path(path: str, option: str) -> None:
    """Refuse an output path whose folder does not exist, before any work."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
