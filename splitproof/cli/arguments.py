"""What every subcommand of the ``splitproof`` command shares: exit codes, one-line usage errors, number
types, and output files that are checked before any work."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of our output went away (e.g. `| head`)
STDOUT = "-"


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
positive_float = number(float, lambda v: 0 < v < math.inf, "a positive finite number")
nonnegative_float = number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
finite_float = number(float, math.isfinite, "a finite number")
nonnegative_int = number(int, lambda v: v >= 0, "an integer >= 0")


def flag(dest: str) -> str:
    """The command-line spelling of an argparse destination: ``loss_mode`` -> ``--loss-mode``."""
    return "--" + dest.replace("_", "-")


def check_output_path(
    path: str, option: str, *, allow_stdout: bool = False, suffixes: tuple[str, ...] | None = None
) -> None:
    """Refuse, before any work, an output path that cannot be written: ``-`` where standard output is not
    allowed, a file type outside ``suffixes``, a directory, a missing folder, or a file that cannot be
    created or opened for writing (probed by opening it for appending; a file created by the probe is
    removed again)."""
    if path == STDOUT:
        if allow_stdout:
            return
        raise UsageError(f"{option} -: needs a file path (standard output is not supported here)")
    if suffixes is not None:
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in suffixes:
            raise UsageError(
                f"{option} {path}: unsupported file type {suffix or '(no extension)'}; use {', '.join(suffixes)}"
            )
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write here ({exc.strerror or type(exc).__name__})") from None
    if not existed:
        os.remove(path)


@contextmanager
def output_stream(path: str, option: str, *, binary: bool = False) -> Iterator[IO]:
    """An open output (standard output for ``-``); a failure to write is a one-line :class:`UsageError`."""
    if path == STDOUT:
        stream = sys.stdout.buffer if binary else sys.stdout
        yield stream
        stream.flush()
        return
    try:
        with open(path, "wb" if binary else "w") as f:
            yield f
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write ({exc.strerror or type(exc).__name__})") from None


PROGRESS_BARS_OFF = "HF_HUB_DISABLE_PROGRESS_BARS"  # read by huggingface_hub (and transformers) at import


@contextmanager
def quiet_loading() -> Iterator[None]:
    """No ``transformers`` progress bars (loading weights, writing shards) in this process, nor in the
    processes it starts (a pipelined run's rollout process: through the environment)."""
    from transformers.utils import logging as hf_logging

    was_enabled, before = hf_logging.is_progress_bar_enabled(), os.environ.get(PROGRESS_BARS_OFF)
    hf_logging.disable_progress_bar()
    os.environ[PROGRESS_BARS_OFF] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_BARS_OFF, None)
        else:
            os.environ[PROGRESS_BARS_OFF] = before
        if was_enabled:
            hf_logging.enable_progress_bar()
