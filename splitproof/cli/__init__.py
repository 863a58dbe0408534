"""The ``splitproof`` command: one subcommand per module (``splitproof/cli/diagnose.py``, ...).

A subcommand module has ``add_parser(subparsers)``, which registers its parser and sets ``run`` (a
function of the parsed arguments returning the exit status) as that parser's default.

Exit status: 0 success (every verdict passes), 1 a verdict fails, 2 bad usage (a one-line message on
stderr, never a traceback).
"""

from __future__ import annotations

import sys

from . import diagnose
from .common import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, OneLineParser, UsageError

__all__ = ["EXIT_FAIL", "EXIT_PASS", "EXIT_USAGE", "UsageError", "build_parser", "main"]

COMMANDS = (diagnose,)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="splitproof", description="Split-invariant RL policy updates for language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``splitproof ARGV...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        args.argv = argv[1:]
        return args.run(args)
    except UsageError as exc:
        print(f"splitproof: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("splitproof: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
