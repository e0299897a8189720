"""One line for bad input, shared by the single-process tools.

A tool's user can be wrong in a few ways: a flag missing or with a bad value, a file that is not
there or not what the flag expects. Each is reported as one line on stderr naming the problem
and what to do, with exit status 2. Anything else (a bug in megalite or the tool) is left to
raise, so its traceback shows.
"""
import argparse
import os


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a missing or bad flag as one line and exit 2.

    argparse prints its whole usage block before the error; this prints the error and where
    the flags are described: ``PROG: error: MESSAGE (PROG --help lists the flags)``.
    """
    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} ({parser.prog} --help lists the flags)\n")

    parser.error = error
    return parser


def positive(parser: argparse.ArgumentParser, flag: str, *values: int) -> None:
    """Refuse a count below 1 given to ``flag``, through the parser's one-line error."""
    for value in values:
        if value < 1:
            parser.error(f"{flag} takes positive integers, got {value}")


def writable(parser: argparse.ArgumentParser, flag: str, path) -> None:
    """Refuse an output path whose folder does not exist before any work is done."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder is not None and not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist (create it, or give another path)")
