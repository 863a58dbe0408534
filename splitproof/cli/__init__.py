"""The ``splitproof`` command (also ``python -m splitproof``): one subcommand per module
(``splitproof/cli/diagnose.py``, ...).

A subcommand module has ``add_parser(subparsers)``, which registers its parser and sets ``run`` (a
function of the parsed arguments returning the exit status) as that parser's default.

Exit status: 0 success (every verdict passes; the run finished), 1 a verdict fails (a training step failed), 2 bad
usage (a one-line message on
stderr, never a traceback), 130 interrupted, 141 the reader of the output went away (``| head``): the
command stops quietly.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import diagnose, export, train
from .arguments import EXIT_BROKEN_PIPE, EXIT_FAIL, EXIT_PASS, EXIT_USAGE, OneLineParser, UsageError

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAIL", "EXIT_PASS", "EXIT_USAGE", "UsageError", "build_parser", "main"]

COMMANDS = (diagnose, train, export)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="splitproof", description="Split-invariant RL policy updates for language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed command line; ``key=value`` overrides may stand on both sides of an option, as Hydra takes
    them (``train a=1 --config F b=2``): argparse alone stops collecting positionals at the option."""
    args, rest = parser.parse_known_args(argv)
    if rest and getattr(args, "overrides", None) is not None and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides = [*args.overrides, *rest]
        return args
    return parser.parse_args(argv)  # argparse's own error for anything else


def main(argv: list[str] | None = None) -> int:
    """Run ``splitproof ARGV...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        try:
            args = _parse(parser, argv)
        except SystemExit as exc:  # --help / --version
            code = int(exc.code or 0)
        else:
            if args.command is None:
                parser.print_help()
                code = EXIT_USAGE
            else:
                args.argv = argv[1:]
                code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except UsageError as exc:
        print(f"splitproof: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("splitproof: interrupted", file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's final flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # an in-process stream without a file descriptor
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
